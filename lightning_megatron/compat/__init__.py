"""Every workaround of an upstream limitation, listed in ``register.py`` with why it exists, what it touches and
the upstream version that makes it droppable. Here live the patches of third-party objects (``patches.py``, with
CPU mode in ``cpu.py`` and the quiet console in ``quiet.py``), fixes of Megatron's optimizer state
(``mcore_fixes.py``), every read of a Megatron or Lightning private name (``megatron_internals.py``,
``lightning_internals.py``), the writer process's ``sys.modules`` entries (``lean_imports.py``) and the class swap
(``class_swap.py``). Reads of Megatron's non-private internals (its optimizer's layout, its config hooks) stay with
the code that needs them, each listed in the register. ``tests/test_compat.py`` checks the register against the
installed versions."""
