"""The ``forecast`` command's rows beside the released model: the baselines (non-private run,
zero-shot, seasonal naive, the NOT PRIVATE ETS reference), the private-inputs row, and the
``--tune`` summary under the table (split from :mod:`opacus_structured.commands.forecast`; the
leading underscore keeps this module out of the command discovery)."""

from __future__ import annotations

import math
import sys
import time

__all__ = ["baselines", "ets_reference_row", "private_inputs_row", "tuning_lines"]


def private_inputs_row(args, result, test, truth, rows, seed, log) -> dict:
    """Forecast the test series from privatized inputs with the trained model; add its row
    and return the inference-privacy record (separate from the training ε)."""
    from gluonts.evaluation import make_evaluation_predictions  # optional: gluonts

    from ..forecasting.metrics import evaluate_forecasts  # optional: gluonts
    from ..forecasting.private_inference import privatize_panel  # optional: gluonts

    t0 = time.perf_counter()
    released, reports = privatize_panel(
        test, args.prediction_length, subsampling_rate=args.inference_rate,
        sensitivity=args.inference_sensitivity, delta=args.delta,
        epsilon=args.inference_epsilon, seed=seed)
    f_it, _ = make_evaluation_predictions(dataset=released.to_gluonts(),
                                          predictor=result.create_predictor(),
                                          num_samples=args.num_samples)
    metrics = evaluate_forecasts(list(f_it), truth)  # scored against the true values
    first = reports[0]
    record = {key: value for key, value in first.as_dict().items()
              if key not in ("kept_steps", "series_length")}
    record.update(series=len(reports), kept_fraction=sum(r.kept_steps for r in reports)
                  / sum(r.series_length for r in reports), crps=metrics["crps"],
                  mase=metrics["mase"])
    if seed is not None:
        record["seed"] = seed
    rows.append({"method": f"{rows[0]['method']}, private inputs (ε_in={first.epsilon:.3g})",
                 **metrics, "epsilon": first.epsilon,
                 "noise_multiplier": first.noise_multiplier,
                 "seconds": time.perf_counter() - t0})
    log(f"inference privacy: every test series' input released with epsilon="
        f"{first.epsilon:.4g} at delta={first.delta:g} ({first.relation}; separate from the "
        f"training epsilon)")
    return record


def baselines(job, table) -> dict:
    """The non-private run, the zero-shot model, seasonal naive and ETS (unless skipped)."""
    from ..forecasting.baselines import seasonal_naive_predictor  # optional: gluonts
    from ..forecasting.training import train_forecaster  # optional: gluonts

    args, train, baselines = job.args, job.checked.train, {}
    if args.no_baselines:
        return baselines
    if job.dp_sgd or job.budgets is not None:
        np_result = train_forecaster(args.model, train, epsilon=None, delta=None, **job.common)
        row = table.evaluate(f"{args.model} (non-private)", np_result.create_predictor(), {
            "epsilon": math.inf, "steps": np_result.steps, "seconds": np_result.train_seconds})
        baselines["non_private"] = {k: row[k] for k in ("crps", "mase", "steps", "seconds")}
        baselines["non_private"]["step_seconds"] = np_result.step_seconds
    if job.init_state is not None:  # reads no private data: costs no privacy
        from ..forecasting.pretraining import zero_shot_predictor  # optional: gluonts

        row = table.evaluate("pretrained (public, zero-shot)", zero_shot_predictor(
            args.model, job.init_state, freq=train.freq,
            prediction_length=args.prediction_length,
            context_length=args.context_length), {"epsilon": 0.0, "steps": 0})
        baselines["zero_shot"] = {k: row[k] for k in ("crps", "mase")}
    t0 = time.perf_counter()
    row = table.evaluate("seasonal naive", seasonal_naive_predictor(
        args.prediction_length, train.freq, season_length=job.season_length), {})
    row["seconds"] = time.perf_counter() - t0
    baselines["seasonal_naive"] = {k: row[k] for k in ("crps", "mase")}
    if not getattr(args, "no_ets", False):
        ets = ets_reference_row(train, table.truth, args.prediction_length, job.season_length,
                                 table.rows, table.forecasts)
        if ets is not None:
            baselines["ets"] = ets
    return baselines


def ets_reference_row(train, truth, prediction_length, season_length, rows, forecasts):
    """The non-private statsmodels ETS reference (:mod:`~opacus_structured.forecasting.ets`):
    appends its row (labelled NOT PRIVATE) and its forecasts (for the plot) and returns its
    baseline entry; without statsmodels, one notice on stderr and ``{"omitted": reason}``."""
    from ..forecasting.ets import (  # optional: gluonts, statsmodels
        ETS_LABEL,
        ets_reference,
        ets_unavailable_reason,
    )

    reason = ets_unavailable_reason()
    if reason is not None:
        print(f"notice: {reason}", file=sys.stderr)
        return {"omitted": reason, "private": False}
    ets = ets_reference(train, truth, prediction_length, season_length)
    forecasts[ETS_LABEL] = ets.pop("forecasts")
    rows.append({"method": ETS_LABEL, "crps": ets["crps"], "mase": ets["mase"],
                 "mse": ets["mse"], "nd": ets["nd"], "private": False,
                 "seconds": ets["seconds"]})
    if ets["fallbacks"]:
        print(f"ETS reference: {len(ets['fallbacks'])} of {len(train)} series used the naive "
              f"fallback ({'; '.join(f'{i}: {s}' for i, s in ets['fallbacks'][:5])}"
              f"{'; ...' if len(ets['fallbacks']) > 5 else ''})", file=sys.stderr)
    return {k: ets[k] for k in ("crps", "mase", "private", "note", "models", "fallbacks",
                                "predictive", "seconds", "workers")}


def tuning_lines(tuning: dict) -> str:
    """The printed summary of ``--tune`` (``report["tuning"]``)."""
    if tuning.get("skipped"):
        return ("tuning: " + tuning["reason"].replace("--tune skipped: ", "search not run: ")
                + " (decided on public quantities only)")
    chosen = tuning["chosen"]
    w = chosen["zero_shot_weight"]
    model = ("the public zero-shot model (W = 1)" if w >= 1 else
             f"lr {chosen['lr']:.3g}, {chosen['max_steps']} steps, W = {w:g}")
    return (f"tuning: {len(tuning['candidates'])} candidates (lr × steps × W), private "
            f"selection ({tuning['law']}, mean {tuning['mean_trials']:g} trials); chosen: "
            f"{model}, private score {tuning['private_score']:.4g}\n"
            f"  epsilon {tuning['epsilon']:.4g} for the whole search; one trial alone "
            f"{tuning['trial_epsilon']:.4g}: the selection's share is "
            f"{100 * tuning['selection_share']:.0f} %; sigma {tuning['noise_multiplier']:.4g}, "
            f"score noise {tuning['score_noise_multiplier']:.4g}\n"
            f"  the number of trials drawn is secret (kept only in the search's own state): "
            f"publishing it voids the selection's guarantee")
