r"""A per-series combination of the local forecasts, weighted by each method's backtest error.

No single local method wins on every series: exchange rates are random walks (naive wins), a
monthly housing series wants a seasonal damped trend (ETS), a short noisy one Theta. FFORMA
(Montero-Manso et al. 2020) learns per-series weights from features; the classical and much
cheaper rule weights each method by its own recent accuracy on the same series (Bates &
Granger 1969; inverse squared error weights, Stock & Watson 2004). :func:`backtest_combination`
computes, for each input row ``y_1..y_T`` (a training window's context, or a series' history at
prediction time), with horizon ``H``:

1. the candidates' forecasts ``f_k`` fitted on the whole row (as :func:`~.local_forecasts.
   local_forecasts_with_history` fits them: the ``history_methods`` on all of it, the others on
   the last ``window`` steps);
2. the same candidates fitted on the row **without its last H steps** (``window`` shortened to
   at most ``T − H``), and their mean absolute error ``e_k`` on those ``H`` held-out steps;
3. the combination ``Σ_k v_k f_k`` with ``v_k ∝ max(e_k, ε)^{-p}`` (``p`` = :data:`POWER` = 2,
   ``ε`` = :data:`MIN_ERROR`), the weights summing to one.

A row whose held-out steps are not all observed, or with fewer than ``H`` observed steps
before them, cannot be backtested; it gets :data:`FALLBACK_WEIGHTS` (½ ETS + ½ Theta, the
recipe's public prior, over the candidates it names; uniform when it names none of them).

**Privacy.** Every step is a deterministic function of that row's own values and observed mask
(no parameter, no other row, no batch statistic), like the local fits themselves: a window's
combination does not change when the rest of the batch does (``tests/
test_backtest_combination.py``). It is part of the model's input transform; per-window
clipping and the structured accountant's analysis are unchanged.

**Cost.** Two fits of every candidate per row instead of one.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .local_forecasts import METHODS, check_methods, check_pair, local_forecasts_with_history

__all__ = ["COMBINATION", "POWER", "MIN_ERROR", "FALLBACK_WEIGHTS", "backtest_weights",
           "backtest_combination"]

#: The name of the combination among the skip's features.
COMBINATION = "combination"
#: The exponent ``p`` of the inverse-error weights.
POWER = 2.0
#: Backtest errors are floored here (in the scaler's units) before the inverse.
MIN_ERROR = 1e-6
#: Weights of a row that cannot be backtested (restricted to the candidates, renormalised).
FALLBACK_WEIGHTS = {"ets": 0.5, "theta": 0.5}


def _fallback(candidates, dtype, device) -> torch.Tensor:
    w = torch.tensor([FALLBACK_WEIGHTS.get(k, 0.0) for k in candidates], dtype=dtype,
                     device=device)
    return w / w.sum() if float(w.sum()) > 0 else torch.full_like(w, 1.0 / len(candidates))


def backtest_weights(y: torch.Tensor, observed: torch.Tensor, window: int, m: int, horizon: int,
                     candidates: Sequence[str] = METHODS, history_methods: Sequence[str] = (),
                     *, power: float = POWER) -> torch.Tensor:
    """``(B, K)`` weights ``v`` of the ``candidates`` for each row of ``y`` ``(B, T)``: inverse
    ``power`` of each candidate's mean absolute error on the row's last ``horizon`` steps when
    fitted on the steps before them (module docstring); :data:`FALLBACK_WEIGHTS` for a row that
    cannot be backtested."""
    candidates = check_methods(candidates)
    check_pair(y, observed)
    if not float(power) > 0:
        raise ValueError(f"power must be > 0, got {power!r}")
    B, T = y.shape
    H = int(horizon)
    fallback = _fallback(candidates, y.dtype, y.device).expand(B, -1)
    if T - H < 1:
        return fallback.clone()
    with torch.no_grad():
        held = (observed[:, T - H:] > 0).to(y.dtype)
        before = (observed[:, :T - H] > 0).to(y.dtype)
        ok = (held.sum(1) == H) & (before.sum(1) >= H)
        fits = local_forecasts_with_history(
            y[:, :T - H], observed[:, :T - H], min(int(window), T - H), m, H, candidates,
            tuple(k for k in history_methods if k in candidates))
        error = ((fits - y[:, T - H:, None]).abs() * held[:, :, None]).sum(1) / H  # (B, K)
        inverse = error.clamp(min=MIN_ERROR).pow(-float(power))
        weights = inverse / inverse.sum(1, keepdim=True)
        return torch.where(ok[:, None], weights, fallback)


def backtest_combination(y: torch.Tensor, observed: torch.Tensor, window: int, m: int,
                         horizon: int, candidates: Sequence[str] = METHODS,
                         history_methods: Sequence[str] = (), *, forecasts=None,
                         power: float = POWER) -> torch.Tensor:
    """``(B, H)``: each row's combination ``Σ_k v_k f_k`` of the ``candidates``' forecasts
    (:func:`backtest_weights`; module docstring). ``forecasts``: the candidates' ``(B, H, K)``
    forecasts on the whole rows when already computed (same ``window`` and
    ``history_methods``), else they are fitted here."""
    candidates = check_methods(candidates)
    with torch.no_grad():
        if forecasts is None:
            forecasts = local_forecasts_with_history(
                y, observed, window, m, horizon, candidates,
                tuple(k for k in history_methods if k in candidates))
        if forecasts.shape != (y.shape[0], int(horizon), len(candidates)):
            raise ValueError(f"forecasts must be (batch, horizon, candidates) = "
                             f"{(y.shape[0], int(horizon), len(candidates))}, got "
                             f"{tuple(forecasts.shape)}")
        v = backtest_weights(y, observed, window, m, horizon, candidates, history_methods,
                             power=power)
        return (forecasts * v[:, None, :]).sum(-1)
