"""Private hyperparameter selection (Papernot & Steinke, ICLR 2022; Liu & Talwar, STOC 2019).

Tune on private data without a silent ε: a secret, random number of trials, each a full DP
run plus a private score, releasing only the best, priced as one procedure.

* :func:`selection_epsilon` — the stable entry point: ε of the whole search from one trial (a
  dp_accounting ``DpEvent``, one of our accountants, or a :class:`TrialCost`);
* :func:`calibrate_selection` — the per-trial σ for a total (ε, δ) of the search;
* :class:`PrivateSelection` — the search over a list, a grid or a sampler of configurations,
  with checkpointing and progress; :func:`private_score` — a Gaussian-mechanism validation
  score whose cost joins the trial's.

The math (no torch) is :mod:`opacus_structured.accounting.private_selection`.
"""

from ..accounting.private_selection import liu_talwar_epsilon, pure_selection_epsilon
from .pricing import (
    ROUTES,
    PureDpTrial,
    SelectionCalibrationError,
    TrialCost,
    calibrate_selection,
    selection_epsilon,
    trial_signature,
)
from .score import private_score
from .search import PrivateSelection, SelectionResult, candidate_list, draw_num_trials

__all__ = [
    "selection_epsilon",
    "ROUTES",
    "calibrate_selection",
    "SelectionCalibrationError",
    "TrialCost",
    "PureDpTrial",
    "trial_signature",
    "private_score",
    "PrivateSelection",
    "SelectionResult",
    "draw_num_trials",
    "candidate_list",
    "pure_selection_epsilon",
    "liu_talwar_epsilon",
]
