"""Checkpoints: sharded save/load through Megatron's dist_checkpointing (and its megatron-core workarounds),
the checks run before a load, the (partial/async) writer, and the resumable training loader."""
