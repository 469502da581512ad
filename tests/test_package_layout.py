"""The package's shape: imports point one way (no cycles; function-level and TYPE_CHECKING imports counted), no file
uses another file's private names, files and functions stay small, and the public API imports from the top level."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "lightning_megatron"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
# docs/architecture.md "Layering", top to bottom: a module imports its own layer or the ones below. A model
# family (gpt, rl) and the kernels it builds with sit above the framework; the framework imports neither.
LAYERS = [
    ("lightning_megatron",),
    ("cli", "presets", "__main__"),
    ("rl",),
    ("gpt",),
    ("kernels",),
    (
        "strategy",
        "strategy_checkpoints",
        "strategy_data",
        "strategy_params",
        "runstate",
        "callbacks",
        "weight_averaging",
    ),
    ("modules",),
    ("schedule", "micro_batches"),
    ("checkpointing",),
    ("training",),
    ("data",),
    ("parallel",),
    ("compat",),
    ("contract", "validation"),
]


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: set[str] = field(default_factory=set)
    """Package modules this one imports: at module level, inside functions and under ``if TYPE_CHECKING:`` alike
    (a type-only import is still a dependency a reader follows, and a circle through one is still a circle)."""
    private: list[str] = field(default_factory=list)
    """``module._name`` uses of another package module's private names."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _collect(module: Module, names: set[str]) -> None:
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    aliases: dict[str, str] = {}  # local name -> package module it is bound to
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in names:
                    module.imports.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if not base.startswith(PACKAGE.name):
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in names:  # `from package import submodule`
                    module.imports.add(target)
                    aliases[alias.asname or alias.name] = target
                else:
                    module.imports.add(base)
                    if alias.name.startswith("_"):
                        module.private.append(f"{base}.{alias.name}")
    for node in ast.walk(module.tree):
        bound = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
        if bound and node.attr.startswith("_") and not node.attr.startswith("__"):
            module.private.append(f"{aliases[node.value.id]}.{node.attr}")


def _modules() -> dict[str, Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        modules[name] = Module(name, path, ast.parse(path.read_text(), filename=str(path)))
    for module in modules.values():
        _collect(module, set(modules))
    return modules


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself): Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


MODULES = _modules()


def test_the_checker_sees_cycles_and_private_names() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from lightning_megatron.parallel import state\n"
        "if TYPE_CHECKING:\n    from lightning_megatron import strategy\n"
        "def f():\n    from lightning_megatron.gpt.config import _hidden\n    return state._secret\n"
    )
    module = Module("lightning_megatron.x", PACKAGE / "x.py", tree)
    _collect(module, set(MODULES))
    assert module.imports == {
        "lightning_megatron.parallel.state",
        "lightning_megatron.strategy",
        "lightning_megatron.gpt.config",
    }
    assert sorted(module.private) == [
        "lightning_megatron.gpt.config._hidden",
        "lightning_megatron.parallel.state._secret",
    ]


def test_no_import_cycles() -> None:
    graph = {name: module.imports for name, module in MODULES.items()}
    assert _cycles(graph) == []


def _layer(name: str) -> int:
    parts = name.split(".")
    head = parts[1] if len(parts) > 1 else parts[0]
    return next(i for i, layer in enumerate(LAYERS) if head in layer)


def test_imports_point_down_the_layers() -> None:
    upward = [
        (name, target) for name, module in MODULES.items() for target in module.imports if _layer(target) < _layer(name)
    ]
    assert upward == []


def test_no_private_names_across_files() -> None:
    used = {name: module.private for name, module in MODULES.items() if module.private}
    assert used == {}


def test_the_strategy_knows_no_model_family() -> None:
    # What a family needs around the step reaches the strategy through the module's ModelHooks (contract.py): the
    # strategy imports nothing of gpt/, rl/ or kernels/, directly or through any module it imports.
    family = ("lightning_megatron.gpt", "lightning_megatron.rl", "lightning_megatron.kernels")
    reached, todo = set(), ["lightning_megatron.strategy"]
    while todo:
        for target in MODULES[todo.pop()].imports - reached:
            reached.add(target)
            todo.append(target)
    bases = ("strategy_checkpoints", "strategy_data", "strategy_params", "runstate")
    assert {f"lightning_megatron.{name}" for name in bases} <= reached
    assert sorted(target for target in reached if target.startswith(family)) == []


def test_the_modules_do_not_import_the_strategy() -> None:
    # configure_model builds chunks through contract.MegatronRuntime; the optimizer code needs no module file.
    for name, module in MODULES.items():
        if name.startswith(("lightning_megatron.modules", "lightning_megatron.training")):
            assert "lightning_megatron.strategy" not in module.imports, name
        if name.startswith("lightning_megatron.training"):
            assert not any(i.startswith("lightning_megatron.modules") for i in module.imports), name


def test_contract_is_a_leaf_and_subpackages_export_nothing() -> None:
    assert MODULES["lightning_megatron.contract"].imports == set()
    for name, module in MODULES.items():
        if module.path.name == "__init__.py" and name != "lightning_megatron":
            assert module.imports == set(), f"{name}/__init__.py imports {module.imports}: keep it a docstring"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_functions_stay_small(name: str) -> None:
    module = MODULES[name]
    lines = len(module.path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{module.path} has {lines} lines"
    for node in ast.walk(module.tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert length <= MAX_FUNCTION_LINES, f"{module.path}:{node.lineno} {node.name} has {length} lines"


def test_public_api() -> None:
    import lightning_megatron

    expected = {
        "ByteCorpusDataModule", "CheckpointConfig", "ChunkSpec", "DataParallelShard", "LoRAConfig", "MegatronEMA",
        "MegatronLMFromHF", "MegatronLMModule", "MegatronLightningModule", "MegatronStrategy", "MegatronThroughput",
        "MegatronValueModule", "MegatronWeightAveraging", "ModelConfig", "OptimizerSpec",
        "ParallelSizes", "Preempted", "SaveHF", "StepStats", "TokenFileDataModule", "pack_sequences", "tiny_gpt",
    }  # fmt: skip
    assert set(lightning_megatron.__all__) == expected
    for name in expected:
        assert getattr(lightning_megatron, name).__name__ == name
