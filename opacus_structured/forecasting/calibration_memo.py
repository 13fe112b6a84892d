"""Remembered noise calibrations: the forecast job's σ search done once per setting.

:func:`train_forecaster` calibrates σ for a target ε by bisection (about a dozen PLD
evaluations, several seconds on 2 cores). The answer depends only on public quantities: the
scheme (its ``repr`` names every field), the number of steps, δ, the target ε, the PLD
discretization and the search tolerance. :func:`calibrate` looks that key up in

1. the user cache, ``<cache root>/calibrations.json``
   (:func:`~opacus_structured.forecasting.user_cache.cache_root`), written by earlier runs;
2. the package's ``data/calibrations.json``, shipped for the bundled panel's default run;

and accepts a remembered σ only after
:func:`~opacus_structured.accounting.calibration.hinted_noise_multiplier` has checked it in two
evaluations (``ε(σ) ≤`` target ``< ε(σ(1 - rtol))``): a hit is exactly as good as a new search,
and a stale entry (the accounting changed since) is searched again, never trusted. Nothing
private is stored: the key and σ are functions of public constants.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from typing import Callable, Optional

from ..accounting.calibration import calibrate_noise_multiplier, hinted_noise_multiplier
from .user_cache import cache_root

__all__ = ["calibration_key", "calibrate", "memo_path"]


def calibration_key(scheme, steps: int, delta: float, epsilon: float, discretization: float,
                    rtol: float) -> str:
    """The memo key: every public input of the σ search."""
    return (f"{scheme!r}|steps={int(steps)}|delta={float(delta)!r}|epsilon={float(epsilon)!r}"
            f"|discretization={float(discretization)!r}|rtol={float(rtol)!r}")


def memo_path() -> str:
    """The user cache's memo file (beside the ``pretrained/`` folder)."""
    return os.path.join(cache_root(), "calibrations.json")


def _read(path) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            table = json.load(fh)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _shipped() -> dict:
    res = importlib.resources.files("opacus_structured") / "data" / "calibrations.json"
    return _read(res) if res.is_file() else {}


def _store(key: str, sigma: float) -> None:
    path = memo_path()
    table = _read(path)
    table[key] = sigma
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(table, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only cache costs the next run a search, nothing else
        pass


def calibrate(epsilon_of_sigma: Callable[[float], float], target_epsilon: float, *, key: str,
              rtol: float) -> tuple[float, str]:
    """``(σ, source)``: σ as :func:`calibrate_noise_multiplier` returns it, and where it came
    from: ``"cache"``, ``"shipped"`` (a remembered σ, checked) or ``"search"``."""
    for source, table in (("cache", _read(memo_path())), ("shipped", _shipped())):
        hint: Optional[float] = table.get(key)
        if isinstance(hint, (int, float)) and hint > 0:
            sigma = hinted_noise_multiplier(epsilon_of_sigma, target_epsilon, float(hint),
                                            rtol=rtol)
            if sigma is not None:
                return sigma, source
    sigma = calibrate_noise_multiplier(epsilon_of_sigma, target_epsilon, rtol=rtol,
                                       initial="scaled")
    _store(key, sigma)
    return sigma, "search"
