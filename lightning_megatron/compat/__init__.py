"""Every workaround of an upstream limitation in one place: patches of third-party objects (``patches.py``, with CPU
mode in ``cpu.py`` and the quiet console in ``quiet.py``), fixes of Megatron's optimizer state (``mcore_fixes.py``),
reads of Megatron's and Lightning's internals (``megatron_internals.py``, ``lightning_internals.py``), the writer
process's lean imports (``lean_imports.py``) and class swaps (``class_swap.py``). ``register.py`` lists each with
why it exists, what it touches and the upstream version that makes it droppable; ``tests/test_compat.py`` checks
the register against the installed versions."""
