"""``sys.modules`` entries for the async-save writer process (``checkpointing/save/writer_main.py``), which loads this
file by its path before it imports anything of the package.

Importing ``lightning_megatron`` runs its ``__init__`` (Lightning, torchmetrics, the models, the strategy: seconds
of a process start, running while the training process starts too, so that a save in the first steps would wait
for it); ``megatron.core``'s ``__init__`` imports the models, the transformer and the fusions (``torch._inductor``).
The writer needs neither: each is entered as a package whose ``__init__`` does not run, and its submodules import
as usual. ``register.py`` lists these entries.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def package_without_init(name: str, package: Path) -> ModuleType:
    """Enter ``name`` in ``sys.modules`` as the package at ``package``, its ``__init__`` not run."""
    spec = importlib.util.spec_from_file_location(
        name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None  # a file location always gives a spec
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    return module


def megatron_core_without_init() -> None:
    """``megatron.core`` entered without its ``__init__`` (then ``parallel_state`` imported, as that does)."""
    import megatron

    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:  # an unusual install: imported whole where needed
        return
    megatron.core = package_without_init("megatron.core", Path(next(iter(spec.submodule_search_locations))))  # type: ignore[attr-defined]
    # megatron.core.utils and parallel_state import each other; parallel_state must start (as the package's
    # __init__ has it), or utils stops at a name parallel_state has not defined yet.
    import megatron.core.parallel_state  # noqa: F401


def enter(package_root: Path) -> None:
    """Both entries, each only if that package is not imported already."""
    if "lightning_megatron" not in sys.modules:
        package_without_init("lightning_megatron", package_root)
    if "megatron.core" not in sys.modules:
        megatron_core_without_init()
