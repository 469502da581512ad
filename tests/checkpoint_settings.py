"""A value other than the default for every ``CheckpointConfig`` setting, shared by ``test_checkpoint_config.py``
and ``test_cli.py`` (which sets them from a YAML).

A helper module, not a test module: test modules import its names; it imports no test module.
"""

SETTINGS = {"async_save": True, "save_model_weights": False, "keep_host_buffers": False, "read_threads": 4}
