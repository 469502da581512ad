"""The compat register (lightning_megatron/compat/register.py): every workaround listed with why and when it can go,
each upstream name it relies on present in the installed packages, and the installed megatron-core and Lightning
inside the versions the register was checked against -- or a failure naming the entries to re-check."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from lightning_megatron.compat import patches
from lightning_megatron.compat.class_swap import swap_class
from lightning_megatron.compat.register import CHECKED, REGISTER, Workaround

PACKAGE = Path(__file__).parent.parent / "lightning_megatron"


def _resolve(target: str) -> Any:
    """``module:Qualified.name`` -> the object (``AttributeError``/``ImportError`` if gone)."""
    module, _, qualified = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, qualified.split(".")):
        obj = getattr(obj, part)
    return obj


def _present(target: str) -> bool:
    """Whether ``target`` resolves; ``module:Class#attr``: the class (or a base) has it, or its own code assigns it to
    its instances (``self.attr =``, or a dataclass field)."""
    name, _, attribute = target.partition("#")
    obj = _resolve(name)
    if not attribute:
        return True
    for cls in inspect.getmro(obj):
        if attribute in vars(cls) or attribute in getattr(cls, "__dataclass_fields__", {}):
            return True
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"self\.{re.escape(attribute)}\s*(:[^=]+)?[=,)]", source):  # also `self.a, self.b = ...`
            return True
    return False


def _out_of_range(installed: dict[str, str]) -> dict[str, list[str]]:
    """Per upstream package whose installed version is outside CHECKED: the entries to re-check."""
    stale = {}
    for package, (lowest, first_unchecked) in CHECKED.items():
        if not Version(lowest) <= Version(installed[package]) < Version(first_unchecked):
            stale[package] = [entry.name for entry in REGISTER if entry.package == package]
    return stale


def test_the_installed_versions_are_the_ones_the_register_was_checked_against() -> None:
    installed = {package: version(package) for package in CHECKED}
    stale = _out_of_range(installed)
    assert not stale, "; ".join(
        f"{package} {installed[package]} is outside the checked {CHECKED[package][0]} <= v < {CHECKED[package][1]}: "
        f"re-check {', '.join(names)} (lightning_megatron/compat/register.py), then move CHECKED"
        for package, names in stale.items()
    )


def test_a_version_outside_the_range_names_the_entries_to_recheck() -> None:
    stale = _out_of_range({"megatron-core": "0.20.1", "lightning": "2.6.6", "torch": "2.14.1"})
    assert list(stale) == ["megatron-core"]
    assert "KeepAdamStepOnLoad" in stale["megatron-core"]
    assert "lightning_internals" not in stale["megatron-core"]
    assert _out_of_range({"megatron-core": "0.19.2", "lightning": "2.6.6", "torch": "2.14.1+cu130"}) == {}


@pytest.mark.parametrize("entry", REGISTER, ids=lambda entry: entry.name)
def test_each_entry_says_why_where_and_when_and_what_it_touches_exists(entry: Workaround) -> None:
    assert _resolve(entry.where if ":" in entry.where else f"{entry.where}:")
    assert len(entry.why.split()) >= 10, entry.name
    assert re.search(r"\d+\.\d+", entry.droppable), f"{entry.name}: name the version it was checked against"
    missing = [target for target in entry.touches if not _present(target)]
    assert not missing, f"{entry.name} relies on {missing}, gone from the installed {entry.package}"


def test_the_checker_sees_a_missing_upstream_name() -> None:
    assert not _present("megatron.core.model_parallel_config:ModelParallelConfig#no_such_hook")
    with pytest.raises(AttributeError):
        _present("megatron.core.optimizer:ChainedOptimizer.no_such_method")


BASES = (patches.Patch, patches.ModuleFunctions)


def test_every_patch_is_registered() -> None:
    classes = {
        name
        for name, cls in vars(patches).items()
        if inspect.isclass(cls)
        and issubclass(cls, patches.Patch)
        and cls not in (patches.Patch, patches.ModuleFunctions)
    }
    assert classes <= {entry.name for entry in REGISTER if entry.kind == "patch"}


# Private names read outside compat/ that are neither Megatron's nor Lightning's: torch's operators and attributes,
# the standard library's, LitData's (registered: read where the data code shards), and Megatron's
# ColumnParallelLinear._forward_impl, which the package's own subclasses override (the registered class swap).
NOT_UPSTREAM = {"_replace", "_exit", "_assert_async", "_grouped_mm", "_scaled_mm", "_version", "_world", "_datasets"}
NOT_UPSTREAM |= {"_forward_impl"}


def _own_private_names() -> set[str]:
    """The private names the package defines itself: assigned attributes (``self._x = ...``, ``obj._x = ...``),
    functions, methods, classes and module-level or class-level names."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for leaf in (leaf for target in targets for leaf in ast.walk(target)):
                    names.update({leaf.attr} if isinstance(leaf, ast.Attribute) else set())
                    names.update({leaf.id} if isinstance(leaf, ast.Name) else set())
    return {name for name in names if name.startswith("_")}


def _private_reads(source: str, own: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each private attribute ``source`` reads (``x._name``, ``getattr(x, "_name")``) that the
    package does not define itself and that is not in :data:`NOT_UPSTREAM`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = node.attr if isinstance(node, ast.Attribute) else None
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            constant = node.args[1] if len(node.args) > 1 else None
            name = constant.value if isinstance(constant, ast.Constant) and isinstance(constant.value, str) else None
        private = name is not None and name.startswith("_") and not name.startswith("__")
        if private and name not in own and name not in NOT_UPSTREAM and not name.startswith("_foreach_"):
            found.append((node.lineno, name))
    return found


def test_megatron_and_lightning_privates_are_read_only_in_compat() -> None:
    own = _own_private_names()
    found = [
        f"{path.relative_to(PACKAGE)}:{line} {name}"
        for path in PACKAGE.rglob("*.py")
        if "compat" not in path.relative_to(PACKAGE).parts
        for line, name in _private_reads(path.read_text(), own)
    ]
    assert found == [], "read these through lightning_megatron/compat/ (and register them): " + ", ".join(found)


def test_the_private_read_checker_sees_reads_of_upstream_privates() -> None:
    source = "def f(trainer, module):\n    x = trainer.fit_loop._skip\n    return getattr(module, '_trainer')\n"
    assert _private_reads(source, own={"_mine"}) == [(2, "_skip"), (3, "_trainer")]
    assert _private_reads("def f(obj):\n    return obj._mine, obj._exit\n", own={"_mine"}) == []


def test_only_non_private_reads_and_call_sites_stay_outside_compat() -> None:
    # Patches, fixes, sys.modules entries and Megatron's/Lightning's private reads live in compat/; non-private
    # internals read by the code that needs them (Megatron's optimizer layout, its config hooks), the class swap's
    # call site and LitData's and torch's privates stay with their users, each listed here.
    outside = {entry.name: entry.kind for entry in REGISTER if not entry.where.startswith("lightning_megatron.compat")}
    assert all(kind in ("config hook", "internals read", "class swap", "private read") for kind in outside.values())
    private = [name for name, kind in outside.items() if kind == "private read"]
    assert private == ["compiled block masks", "CombinedStreamingDataset._datasets"]


def test_a_class_swap_takes_only_a_stateless_subclass() -> None:
    class Base:
        def __init__(self) -> None:
            self.x = 1

    class Stateless(Base):
        def value(self) -> int:
            return self.x + 1

    class Stateful(Base):
        def __init__(self) -> None:
            super().__init__()
            self.y = 2

    obj = Base()
    swap_class(obj, Stateless)
    assert type(obj) is Stateless
    assert obj.value() == 2
    for bad in (Stateful, int):
        with pytest.raises(TypeError, match="cannot replace the class"):
            swap_class(Base(), bad)


def test_the_docs_table_lists_exactly_the_registered_patches() -> None:
    # docs/architecture.md "Process-wide patches" has one row per patch; the register is the source of truth.
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert rows == {entry.name for entry in REGISTER if entry.kind == "patch"}
