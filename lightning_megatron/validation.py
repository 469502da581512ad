"""Argument checks shared by the configs: what they reject is named with its value and what would work."""

from __future__ import annotations

from typing import Any


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending (the values an error message can offer instead)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def next_multiple(n: int, k: int) -> int:
    """The smallest multiple of ``k`` that is >= ``n``."""
    return -(-n // k) * k


def check_positive_int(name: str, value: object, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1 (``bool`` is refused: ``True`` is not a size)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer{hint}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``.

    ``Literal`` annotations are enforced by jsonargparse only; plain Python construction is not checked.
    """
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; pick one of {list(choices)}")
