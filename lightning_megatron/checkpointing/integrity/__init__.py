"""Integrity: the checksums written with every shard and verified on load (``checksums``), and the checks run
before anything is read (``checks``: restricted unpickling, files complete, shapes and model config)."""
