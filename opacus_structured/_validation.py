"""Argument checks shared by every public entry point.

Each check raises ``ValueError`` naming the argument and the allowed range, so that bad input
never turns into a NaN epsilon, a hang or a silent fallback.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "check_finite",
    "check_positive",
    "check_nonnegative",
    "check_probability",
    "check_open_unit",
    "check_int",
]


def check_finite(name: str, value) -> float:
    if type(value) is not float:  # (a float is a real number: skip the ABC check per step)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a real number, got {value!r}")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def check_positive(name: str, value) -> float:
    value = check_finite(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def check_nonnegative(name: str, value) -> float:
    value = check_finite(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def check_probability(name: str, value, *, allow_zero: bool = False) -> float:
    """Check ``value`` in (0, 1] (or [0, 1] with ``allow_zero``)."""
    value = check_finite(name, value)
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return value


def check_open_unit(name: str, value) -> float:
    """Check ``value`` in the open interval (0, 1), e.g. a target delta."""
    value = check_finite(name, value)
    if not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return value


def check_int(name: str, value, *, minimum: int | None = 0, maximum: int | None = None) -> int:
    """Check ``value`` is an integer (a float with integral value is accepted) in range."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        value = int(value)
    else:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_lower_triangular_matrix(name: str, value, *, why: str = ""):
    """``value`` as a float64 non-empty, finite, square, lower-triangular numpy matrix.

    ``why`` is appended to the lower-triangular error (e.g. the lemma that needs it).
    """
    import numpy as np

    C = np.asarray(value, dtype=np.float64)
    if C.ndim != 2 or C.shape[0] != C.shape[1] or C.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty square matrix, got shape {C.shape}")
    if not np.all(np.isfinite(C)):
        raise ValueError(f"{name} must be finite")
    if np.any(np.triu(C, 1) != 0):
        raise ValueError(f"{name} must be lower-triangular{why}")
    return C
