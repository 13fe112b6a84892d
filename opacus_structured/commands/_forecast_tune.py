"""``forecast --tune``: its gate, its search and its record in ``report.json["tuning"]``
(issue 40; the search itself is :mod:`opacus_structured.forecasting.private_tuning`).

The gate (:class:`~opacus_structured.forecasting.private_tuning.TuneGate`) is decided on public
quantities only (ε, δ, the law of the number of trials, the public number of series) before any
private data is read: where the private score cannot resolve the candidates, the command trains
the recipe once at the whole ``--epsilon`` and says why; ``--tune-always`` searches anyway.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

__all__ = ["check_gate", "always_message", "searching", "run_search", "tuning_record"]


def searching(args, gate) -> bool:
    """Whether the release comes from a private search: ``--tune`` and its gate passed, or
    ``--tune-always``."""
    return gate is not None and (gate.tune or bool(getattr(args, "tune_always", False)))


def check_gate(args, num_series: int):
    """``--tune``'s gate for this run, announced on stderr (``--json``: only when
    ``--tune-always`` overrides it)."""
    from ..forecasting.private_tuning import tuning_gate  # optional: gluonts

    gate = tuning_gate(epsilon=args.epsilon, delta=args.delta, num_series=num_series,
                       mean_trials=args.tune_trials, eta=args.tune_eta)
    if not gate.tune and getattr(args, "tune_always", False):
        print(always_message(gate), file=sys.stderr)
    elif not args.json:
        print(gate.message(), file=sys.stderr)
    return gate


def always_message(gate) -> str:
    """What ``--tune-always`` says where the gate would skip the search: that the search runs
    and why it may not pay (never the gate's "trained once at the whole epsilon instead",
    which describes the run that does not happen)."""
    return (f"--tune-always: running the private search although, with {gate.num_series} "
            f"series at epsilon={gate.epsilon:g}, the private score's noise has sd "
            f"{gate.score_noise_sd:.3g} on the mean clipped loss (> {gate.max_score_noise:g}, "
            f"the most at which a search paid on the public study panels) and every trial runs "
            f"at a larger sigma than one run would need")


def run_search(job):
    """The private selection of :func:`~opacus_structured.forecasting.private_tuning.
    tune_forecaster` over the recipe's neighbourhood, within ``--epsilon``."""
    from ..forecasting.private_tuning import tune_forecaster  # optional: gluonts

    args = job.args
    job.log(f"--tune: private selection of the learning rate, the steps and the zero-shot "
            f"weight within epsilon={args.epsilon:g} at delta={args.delta:g}")
    return tune_forecaster(args.model, job.checked.train, epsilon=args.epsilon,
                           delta=args.delta, season_length=job.season_length,
                           mean_trials=args.tune_trials, eta=args.tune_eta,
                           num_samples=args.num_samples, log=job.log,
                           search_progress=False if args.no_progress else None,
                           budget=job.dataset_budget, **job.common)


def tuning_record(gate, tuned: Optional[Any]) -> dict:
    """``report.json["tuning"]``: the search's record with its gate, or, where the gate
    skipped it, ``"skipped": true``, the reason and what would let it run."""
    if tuned is None:
        return {"skipped": True, "reason": gate.message(), **gate.describe()}
    return {**tuned.describe(), "gate": gate.describe()}
