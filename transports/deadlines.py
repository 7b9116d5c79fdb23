"""The deadline of every control-plane wait: ``$COMMREF_TIMEOUT`` (seconds, 60 when
unset) and the check a timeout argument passes (positive, finite)."""

from __future__ import annotations

import os

__all__ = ["TIMEOUT_ENV", "check_timeout", "default_timeout"]

TIMEOUT_ENV = "COMMREF_TIMEOUT"
"""Environment variable holding the default deadline (seconds) of every wait."""

_DEFAULT_TIMEOUT_S = "60"


def default_timeout() -> float:
    """The default deadline in seconds: ``float($COMMREF_TIMEOUT)``, 60 when unset.

    Raises ValueError if the variable is not a positive number.
    """
    raw = os.environ.get(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive, finite number of seconds")
    return seconds


def check_timeout(timeout: float) -> float:
    """`timeout` in seconds as a float; ValueError unless positive and finite."""
    seconds = float(timeout)
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return seconds
