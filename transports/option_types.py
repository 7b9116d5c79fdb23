"""Typed options: the one way a choice or a bounded number is checked.

An option's choices are an Enum whose values are the words users type (the API
takes the word or the member, the command line offers the same words); bounded
integers are checked by `bounded`, quantities with units ("12.5G", "5us") by
`quantity`. All raise OptionError with one line that names the option, what it
accepts and what it got, whoever asked: the Python API, `commref check` or
`commref bench`.
"""

from __future__ import annotations

import enum
import math
import re
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


class OptionError(ValueError):
    """An option outside what it accepts (a one-line message)."""


class Choice(str, enum.Enum):
    """An option's choices: members compare equal to the word that names them."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def words(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


def choice(cls: type[E], value, what: str) -> E:
    """`value` (a member or its word) as a member of `cls`."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise OptionError(f"{what} must be one of {', '.join(m.value for m in cls)}, not {value!r}") from None


def bounded(value, what: str, low: int | None = None, high: int | None = None, multiple: int = 1) -> int:
    """`value` as an int in [low, high] (either end open when None) and a multiple of `multiple`."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, bool) or int(value) != value:
                raise TypeError
            value = int(value)
        except (TypeError, ValueError):
            raise OptionError(f"{what} must be an integer, not {value!r}") from None
    if (low is not None and value < low) or (high is not None and value > high) or value % multiple:
        where = (
            f"in [{low}, {high}]"
            if low is not None and high is not None
            else f">= {low}"
            if low is not None
            else f"<= {high}"
        )
        if multiple > 1:
            where += f" and a multiple of {multiple}"
        raise OptionError(f"{what} must be {where}, got {value}")
    return value


FLAG_WORDS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def flag(value, what: str) -> bool:
    """`value` as a bool: a bool, 0 or 1, or a word of FLAG_WORDS (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in FLAG_WORDS:
        return FLAG_WORDS[value.strip().lower()]
    raise OptionError(f"{what} must be true or false (or 1, 0, on, off, yes, no), not {value!r}")


def seconds(value, what: str = "timeout") -> float:
    """A positive, finite number of seconds."""
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{what} must be a number of seconds, not {value!r}") from None
    if not s > 0 or math.isinf(s):
        raise OptionError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return s


RATE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}  # decimal, as GB/s in the benchmark
TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z/]*)\s*")


def quantity(value, what: str, units: dict[str, float], example: str) -> float:
    """`value` (a number, or a number with one of `units`' suffixes) as a finite float >= 0."""
    if isinstance(value, str):
        m = _QUANTITY.fullmatch(value.lower())
        unit = m.group(2).removesuffix("b/s").removesuffix("b") if m else None
        if unit is not None and unit in units:
            value = float(m.group(1)) * units[unit]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise OptionError(f"{what} must be a number >= 0 in {example}, not {value!r}")
    return float(value)
