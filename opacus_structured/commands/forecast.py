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

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Optional

from .. import _progress
from ..dataset_budget import DatasetBudget
from ..forecasting.model_defaults import model_defaults
from ..forecasting.seasonality import season_length as default_season_length
from ..forecasting.warning_filters import known_harmless_warnings_filtered
from ..samplers._generator import fresh_seed
from ._registry import register_command

__all__ = ["add_arguments", "run", "run_forecast", "NOT_PRIVATE_SEEDED"]

from ._forecast_args import DEFAULTS, RECIPE_FLAGS, add_arguments, parse_epsilons  # noqa: F401
from ._forecast_check import CHECKED_ATTRIBUTE, check_forecast
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
from ._forecast_tune import check_gate, run_search, searching, tuning_record
from ._forecast_verdict import add_verdicts

#: Printed (and put on the plot) for a DP run whose noise was seeded with ``--seed``.
NOT_PRIVATE_SEEDED = "NOT PRIVATE: reproducible noise (--seed given); for evaluation only"
#: ``report["not_private_reason"]`` of such a run.
SEEDED_REASON = ("reproducible noise: seeded with --seed (whoever knows the seed regenerates the "
                 "sampler draws and the noise and can subtract it)")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _initial_weights(init_from, args, freq, progress, log, season_length=None,
                     series_length=None):
    """``(state_dict or None, meta or None)`` for ``--init-from`` (public weights only).

    ``public``: the shipped weights of the panel's frequency family (a longer-horizon DLinear
    brings its context: the run's ``--context-length`` when none is given). Pretraining (a
    geometry nothing ships) is announced on stderr before it starts and followed there even
    under ``--json``: a bar on a terminal, else a line at most every ~10 s."""
    from ..forecasting.estimators import default_context_length  # optional: gluonts
    from ..forecasting.pretraining import load_weights, pretrained_weights  # optional: gluonts

    if init_from == "none":
        return None, None
    if init_from == "public":
        try:
            state, meta = pretrained_weights(args.model, freq=freq,
                                             prediction_length=args.prediction_length,
                                             context_length=args.context_length,
                                             progress=progress, log=_stderr,
                                             season_length=season_length,
                                             series_length=series_length)
        except ValueError as exc:
            raise ValueError(f"public pretraining (--init-from public) failed: {exc}; "
                             "--init-from none starts from a random initialisation "
                             "instead") from exc
        if args.context_length is None and meta.get("context_length") != \
                default_context_length(args.model, args.prediction_length):
            args.context_length = int(meta["context_length"])  # a DLinear base model's own
            log(f"context length {args.context_length}: the context of the shipped public "
                f"DLinear weights of the nearest longer horizon, whose first "
                f"{args.prediction_length} output steps this run fine-tunes (--context-length "
                f"sets another; weights nothing ships for are pretrained once, announced)")
    else:
        state, meta = load_weights(init_from)
        meta = {**meta, "source": "file", "path": init_from}
        if "privacy_record" not in meta and not getattr(args, "init_public", False):
            from ..forecasting.provenance import is_known_public  # optional: gluonts

            if not is_known_public(state):  # before any private data is read
                raise ValueError(
                    f"--init-from {init_from}: the file carries no privacy record (not written "
                    f"by --save-weights or `opacus-structured pretrain`), so the weights may "
                    f"have been trained on this data and a second run would under-report "
                    f"epsilon; pass --init-public if they never saw this data")
    want = {"model": args.model}
    if args.model != "deepar":  # DeepAR's weights fit every horizon and context (an RNN)
        want.update(prediction_length=args.prediction_length,
                    context_length=(default_context_length(args.model, args.prediction_length)
                                    if args.context_length is None else args.context_length))
    for key, value in want.items():
        if key in meta and meta[key] != value:
            raise ValueError(f"--init-from {init_from}: the weights were trained for "
                             f"{key}={meta[key]!r} but this run uses {key}={value!r} (or "
                             "--init-from public / none)")
    runs = (meta.get("privacy_record") or {}).get("runs") or []
    base = (meta.get("base") or {}).get("describe")
    log(f"initial weights: {meta.get('source')} ({meta.get('path')})"
        + (f", {base}" if base else "") + "; "
        + (f"{len(runs)} earlier run(s) on non-public data in their privacy record"
           if runs else "public data only"))
    return state, {k: v for k, v in meta.items() if k != "train_seconds"}


@dataclasses.dataclass
class _Job:
    """What the parts of :func:`run_forecast` share: the checked flags and data, the recipe,
    the initial weights and the keywords of every training run."""

    args: Any
    checked: Any
    t_start: float
    recipe: dict
    recipe_given: dict
    tail_average: float
    init_from: str
    init_state: Any
    init_meta: Any
    lr: float
    common: dict
    season_length: int
    season_source: str
    seed: Optional[int]
    given_init: Optional[int]
    init_seed: int
    dp_sgd: bool
    seeded_dp: bool
    seeded_any: bool
    budgets: Optional[list]
    progress: bool
    log: Any
    tune_gate: Any = None  # --tune: private_tuning.TuneGate (public quantities only)
    dataset_budget: Any = None  # --budget: the panel's DatasetBudget (charges every DP run)


class _Rows:
    """The table's rows, the forecasts to draw and the test truth (filled by :meth:`evaluate`)."""

    def __init__(self, args, test_ds, season_length):
        self.args, self.test_ds, self.season_length = args, test_ds, season_length
        self.rows, self.forecasts, self.truth = [], {}, []

    def evaluate(self, name, predictor, extra):
        from ..forecasting.metrics import evaluate_predictor  # optional: gluonts

        t0 = time.perf_counter()
        metrics, fcs, series = evaluate_predictor(predictor, self.test_ds,
                                                  num_samples=self.args.num_samples,
                                                  season_length=self.season_length)
        self.truth[:] = series
        self.forecasts[name] = fcs
        row = {"method": name, **metrics, **extra, "eval_seconds": time.perf_counter() - t0}
        self.rows.append(row)
        return row


def _prepare_job(args) -> _Job:
    """Check the flags and the data, fill the recipe's defaults and load the public weights."""
    t_start = time.perf_counter()
    checked = getattr(args, CHECKED_ATTRIBUTE, None)
    if checked is None:
        checked = check_forecast(args)
    if getattr(args, "device", "cpu") == "cuda":  # needs torch to know: checked here
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available to torch; use "
                             "--device cpu")
    budgets = checked.budgets
    if budgets is not None:
        args.epsilon = budgets[0]
    recipe = model_defaults(args.model)  # the model's own recipe (model_defaults.py)
    recipe_given = {key: getattr(args, key, None) is not None for key in RECIPE_FLAGS}
    if args.max_steps is None and getattr(args, "epochs", None) is None:
        args.max_steps = recipe["max_steps"]
    else:
        recipe_given["max_steps"] = True
    if getattr(args, "max_grad_norm", None) is None:
        args.max_grad_norm = recipe["max_grad_norm"]
    tail_average = getattr(args, "tail_average", None)
    if tail_average is None:
        tail_average = recipe["tail_average"]
    init_from = getattr(args, "init_from", "none") or "none"
    season_length = getattr(args, "season_length", None)
    seed = getattr(args, "seed", None)
    given_init = getattr(args, "init_seed", None)
    dp_sgd = math.isfinite(args.epsilon) or args.noise_multiplier is not None
    # public init seed shared by the DP model and its non-private baseline (same weights at
    # step 0); written to the report only when the user chose it (--init-seed or --seed)
    init_seed = given_init if given_init is not None else (seed if seed is not None
                                                           else fresh_seed())
    train = checked.train
    args.batch_size = checked.batch_size
    progress = _progress.enabled(args.no_progress)
    log = (lambda m: print(m, file=sys.stderr)) if not args.json else (lambda m: None)
    if args.json and checked.report.excluded:  # the table's log line is silent under --json
        listed = "; ".join(f"{i}: {r}" for i, r in checked.report.excluded)
        print(f"excluded {len(checked.report.excluded)} of {checked.report.num_input_series} "
              f"series ({listed})", file=sys.stderr)
    season_source = "given" if season_length is not None else "default for the frequency"
    if season_length is None:
        season_length = default_season_length(train.freq)
    dataset_size = _public_dataset_size(args, checked.path, train)
    tune_gate = (check_gate(args, dataset_size or len(train)) if getattr(args, "tune", False)
                 else None)
    # public pretrained weights (read before any private data is used; see pretraining.py)
    # the shortest series a run trains on (--tune's trials: without their validation steps)
    shortest = train.min_length - (args.prediction_length if searching(args, tune_gate)
                                   else 0)
    init_state, init_meta = _initial_weights(init_from, args, train.freq, progress, log,
                                             season_length, series_length=shortest)
    init_record = None if init_meta is None else init_meta.pop("privacy_record", None)
    lr = args.lr if args.lr is not None else (
        recipe["lr"] if init_state is not None else recipe["lr_from_scratch"])
    common = dict(prediction_length=args.prediction_length, context_length=args.context_length,
                  batch_size=args.batch_size, max_grad_norm=args.max_grad_norm, lr=lr,
                  init_state=init_state, tail_average=tail_average,
                  init_record=init_record,
                  init_public=bool(getattr(args, "init_public", False)) and init_state is not None,
                  max_steps=args.max_steps, epochs=args.epochs, device=args.device,
                  seed=seed, init_seed=init_seed, progress=progress,
                  lstm_impl=getattr(args, "lstm_impl", "fast"),
                  grad_sample_mode=getattr(args, "grad_sample_mode", "hooks"),
                  num_workers=getattr(args, "num_workers", 0),
                  top_level=getattr(args, "top_level", "wor"),
                  dataset_size=dataset_size,
                  discretization=args.discretization,
                  zero_shot_weight=getattr(args, "zero_shot_weight", None),
                  estimator_kwargs=({"season_length": season_length} if args.model == "dlinear"
                                    else None))
    # a seeded sweep with any finite budget releases NOT-private models: say so up front
    seeded_any = seed is not None and (dp_sgd or any(math.isfinite(b) for b in budgets or ()))
    if seeded_any:  # said up front, on stderr even with --json (stdout then holds the JSON)
        print(NOT_PRIVATE_SEEDED, file=sys.stderr)
    log(f"data: {'US employment (BLS)' if checked.path is None else checked.name}, "
        f"{len(train)} series (freq {train.freq}), shortest training series "
        f"{train.min_length} steps, test = last {args.prediction_length} steps; "
        f"{checked.report.summary()}")
    return _Job(args=args, checked=checked, t_start=t_start, recipe=recipe,
                recipe_given=recipe_given, tail_average=tail_average, init_from=init_from,
                init_state=init_state, init_meta=init_meta, lr=lr, common=common,
                season_length=season_length, season_source=season_source, seed=seed,
                given_init=given_init, init_seed=init_seed, dp_sgd=dp_sgd,
                seeded_dp=dp_sgd and seed is not None, seeded_any=seeded_any,
                budgets=budgets, progress=progress, log=log, tune_gate=tune_gate,
                dataset_budget=_dataset_budget(args))


def _dataset_budget(args) -> Optional[DatasetBudget]:
    """``--budget PATH``: the existing file (its cap, checked against ``--budget-epsilon`` and
    ``--delta`` when given), or a new one with ``--budget-epsilon`` and ``--delta``."""
    path = getattr(args, "budget", None)
    if path is None:
        return None
    cap = getattr(args, "budget_epsilon", None)
    if cap is None:
        return DatasetBudget.open(path)
    return DatasetBudget(path, epsilon=cap, delta=args.delta)


def _train_at(job: _Job, budget):
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


def _row_label(job: _Job, res, budget, tuned=False) -> str:
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


def _main_release(job: _Job, table: _Rows) -> dict:
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


def _sweep(job: _Job, table: _Rows, result, main_row) -> list:
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


def _report(job: _Job, release: dict, baselines: dict, table: _Rows) -> dict:
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
    table = _Rows(args, job.checked.test.to_gluonts(), job.season_length)
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


def _write_outputs(job: _Job, report: dict, release: dict, table: _Rows) -> None:
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


def _public_dataset_size(args, data_path, train):
    """The declared public number of series: ``--dataset-size``, or for the bundled panel
    (public data, its series count published with it) the panel's own count; ``None`` for a
    user's panel without ``--dataset-size`` (then read from the data, recorded and warned)."""
    declared = getattr(args, "dataset_size", None)
    if declared is None and data_path is None:
        return len(train)
    return declared


register_command("forecast", "DP fine-tuning of a gluonts forecaster on the bundled panel or "
                 "your own --data (ε sweep, baselines, report)",
                 add_arguments, run)
