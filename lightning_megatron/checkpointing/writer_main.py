"""The entry point of the async-save writer process (:mod:`.write_process`), run by its file path.

The writer needs the checkpointing modules and Megatron's writer, not the package's public API: importing
``lightning_megatron`` runs its ``__init__``, which imports Lightning, torchmetrics, the models and the strategy --
seconds of a process start that runs while the training process starts too, so that a save made in the first steps
would wait for it. Here ``lightning_megatron`` is entered in ``sys.modules`` as a package whose ``__init__`` does
not run; its submodules import as usual. ``megatron.core`` likewise: its ``__init__`` imports the models, the
transformer and the fusions (with ``torch._inductor``), half of what the writer would import. Megatron's writer is
imported before the writer serves (unpickling the first save would import it, seconds into that save). The package
itself never imports this module. (Run as ``-m`` from a zipped install, the package is imported whole first.)
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _package_without_init(name: str, package: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None  # a file location always gives a spec
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    return module


def _megatron_core_without_init() -> None:
    import megatron

    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:  # an unusual install: imported whole where needed
        return
    megatron.core = _package_without_init("megatron.core", Path(next(iter(spec.submodule_search_locations))))
    # megatron.core.utils and parallel_state import each other; parallel_state must start (as the package's
    # __init__ has it), or utils stops at a name parallel_state has not defined yet.
    import megatron.core.parallel_state  # noqa: F401


if __name__ == "__main__":
    if "lightning_megatron" not in sys.modules:
        _package_without_init("lightning_megatron", Path(__file__).resolve().parents[1])
    if "megatron.core" not in sys.modules:
        _megatron_core_without_init()
    from lightning_megatron import quiet

    with quiet.importing():  # now, not when the first save arrives: what unpickling a save imports (seconds)
        import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401

        import lightning_megatron.checkpointing.saving  # noqa: F401
    from lightning_megatron.checkpointing.write_process import serve

    serve(int(sys.argv[-2]), int(sys.argv[-1]))
