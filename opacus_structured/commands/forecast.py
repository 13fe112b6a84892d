"""``opacus-structured forecast``: DP fine-tuning of a gluonts forecaster on a private panel.

Starts from public pretrained weights (``--init-from public``, the default: shipped with the
package, cached, or pretrained now on the synthetic public corpus — no private data), fine-tunes
a gluonts model (DLinear by default) with structured-subsampling DP-SGD to a target ``(ε, δ)``
on the bundled US employment panel or your own ``--data``, releases the tail average of the
iterates (post-processing), evaluates on the held-out last ``--prediction-length`` steps, and
prints a table with the same model and recipe trained without DP (ε = ∞), the pretrained model
as it is (zero-shot) and seasonal naive. Writes ``report.json`` and ``forecasts.png`` to
``--output``; ``--epsilons 0.5,1,2,4,inf`` trains once per budget and adds ``sweep.png``.

The window sampler and the DP noise draw fresh OS entropy that is written nowhere. ``--seed``
makes them reproducible — and the run **not private** (anyone with the seed regenerates and
subtracts the noise): it prints ``NOT PRIVATE: reproducible noise (--seed given); for
evaluation only``, and the report says ``"private": false`` with the reason. ``--init-seed``
seeds only the public randomness (weight initialisation, dropout, forecast sampling); the run
stays private.

Example::

    opacus-structured forecast --model dlinear --epsilon 1 --delta 1e-7
    opacus-structured forecast --epsilons 0.5,1,2,4,inf --output sweep-report
    opacus-structured forecast --data my_panel.csv --freq W --prediction-length 8
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from ..forecasting.warning_filters import known_harmless_warnings_filtered
from ._registry import register_command

__all__ = ["add_arguments", "run", "run_forecast", "NOT_PRIVATE_SEEDED"]

from ._forecast_args import DEFAULTS, RECIPE_FLAGS, add_arguments, parse_epsilons  # noqa: F401
from ._forecast_job import (  # noqa: F401  (_initial_weights, _dataset_budget: re-exported)
    NOT_PRIVATE_SEEDED,
    SEEDED_REASON,
    Job,
    Rows,
)
from ._forecast_job import prepare_job as _prepare_job
from ._forecast_output import (  # noqa: F401  (check_paths, _plot_title: re-exported)
    _fmt,
    _plot,
    _plot_privacy,
    _plot_sweep,
    _plot_title,
    _sweep_entry,
    _table,
    _writable_target,
    check_paths,
)
from ._forecast_release import (
    DIAGNOSTICS,
    NOT_FOR_PUBLICATION,
    diagnostics_readme,
    finite_json,
    write_release,
)
from ._forecast_reruns import rerun_scores as _rerun_scores
from ._forecast_reruns import scores as _scores
from ._forecast_rows import baselines as _baselines
from ._forecast_rows import ets_reference_row as _ets_reference_row  # noqa: F401 (re-exported)
from ._forecast_rows import private_inputs_row as _private_inputs_row
from ._forecast_rows import tuning_lines as _tuning_lines
from ._forecast_tune import run_search, searching, tuning_record
from ._forecast_verdict import add_verdicts


def _train_at(job: Job, budget):
    from ..forecasting.training import train_forecaster  # optional: gluonts

    args = job.args
    private_run = math.isfinite(budget) or args.noise_multiplier is not None
    try:
        return train_forecaster(args.model, job.checked.train,
                                epsilon=budget if math.isfinite(budget) else None,
                                delta=args.delta if private_run else None,
                                noise_multiplier=args.noise_multiplier, log=job.log,
                                budget=job.dataset_budget, **job.common)
    except ValueError as exc:  # the calibration's answer to an ε it cannot reach: name the flag
        text = str(exc)
        if not any(k in text for k in ("out of reach", "grid points", "in a single step")):
            raise
        flag = ("--noise-multiplier" if args.noise_multiplier is not None else
                "--epsilons" if job.budgets is not None else "--epsilon")
        value = args.noise_multiplier if flag == "--noise-multiplier" else budget
        raise ValueError(f"{flag} {value:g} (with the steps of --max-steps / --epochs): "
                         f"{text}") from None


def _row_label(job: Job, res, budget, tuned=False) -> str:
    args, budgets = job.args, job.budgets
    tag = (f", ε={budget:g}" if budgets is not None and math.isfinite(budget) else
           ", ε=∞" if budgets is not None else "")
    if tuned:
        return (f"{args.model} (DP, tuned{'' if res.private else ', seeded: NOT PRIVATE'})")
    if res.private:
        return f"{args.model} (DP{tag})"
    if res.reproducible_noise:
        return f"{args.model} (DP-SGD{tag}, seeded: NOT PRIVATE)"
    return f"{args.model} (non-private{', DP path at ε=∞' if budgets else ''})"


def _main_release(job: Job, table: Rows) -> dict:
    """Train (or tune) the released model and add its rows; returns what the report needs."""
    args = job.args
    tuned = run_search(job) if searching(job.args, job.tune_gate) else None
    result = tuned.result if tuned is not None else _train_at(job, args.epsilon)
    if result.dp_sgd != job.dp_sgd or result.reproducible_noise != job.seeded_dp:
        raise RuntimeError("the trainer's privacy mode differs from the command's")
    out = {"result": result, "tuned": tuned, "warnings": [], "alone_label": None,
           "sweep": None, "inference": None, "zero_shot_mixture": result.zero_shot_mixture}
    train = job.checked.train
    window = result.prepared.past_length + args.prediction_length
    if window >= train.min_length:
        out["warnings"].append(
            f"the model window (input {result.prepared.past_length} incl. lags + forecast "
            f"{args.prediction_length} = {window} steps) is not shorter than the shortest "
            f"training series ({train.min_length} steps): every step reads every time step of "
            "a sampled series (no amplification from window subsampling) and most windows are "
            "padded; lower --context-length or --prediction-length")
        print("warning: " + out["warnings"][-1], file=sys.stderr)
    elif result.scheme is not None and result.scheme.padding()["note"] is not None:
        # shorter than the series, but still as long as the T window starts: r = 1
        out["warnings"].append(result.scheme.padding()["note"])
        print("warning: " + out["warnings"][-1], file=sys.stderr)
    if tuned is not None:
        out["main_row"] = table.evaluate(_row_label(job, result, args.epsilon, tuned=True),
                                         tuned.create_predictor(), {
            # no time: the search's duration grows with its secret number of trials
            "epsilon": tuned.epsilon, "noise_multiplier": result.noise_multiplier,
            "steps": result.steps, "seconds": None})
        out["main_row"]["runs"] = [_scores(out["main_row"]), *_rerun_scores(
            job, args.epsilon, result, table, tuned=tuned)]
        return out
    out["main_row"] = table.evaluate(_row_label(job, result, args.epsilon),
                                     result.create_predictor(), {
        "epsilon": result.epsilon, "noise_multiplier": result.noise_multiplier,
        "steps": result.steps, "seconds": result.train_seconds})
    out["main_row"]["runs"] = [_scores(out["main_row"]),
                               *_rerun_scores(job, args.epsilon, result, table)]
    if result.zero_shot_weight > 0:  # the fine-tuned network alone, for comparison
        out["alone_label"] = _row_label(job, result, args.epsilon).replace(
            ")", ", weights alone)", 1)
        alone = table.evaluate(out["alone_label"], result.create_predictor(zero_shot_weight=0.0),
                               {"epsilon": result.epsilon, "zero_shot_weight": 0.0})
        out["zero_shot_mixture"]["model_alone"] = {k: alone[k] for k in ("crps", "mase")}
        job.log(f"forecast: {1 - result.zero_shot_weight:g} × the fine-tuned model + "
                f"{result.zero_shot_weight:g} × the public zero-shot model (post-processing, no "
                "privacy cost; --zero-shot-weight 0 for the fine-tuned model alone)")
    if getattr(args, "inference_epsilon", None) is not None:
        out["inference"] = _private_inputs_row(args, result, job.checked.test, table.truth,
                                               table.rows, job.seed, job.log)
    if job.budgets is not None:
        out["sweep"] = _sweep(job, table, result, out["main_row"])
    return out


def _sweep(job: Job, table: Rows, result, main_row) -> list:
    """``--epsilons``: one more training per budget after the first."""
    sweep = [_sweep_entry(job.args.epsilon, result, main_row)]
    bar = None
    if job.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(job.budgets), desc="ε sweep", position=0, leave=True, initial=1)
    for budget in job.budgets[1:]:
        res = _train_at(job, budget)
        row = table.evaluate(_row_label(job, res, budget), res.create_predictor(), {
            "epsilon": res.epsilon, "noise_multiplier": res.noise_multiplier,
            "steps": res.steps, "seconds": res.train_seconds})
        row["runs"] = [_scores(row), *_rerun_scores(job, budget, res, table)]
        sweep.append(_sweep_entry(budget, res, row))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return sweep


def _report(job: Job, release: dict, baselines: dict, table: Rows) -> dict:
    """``report.json`` (without the table, the plot paths and the verdicts)."""
    from ..forecasting.baseline_skip import describe_skip  # optional: gluonts

    args, result, tuned = job.args, release["result"], release["tuned"]
    main_row = release["main_row"]
    report = {
        "model": args.model, "private": result.private, "dp_sgd": result.dp_sgd,
        "reproducible_noise": result.reproducible_noise,
        "not_private_reason": (SEEDED_REASON if job.seeded_dp else result.not_private_reason),
        # a tuned release reports the whole search's epsilon, never the winner's own
        "epsilon": tuned.epsilon if tuned is not None else result.epsilon,
        "delta": args.delta if job.dp_sgd else None,
        "target_epsilon": args.epsilon, "bound": result.bound,
        "noise_multiplier": result.noise_multiplier, "max_grad_norm": result.max_grad_norm,
        "steps": result.steps, "batch_size": args.batch_size,
        "batch_size_source": job.checked.batch_size_source,
        "season_length": job.season_length, "season_length_source": job.season_source,
        "crps": main_row["crps"], "mase": main_row["mase"],
        "train_seconds": result.train_seconds, "step_seconds": result.step_seconds,
        "calibration_seconds": result.calibration_seconds,
        "context_length_with_lags": result.prepared.past_length,
        "prediction_length": args.prediction_length,
        "baseline_skip": describe_skip(result.prepared.module.model),
        "zero_shot_mixture": release["zero_shot_mixture"],
        "scheme": None if result.scheme is None else result.scheme.describe(),
        "sampling_constants": result.sampling_constants,
        "dataset": job.checked.dataset_record(),
        "init_from": job.init_from, "pretrained": job.init_meta, "lr": job.lr,
        "tail_average": job.tail_average,
        "recipe": {"source": job.recipe["source"], "model": args.model,
                   "from_model_defaults": sorted(k for k, v in job.recipe_given.items()
                                                 if not v),
                   "given": sorted(k for k, v in job.recipe_given.items() if v)},
        "baselines": baselines, "device": args.device,
        "grad_sample_mode": getattr(args, "grad_sample_mode", "hooks"),
        # a search's duration grows with its secret number of trials: no total then
        "total_seconds": (None if tuned is not None else time.perf_counter() - job.t_start),
        "rows": table.rows,
    }
    if job.tune_gate is not None:
        report["tuning"] = tuning_record(job.tune_gate, tuned)
    if job.dataset_budget is not None:  # the panel's total, read back from its file
        b = job.dataset_budget
        report["dataset_budget"] = {"path": b.path, "epsilon": b.epsilon, "delta": b.delta,
                                    "spent": b.spent(), "route": b.route}
    if tuned is not None:
        report["bound"] = "upper"  # Papernot & Steinke's RDP bound of the search
        report["lr"] = tuned.candidate.lr
        report["zero_shot_mixture"] = {**release["zero_shot_mixture"],
                                       "weight": tuned.candidate.zero_shot_weight}
    # Seeds only when the user chose them: the privacy coins of a default run are OS entropy
    # that is written nowhere, and its (public) init seed is left out too.
    if job.seed is not None:
        report["seed"] = job.seed
    if job.seeded_dp:
        report["notice"] = NOT_PRIVATE_SEEDED
    if release["warnings"]:
        report["warnings"] = release["warnings"]
    if release["sweep"] is not None:
        report["sweep"] = release["sweep"]
    return report


def run_forecast(args, *, print_fn=print) -> dict:
    """Run the forecast job described by ``args`` and return the report dictionary.

    The flags and the data are checked first (:func:`~._forecast_check.check_forecast`; the
    console has already done so before importing this module, and left the result on
    ``args``)."""
    job = _prepare_job(args)
    table = Rows(args, job.checked.test.to_gluonts(), job.season_length)
    release = _main_release(job, table)
    result = release["result"]
    baselines = _baselines(job, table)
    report = _report(job, release, baselines, table)
    # the verdict lines; series without a MASE scale named (report["mase_excluded"]), warned
    verdict_lines = add_verdicts(report, args, table.rows, job.checked.test, table.truth,
                                 release["warnings"])
    if release["inference"] is not None:
        report["inference_privacy"] = release["inference"]
    if job.seed is not None or job.given_init is not None:
        report["init_seed"] = job.init_seed
    if result.init_provenance is not None and release["tuned"] is None:
        report.update(run_epsilon=result.run_epsilon, init=result.init_provenance.source,
                      prior_runs=result.prior_runs,
                      epsilon_composes_prior_runs=bool(result.init_provenance.composed))
    if release["tuned"] is None:  # a search's record is its report["tuning"]
        report["privacy_record"] = result.privacy_record
    save_path = getattr(args, "save_weights", None)
    if save_path:
        result.save_weights(save_path)
        report["weights"] = save_path
    if args.output:
        _write_outputs(job, report, release, table)
    report["table"] = _table(table.rows) + "\n\n" + verdict_lines
    if "tuning" in report:
        report["table"] += "\n\n" + _tuning_lines(report["tuning"])
    return report


def _write_outputs(job: Job, report: dict, release: dict, table: Rows) -> None:
    """``--output DIR``: the publishable ``DIR/release/`` and the operator's
    ``DIR/diagnostics/`` (``report.json``, the plots, a README): :mod:`._forecast_release`."""
    args, test, sweep = job.args, job.checked.test, release["sweep"]
    os.makedirs(args.output, exist_ok=True)
    report["release"] = write_release(job, report, release, args.output)
    diagnostics = os.path.join(args.output, DIAGNOSTICS)
    os.makedirs(diagnostics, exist_ok=True)
    report["publication"] = NOT_FOR_PUBLICATION
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            job.log("matplotlib not installed: no plot written")
        else:
            picks = sorted(set([0, len(test) // 3, (2 * len(test)) // 3, len(test) - 1]))
            # the released forecast (not its unmixed half, nor the sweep's other budgets)
            hidden = {release["alone_label"], *(e["method"] for e in (sweep or [])[1:])}
            shown = {k: v for k, v in table.forecasts.items() if k not in hidden}
            report["plot"] = os.path.join(diagnostics, "forecasts.png")
            _plot(report["plot"], test, shown, picks, args.prediction_length,
                  banner=NOT_PRIVATE_SEEDED if job.seeded_dp else None,
                  privacy=_plot_privacy(report))
            if sweep is not None:
                report["sweep_plot"] = os.path.join(diagnostics, "sweep.png")
                _plot_sweep(report["sweep_plot"], sweep, report["baselines"], args.model,
                            banner=NOT_PRIVATE_SEEDED if job.seeded_any else None)
    with open(os.path.join(diagnostics, "report.json"), "w") as fh:
        json.dump(_finite(report), fh, indent=2, sort_keys=True)
    with open(os.path.join(diagnostics, "README.md"), "w", encoding="utf-8") as fh:
        fh.write(diagnostics_readme(report))


_finite = finite_json  # the report's strict JSON (inf / nan as strings)


def run(args) -> int:
    with known_harmless_warnings_filtered():  # named, known-harmless messages only
        report = run_forecast(args)
    if args.json:
        out = {k: v for k, v in report.items() if k != "table"}
        print(json.dumps(_finite(out), sort_keys=True))
    else:
        print(report["table"])
        ets = report.get("baselines", {}).get("ets")
        if ets is not None and "omitted" not in ets:
            print(f"\n{ets['note']}.")
        eps = report["epsilon"]
        if report["dp_sgd"]:
            if report["reproducible_noise"]:
                print(f"\n{NOT_PRIVATE_SEEDED}")
            how = ("private selection of structured-subsampling trials, Papernot & Steinke "
                   "ICLR 2022 over Thm 4.4 of Schuchardt et al. ICML 2025; the whole search"
                   if not report.get("tuning", {"skipped": True}).get("skipped") else
                   "structured subsampling, Thm 4.4 of Schuchardt et al. ICML 2025")
            print(f"\n{'privacy' if report['private'] else 'mechanism (NOT this model)'}: "
                  f"epsilon = {eps:.4g} at delta = {report['delta']:g} "
                  f"({report['bound']} bound, {how}), sigma = "
                  f"{report['noise_multiplier']:.4g}, {report['steps']} steps")
            if report.get("epsilon_composes_prior_runs"):
                n = sum(1 for r in report["prior_runs"] if r["composed"])
                print(f"  composed with {n} earlier run(s) on this data that the initial "
                      f"weights went through; this run alone: epsilon = "
                      f"{report['run_epsilon']:.4g}")
        if "inference_privacy" in report:
            inf = report["inference_privacy"]
            print(f"inference privacy ({'private' if inf['private'] else 'NOT private: seeded'}"
                  f"; separate from training): epsilon = {inf['epsilon']:.4g} at delta = "
                  f"{inf['delta']:g} per test series' input ({inf['relation']}), noise "
                  f"{inf['noise_multiplier']:.4g}·V, keep rate {inf['subsampling_rate']:g}")
        if args.output:
            rel = report["release"]
            print(f"release (publishable: the weights and their model card): "
                  f"{rel['folder']}" if rel["written"] else
                  f"no release written: {rel['reason']}")
            print(f"diagnostics (NOT for publication: scores on the private test split): "
                  f"{os.path.join(args.output, DIAGNOSTICS, 'report.json')}"
                  + (f", plot: {report['plot']}" if "plot" in report else ""))
    return 0


register_command("forecast", "DP fine-tuning of a gluonts forecaster on the bundled panel or "
                 "your own --data (ε sweep, baselines, report)",
                 add_arguments, run)
