"""The entry point of the async-save writer process (:mod:`.write_process`), run by its file path.

The writer needs the checkpointing modules and Megatron's writer, not the package's public API: before importing
anything, ``lightning_megatron`` and ``megatron.core`` are entered in ``sys.modules`` without running their
``__init__`` (``compat/lean_imports.py``, loaded by its path: importing it the usual way would run the package's
``__init__``). Megatron's writer is imported before the writer serves (unpickling the first save would import it,
seconds into that save). The package itself never imports this module. (Run as ``-m`` from a zipped install, the
package is imported whole first.)
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def package_root() -> Path:
    """The ``lightning_megatron`` folder this file belongs to."""
    return next(parent for parent in Path(__file__).resolve().parents if (parent / "compat").is_dir())


def lean_imports() -> ModuleType:
    """``compat/lean_imports.py``, loaded by its path."""
    spec = importlib.util.spec_from_file_location(
        "lightning_megatron_lean_imports", package_root() / "compat" / "lean_imports.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    lean_imports().enter(package_root())
    from lightning_megatron.compat import quiet

    with quiet.importing():  # now, not when the first save arrives: what unpickling a save imports (seconds)
        import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401

        import lightning_megatron.checkpointing.save.saving  # noqa: F401
    from lightning_megatron.checkpointing.save.write_process import serve

    serve(int(sys.argv[-2]), int(sys.argv[-1]))
