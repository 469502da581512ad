"""CheckpointConfig, the checkpoint writer's settings: checked when made, given as MegatronStrategy(checkpoint=...)
(``async_save=`` too), and the writer's former attributes refused with the new way named. The LightningCLI YAML that
sets them is in test_cli.py; the runs that use them in test_checkpoint_cost.py and test_prestage.py."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

import pytest

from lightning_megatron import CheckpointConfig, MegatronStrategy
from tests.checkpoint_settings import SETTINGS


def test_every_setting_is_a_field_with_a_docstring() -> None:
    fields = {field.name for field in dataclasses.fields(CheckpointConfig)}
    assert fields == set(SETTINGS)
    (cls,) = [node for node in ast.parse(inspect.getsource(CheckpointConfig)).body if isinstance(node, ast.ClassDef)]
    documented = {
        node.target.id  # type: ignore[union-attr]
        for node, after in zip(cls.body, cls.body[1:], strict=False)
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    }
    assert documented == fields  # shown by the CLI's --help (attribute docstrings)
    assert all(getattr(CheckpointConfig(), name) != value for name, value in SETTINGS.items())
    assert CheckpointConfig(**SETTINGS) == CheckpointConfig(**SETTINGS)
    with pytest.raises(TypeError):
        CheckpointConfig(True)  # type: ignore[misc]  # keywords only


@pytest.mark.parametrize(
    ("field", "value", "works"),
    [
        ("async_save", 1, "give True or False"),
        ("save_model_weights", "no", "give True or False"),
        ("keep_host_buffers", None, "give True or False"),
        ("read_threads", 0, "give a positive int"),
        ("read_threads", -1, "give a positive int"),
        ("read_threads", 1.5, "give a positive int"),
        ("read_threads", True, "give a positive int"),
    ],
)
def test_a_bad_value_names_the_field_the_value_and_what_works(field: str, value: object, works: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"CheckpointConfig({field}={value!r}): {works}")):
        CheckpointConfig(**{field: value})


def test_the_strategy_takes_the_config_and_async_save_alike_or_refuses_a_conflict() -> None:
    assert MegatronStrategy().checkpoint_writer.config == CheckpointConfig()
    assert MegatronStrategy(async_save=True).checkpoint_writer.config == CheckpointConfig(async_save=True)
    given = CheckpointConfig(async_save=True, read_threads=2)
    assert MegatronStrategy(checkpoint=given).checkpoint_writer.config is given
    assert MegatronStrategy(async_save=True, checkpoint=given).checkpoint_writer.config is given  # the same: fine
    conflict = "(async_save=False, checkpoint=CheckpointConfig(async_save=True, ...)) disagree"
    with pytest.raises(ValueError, match=re.escape(conflict)):
        MegatronStrategy(async_save=False, checkpoint=given)
    with pytest.raises(TypeError, match=re.escape("give a lightning_megatron.CheckpointConfig(...)")):
        MegatronStrategy(checkpoint={"read_threads": 2})  # type: ignore[arg-type]


def test_the_writers_former_attributes_fail_loudly_naming_the_new_way() -> None:
    writer = MegatronStrategy().checkpoint_writer
    for name, value in SETTINGS.items():
        new_way = f"MegatronStrategy(checkpoint=CheckpointConfig({name}={value!r}))"
        with pytest.raises(AttributeError, match=re.escape(new_way)):
            setattr(writer, name, value)
        with pytest.raises(AttributeError, match=re.escape(f"checkpoint_writer.config.{name}")):
            getattr(writer, name)
    assert writer.config == CheckpointConfig()  # nothing changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        writer.config.read_threads = 4  # type: ignore[misc]
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = writer.nothing  # type: ignore[attr-defined]
