"""The forecast command's job: the checked flags and data, the model's recipe with its
defaults filled in, the public initial weights (read before any private data is used), the
keywords every training run shares, and the table the runs are scored into.

:func:`prepare_job` builds a :class:`Job` for :func:`~.forecast.run_forecast`; the parts of the
run (the release, the sweep, the reruns, the baselines, the report) read it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Optional

from .. import _progress
from ..dataset_budget import DatasetBudget
from ..forecasting.model_defaults import model_defaults
from ..forecasting.seasonality import season_length as default_season_length
from ..samplers._generator import fresh_seed
from ._forecast_args import RECIPE_FLAGS
from ._forecast_check import CHECKED_ATTRIBUTE, check_forecast
from ._forecast_tune import check_gate, searching

__all__ = ["Job", "Rows", "prepare_job", "initial_weights", "dataset_budget",
           "public_dataset_size", "NOT_PRIVATE_SEEDED", "SEEDED_REASON"]

#: Printed (and put on the plot) for a DP run whose noise was seeded with ``--seed``.
NOT_PRIVATE_SEEDED = "NOT PRIVATE: reproducible noise (--seed given); for evaluation only"
#: ``report["not_private_reason"]`` of such a run.
SEEDED_REASON = ("reproducible noise: seeded with --seed (whoever knows the seed regenerates the "
                 "sampler draws and the noise and can subtract it)")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def initial_weights(init_from, args, freq, progress, log, season_length=None,
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
class Job:
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


class Rows:
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


def prepare_job(args) -> Job:
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
    dataset_size = public_dataset_size(args, checked.path, train)
    tune_gate = (check_gate(args, dataset_size or len(train)) if getattr(args, "tune", False)
                 else None)
    # public pretrained weights (read before any private data is used; see pretraining.py)
    # the shortest series a run trains on (--tune's trials: without their validation steps)
    shortest = train.min_length - (args.prediction_length if searching(args, tune_gate)
                                   else 0)
    init_state, init_meta = initial_weights(init_from, args, train.freq, progress, log,
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
    return Job(args=args, checked=checked, t_start=t_start, recipe=recipe,
                recipe_given=recipe_given, tail_average=tail_average, init_from=init_from,
                init_state=init_state, init_meta=init_meta, lr=lr, common=common,
                season_length=season_length, season_source=season_source, seed=seed,
                given_init=given_init, init_seed=init_seed, dp_sgd=dp_sgd,
                seeded_dp=dp_sgd and seed is not None, seeded_any=seeded_any,
                budgets=budgets, progress=progress, log=log, tune_gate=tune_gate,
                dataset_budget=dataset_budget(args))


def dataset_budget(args) -> Optional[DatasetBudget]:
    """``--budget PATH``: the existing file (its cap, checked against ``--budget-epsilon`` and
    ``--delta`` when given), or a new one with ``--budget-epsilon`` and ``--delta``."""
    path = getattr(args, "budget", None)
    if path is None:
        return None
    cap = getattr(args, "budget_epsilon", None)
    if cap is None:
        return DatasetBudget.open(path)
    return DatasetBudget(path, epsilon=cap, delta=args.delta)


def public_dataset_size(args, data_path, train):
    """The declared public number of series: ``--dataset-size``, or for the bundled panel
    (public data, its series count published with it) the panel's own count; ``None`` for a
    user's panel without ``--dataset-size`` (then read from the data, recorded and warned)."""
    declared = getattr(args, "dataset_size", None)
    if declared is None and data_path is None:
        return len(train)
    return declared
