"""The ``forecast`` command's reruns for its verdict (issue 47: "the verdict must not rest on
one noisy run"; the leading underscore keeps this module out of the command discovery).

A DP run's test scores change from run to run: the window sampler and the noise draw fresh
coins (docs/benchmarks.md measures the seeds' spread panel by panel; a rerun of the same
command differed by 19 % in CRPS on ``Irates``). :func:`rerun_scores` trains the released
mechanism again ``--verdict-runs − 1`` times, with the same ε, σ, steps and recipe and fresh
coins, and scores each rerun on the test split like the release
(:mod:`~opacus_structured.commands._forecast_verdict` compares the runs with each baseline).

**Never released.** A rerun is a diagnostic of the operator, as every score on the test split
is: its weights and forecasts are dropped, only its two scores are kept (in
``report["rows"][0]["runs"]`` of the diagnostics). Releasing a rerun's model besides the
release would be a second release on the same data (composition). With ``--seed S`` the
reruns are seeded too (``S + 7919·i``), like the release: reproducible and NOT private.

* a run at a finite ε reruns at the release's σ and step count (``noise_multiplier=σ``: no new
  calibration);
* the non-private path (ε = ∞) reruns without noise (its sampler and initialisation vary);
* a ``--tune`` release reruns the chosen candidate on the search's fit panel at the search's σ
  (the winning trial's mechanism; the search itself is not repeated).
"""

from __future__ import annotations

import dataclasses

from ..samplers._generator import fresh_seed

__all__ = ["rerun_scores", "scores"]

_SEED_STRIDE = 7919


def scores(row: dict) -> dict:
    """``{"crps", "mase"}`` of a table row."""
    return {"crps": row["crps"], "mase": row["mase"]}


def _seeds(job, i: int) -> dict:
    """The coins of rerun ``i`` (1-based): fresh OS entropy unless the run was seeded."""
    seed = None if job.seed is None else job.seed + _SEED_STRIDE * i
    init_seed = (job.given_init if job.given_init is not None else
                 seed if seed is not None else fresh_seed())
    return {"seed": seed, "init_seed": init_seed}


def _evaluate(job, table, predictor) -> dict:
    from ..forecasting.metrics import evaluate_predictor  # optional: gluonts

    metrics, _, _ = evaluate_predictor(predictor, table.test_ds,
                                       num_samples=job.args.num_samples,
                                       season_length=job.season_length)
    return scores(metrics)


def rerun_scores(job, budget: float, result, table, *, tuned=None) -> list[dict]:
    """The test scores (``[{"crps", "mase"}, ...]``) of ``--verdict-runs − 1`` reruns of the
    mechanism that produced ``result`` at ``budget`` (module docstring); ``[]`` for
    ``--verdict-runs 1`` and for ``--no-baselines`` (no verdict to rest on them)."""
    from ..forecasting.training import train_forecaster  # optional: gluonts

    count = int(getattr(job.args, "verdict_runs", 1) or 1) - 1
    if count <= 0 or getattr(job.args, "no_baselines", False):  # no baseline: no verdict
        return []
    args, out = job.args, []
    for i in range(1, count + 1):
        coins = _seeds(job, i)
        if tuned is not None:
            out.append(_evaluate(job, table, _tuned_rerun(job, tuned, coins)))
            continue
        keywords = {**job.common, **coins, "progress": False, "log": None}
        if result.dp_sgd:
            keywords.update(epsilon=None, delta=args.delta,
                            noise_multiplier=result.noise_multiplier, max_steps=result.steps,
                            epochs=None)
        else:
            keywords.update(epsilon=None, delta=None, noise_multiplier=None)
        rerun = train_forecaster(args.model, job.checked.train, **keywords)
        if rerun.dp_sgd != result.dp_sgd or (
                result.dp_sgd and rerun.noise_multiplier != result.noise_multiplier):
            raise RuntimeError("a verdict rerun ran another mechanism than the release")
        out.append(_evaluate(job, table, rerun.create_predictor()))
    job.log(f"verdict: {count} rerun{'s' if count > 1 else ''} of the released mechanism"
            + (f" at ε = {budget:g}" if job.budgets else "")
            + " (fresh coins, never released) scored on the test split")
    return out


def _tuned_rerun(job, tuned, coins):
    """The chosen candidate of a ``--tune`` search trained again on the search's fit panel at
    its σ; returns the predictor of its released mixture."""
    from ..forecasting.data import train_test_split  # optional: gluonts
    from ..forecasting.training import train_forecaster  # optional: gluonts

    args, cand = job.args, tuned.candidate
    h = args.prediction_length
    fit, _ = train_test_split(job.checked.train, h)
    if cand.zero_shot_weight >= 1.0:  # the public model itself: only its sampling varies
        return tuned.create_predictor()
    rerun = train_forecaster(
        args.model, fit, **{**job.common, **coins, "epsilon": None, "delta": args.delta,
                            "noise_multiplier": tuned.plan.sigma, "lr": cand.lr,
                            "max_steps": cand.max_steps, "epochs": None,
                            "prediction_length": h, "zero_shot_weight": cand.zero_shot_weight,
                            "discretization": args.discretization, "progress": False,
                            "log": None})
    return dataclasses.replace(tuned, result=rerun).create_predictor()
