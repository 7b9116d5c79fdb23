"""Typed options: the one way a choice or a bounded number is checked.

An option's choices are an Enum whose values are the words users type (the API
takes the word or the member, the command line offers the same words); bounded
integers are checked by `bounded`. Both raise OptionError with one line that names
the option, what it accepts and what it got, whoever asked: the Python API,
`commref check` or `commref bench`.
"""

from __future__ import annotations

import enum
import math
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
        where = (f"in [{low}, {high}]" if low is not None and high is not None
                 else f">= {low}" if low is not None else f"<= {high}")
        if multiple > 1:
            where += f" and a multiple of {multiple}"
        raise OptionError(f"{what} must be {where}, got {value}")
    return value


def seconds(value, what: str = "timeout") -> float:
    """A positive, finite number of seconds."""
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{what} must be a number of seconds, not {value!r}") from None
    if not s > 0 or math.isinf(s):
        raise OptionError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return s
