"""Empirical privacy auditing (issue 19): ε **lower bounds** from canary attacks on real runs.

* :mod:`.estimators` — Clopper–Pearson, GDP-based and one-run ε lower bounds from attack
  scores, the attack's ROC (numpy / scipy only).
* :mod:`.report` — the audit's ROC against the accountant's predicted trade-off curve.
* :mod:`.canaries`, :mod:`.pipelines` — canaries planted into the training pipelines of every
  scheme (torch; imported only when used).
* :mod:`.selection` — the audit of a tuned procedure (issue 40): a canary attack on private
  selection over synthetic 1-d trials, simulated in numpy, against the search's reported ε.

An audit can expose a pipeline that leaks more than its accountant reports; it never certifies
privacy. Attributes load on first access, so ``import opacus_structured.audit`` imports no torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "AuditScores": "estimators", "EpsilonLowerBound": "estimators",
    "epsilon_lower_bound": "estimators", "one_run_epsilon_lower_bound": "estimators",
    "roc_curve": "estimators", "clopper_pearson_upper": "estimators",
    "predicted_tradeoff": "report", "plot_audit": "report",
    "run_audit": "pipelines",
    "audit_selection": "selection", "GaussianTrial": "selection", "LaplaceTrial": "selection",
    "TrialCount": "selection",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
