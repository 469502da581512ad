"""Class swaps: an object Megatron builds itself, outside any layer spec, given a subclass of its class.

Megatron's ``GPTModel`` builds its output layer (a ``ColumnParallelLinear``) directly; the only way to give it our
forward (the fused weight gradient, batch-first logits) without building the model ourselves is to change the
object's class to a subclass that adds no state. ``register.py`` lists each swap.
"""

from __future__ import annotations

from typing import Any


def swap_class(obj: Any, subclass: type) -> None:
    """Make ``obj`` an instance of ``subclass``, a subclass of its class that defines no ``__init__`` of its own
    (so every attribute it reads was set by the original class's constructor); ``TypeError`` otherwise."""
    if type(obj) not in subclass.__mro__[1:] or "__init__" in vars(subclass):
        raise TypeError(
            f"{subclass.__name__} cannot replace the class of a {type(obj).__name__}: it must subclass it and define "
            "no __init__ (no state of its own)"
        )
    obj.__class__ = subclass
