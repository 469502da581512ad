"""The GPT modules' optimizer settings: Megatron's Adam and its LR schedule, as one validated dataclass.

:class:`~lightning_megatron.gpt.model.GPTModule` takes these fields as flat keyword arguments, with the defaults of
:data:`DEFAULT_OPTIMIZER`: users write ``MegatronLMModule(config, lr=1e-3)`` and ``lr:`` in a LightningCLI YAML
(jsonargparse reads the constructor's signature), and saved hyper-parameters and checkpoints carry the same flat
names. The module keeps them as one :class:`OptimizerSettings`, which checks them and turns them into the strategy's
:class:`~lightning_megatron.contract.OptimizerSpec`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_megatron.contract import OptimizerSpec
from lightning_megatron.validation import check_choice

DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]
DECAY_STYLES: tuple[str, ...] = get_args(DecayStyle)


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam with decoupled weight decay (Megatron's optimizer) and a warm-up + decay LR schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables); done by Megatron's optimizer."""
    warmup_steps: int = 0
    """Linear LR warm-up steps."""
    decay_steps: int | None = None
    """LR decay steps; ``None`` decays over the Trainer's total steps."""
    decay_style: DecayStyle = "cosine"
    """LR decay shape."""
    override_lr_schedule: bool = False
    """On resume, follow this schedule from the checkpoint's step instead of raising when it differs from the saved
    one (:attr:`OptimizerSpec.override_lr_schedule`)."""

    def __post_init__(self) -> None:
        # A hparams file or a CSV gives betas as a list: one canonical form, so settings compare equal.
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        _check_number("lr", self.lr, "positive", lambda lr: lr > 0)
        _check_number("min_lr", self.min_lr, f"in [0, lr={self.lr}]", lambda min_lr: 0 <= min_lr <= self.lr)
        _check_number("weight_decay", self.weight_decay, ">= 0", lambda decay: decay >= 0)
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise ValueError(f"betas={self.betas!r} must be two numbers (beta1, beta2) in [0, 1)")
        for i, beta in enumerate(self.betas):
            _check_number(f"betas[{i}]", beta, "in [0, 1)", lambda b: 0 <= b < 1)
        _check_number("eps", self.eps, "positive", lambda eps: eps > 0)
        _check_number("clip_grad", self.clip_grad, ">= 0 (0 disables clipping)", lambda clip: clip >= 0)
        object.__setattr__(self, "warmup_steps", _check_steps("warmup_steps", self.warmup_steps, minimum=0))
        if self.decay_steps is not None:
            object.__setattr__(self, "decay_steps", _check_steps("decay_steps", self.decay_steps, minimum=1))
        check_choice("decay_style", self.decay_style, DECAY_STYLES)

    def __getitem__(self, name: str) -> Any:
        """``settings["lr"]``, as when the settings were a dict: the field of that name."""
        if name not in {field.name for field in dataclasses.fields(self)}:
            raise KeyError(
                f"{name!r} is no optimizer setting; the fields: {[f.name for f in dataclasses.fields(self)]}"
            )
        return getattr(self, name)

    def updated(self, values: Mapping[str, Any]) -> OptimizerSettings:
        """These settings with the fields ``values`` names replaced (other keys ignored), checked again."""
        names = {field.name for field in dataclasses.fields(self)}
        return dataclasses.replace(self, **{key: value for key, value in values.items() if key in names})

    def spec(self) -> OptimizerSpec:
        """Megatron's ``OptimizerConfig`` and the LR schedule, as the strategy builds them."""
        from megatron.core.optimizer import OptimizerConfig

        config = OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            min_lr=self.min_lr,
            weight_decay=self.weight_decay,
            adam_beta1=self.betas[0],
            adam_beta2=self.betas[1],
            adam_eps=self.eps,
            clip_grad=self.clip_grad,
        )
        return OptimizerSpec(
            config=config,
            lr_warmup_steps=self.warmup_steps,
            lr_decay_steps=self.decay_steps,
            lr_decay_style=self.decay_style,
            override_lr_schedule=self.override_lr_schedule,
        )


def _check_number(name: str, value: Any, bound: str, within: Callable[[float], bool]) -> None:
    """Raise ValueError unless ``value`` is a finite real number for which ``within`` (the ``bound`` it states)
    holds; ``bool`` is refused (``True`` is not a rate)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number, {bound}")
    if not within(value):
        raise ValueError(f"{name}={value!r} must be {bound}")


def _check_steps(name: str, value: object, minimum: int) -> int:
    """``value`` as an int (a whole float, e.g. from a YAML ``1e3``, included), or ``ValueError``."""
    whole = isinstance(value, float) and value.is_integer()
    if not (isinstance(value, int) or whole) or isinstance(value, bool) or value < minimum:  # type: ignore[operator]
        kind = "a positive integer" if minimum > 0 else "an integer >= 0"
        raise ValueError(f"{name}={value!r} must be {kind} of optimizer steps")
    return int(value)  # type: ignore[arg-type]


DEFAULT_OPTIMIZER = OptimizerSettings()
"""The defaults: the modules' keyword arguments take theirs from here, so they are written once."""
