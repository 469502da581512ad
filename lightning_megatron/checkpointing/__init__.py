"""Checkpoints: sharded save/load through Megatron's ``dist_checkpointing``, reshardable across layouts.

- ``config.py``: :class:`CheckpointConfig`, the writer's settings; ``writer.py``: the strategy's
  :class:`CheckpointWriter` (sync/async saves, publish, deferred removals, loads); ``prestage.py``: host buffers
  staged when a fit starts.
- ``sharded.py``: the format -- the state a save writes and a load reads into, and the common-state keys;
  ``format/``: its parts (the module's state beside its chunks, the distributed optimizer's state, its split by
  expert-parallel size, weights stored as the optimizer's main weights).
- ``save/``: writing and publishing, host buffers and shared memory, the async writer process, save plans.
- ``load/``: the load plan and checks, the load, threaded reads, partial loads; ``opening.py``: opening a
  checkpoint for any read (files, metadata, common state).
- ``integrity/``: checksums and the checks before a read; ``contained.py``: paths kept inside a directory.
"""
