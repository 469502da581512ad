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
    stale = _out_of_range({"megatron-core": "0.20.1", "lightning": "2.6.6"})
    assert list(stale) == ["megatron-core"]
    assert "KeepAdamStepOnLoad" in stale["megatron-core"]
    assert "lightning_internals" not in stale["megatron-core"]
    assert _out_of_range({"megatron-core": "0.19.2", "lightning": "2.6.6"}) == {}


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


def _privates_outside_compat() -> list[str]:
    """Uses of megatron-core's and Lightning's registered private names (``_max_depth``, ...) in package files
    outside ``compat/``, but an object's own attributes (``self._device``)."""
    upstream = [entry for entry in REGISTER if entry.package in CHECKED]  # megatron-core's and Lightning's
    names = {target.rpartition("#")[2].rpartition(".")[2] for entry in upstream for target in entry.touches}
    private = {name for name in names if name.startswith("_") and not name.startswith("__")}
    private -= {"_forward_impl"}  # overridden by the package's own subclasses (the class-swap entry), not read
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "compat" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            attribute = node.attr if isinstance(node, ast.Attribute) and not own else None
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                attribute = node.value
            if attribute in private:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {attribute}")
    return found


def test_registered_privates_are_read_only_in_compat() -> None:
    assert _privates_outside_compat() == []


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
