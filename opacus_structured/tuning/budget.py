r"""Charging a whole private selection to a dataset budget (``PrivateSelection(budget=...)``).

A private selection is **one** mechanism: :math:`K` secret trials, only the best released
(Papernot & Steinke 2022). It is charged once, as that mechanism — the RDP curve of
repeat-and-select (:func:`~opacus_structured.accounting.private_selection.
repeat_and_select_rdp`, Theorem 2 / 6) of one trial's curve on the budget's orders — never
trial by trial: per-trial records would count :math:`K` into the budget file, and :math:`K`
must stay secret. The trials must therefore not charge the budget themselves (no
``budget=`` in the trials' ``make_private`` / ``train_forecaster``).

The trial's curve: a dp_accounting ``DpEvent`` through ``RdpAccountant``; a
:class:`~opacus_structured.tuning.pricing.PureDpTrial` as :math:`\min(\varepsilon,
\lambda\varepsilon^2/2)`; one of our accountants (or a
:class:`~opacus_structured.tuning.pricing.TrialCost`, its score's Gaussian releases added at
:math:`\lambda/(2\sigma^2)` each) by
:func:`~opacus_structured.accountants.budget_curves.accountant_rdp`, whose tail mass (a
PLD-priced scheme) is charged :math:`\mathbb E[K]` times.
"""

from __future__ import annotations

import numpy as np
from dp_accounting import dp_event

from ..accountants.budget_curves import accountant_rdp
from ..accounting import private_selection as ps
from ..accounting import renyi_filter as rf
from .pricing import PureDpTrial, _unpack

__all__ = ["selection_rdp"]


def _trial_rdp(trial, orders) -> tuple[np.ndarray, float]:
    """``(curve, tail_mass)`` of one trial on ``orders``."""
    if isinstance(trial, dp_event.DpEvent):
        return rf.event_rdp(trial, orders), 0.0
    if isinstance(trial, PureDpTrial):
        return ps.pure_dp_rdp(trial.epsilon, orders), 0.0
    run, extras = _unpack(trial)
    if not getattr(run, "history", None):
        raise ValueError("the trial's accountant has recorded no step: pass the accountant of a "
                         "finished training run (or expected_trial=) to charge the search")
    curve, tail = accountant_rdp(run, orders)
    for sigma in extras:
        curve = curve + rf.gaussian_rdp(sigma, orders)
    return curve, tail


def selection_rdp(trial, orders, *, mean_trials: float, eta) -> tuple[np.ndarray, float]:
    """``(curve, tail_mass)`` of the whole selection over ``trial`` on ``orders``: the
    repeat-and-select curve, and :math:`\\mathbb E[K]` (the law drawn) times the trial's tail
    mass."""
    orders = np.asarray(orders, dtype=np.float64)
    curve, tail = _trial_rdp(trial, orders)
    selected = ps.repeat_and_select_rdp(orders, curve, mean_trials=mean_trials, eta=eta)
    return rf._upper_curve(selected), ps.drawn_mean_trials(mean_trials, eta) * tail
