"""Parallel layout: sizes and their validation, Megatron's parallel state, DDP wrapping and mixed precision."""
