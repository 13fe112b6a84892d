"""Check first, import later: the ``forecast`` command's arguments and data, checked before
torch, gluonts, Lightning, opacus or matplotlib is imported (docs/architecture.md, "Lazy
loading").

:func:`check_arguments` checks every flag's range and every combination of flags; each error
names the flag as typed on the command line (``--prediction-length must be >= 1, got -3``).
:func:`load_checked_data` then reads and checks the panel (``--data`` or the bundled one) with
:mod:`~opacus_structured.forecasting.user_data` (numpy / pandas only), applies ``--num-series``,
splits off the test steps and fits ``--batch-size`` and ``--dataset-size`` to the panel.
:func:`check_forecast` does both; the console calls it before it imports the training code,
and :func:`~opacus_structured.commands.forecast.run_forecast` uses its result (or calls it,
when called directly). Split out of ``commands/forecast.py``; the leading underscore keeps this
module out of the command discovery.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

from .._validation import check_finite, check_int, check_positive
from ..forecasting.data import Panel, load_us_employment, train_test_split
from ..forecasting.model_defaults import check_zero_shot_weight
from ..forecasting.timestamps import _period_freq
from ..forecasting.user_data import load_panel
from ._forecast_args import DEFAULTS, parse_epsilons
from ._forecast_output import check_paths

__all__ = ["CheckedData", "DATA_FLAGS", "CHECKED_ATTRIBUTE", "check_arguments",
           "load_checked_data", "check_forecast"]

#: The flags that describe ``--data`` (attribute -> the loader's default when not given).
DATA_FLAGS = {"layout": "auto", "item_id_column": "item_id", "timestamp_column": "timestamp",
              "target_column": "target", "freq": None, "fill": "error"}
#: Attribute of the parsed arguments that carries the :class:`CheckedData` of a checked run.
CHECKED_ATTRIBUTE = "_checked_data"


@dataclasses.dataclass(frozen=True)
class CheckedData:
    """The checked panel of a forecast run and what the run needs to know about it.

    * ``panel``: the loaded panel (after ``--num-series``); ``train`` / ``test``: its split
      (the last ``--prediction-length`` steps of every series held out).
    * ``report``: the loader's :class:`~opacus_structured.forecasting.user_data.DataReport`.
    * ``name``: ``"us_employment"`` or the ``--data`` path; ``path``: ``--data`` or ``None``.
    * ``min_length``: the length a series needs, ``max(--min-length, 2 × --prediction-length)``.
    * ``batch_size`` / ``batch_size_source``: ``--batch-size``, or its default for the panel.
    * ``budgets``: the ``--epsilons`` list, or ``None``.
    * ``test_steps``: the held-out steps of every series (``--prediction-length``).
    """

    panel: Panel
    train: Panel
    test: Panel
    report: Any
    name: str
    path: Optional[str]
    min_length: int
    batch_size: int
    batch_size_source: str
    budgets: Optional[list]
    test_steps: int

    def dataset_record(self) -> dict:
        """``report.json["dataset"]``: the loader's report and the panel used, in
        frequency-neutral keys (``test_steps`` and ``min_train_length`` count steps of
        ``freq``, whatever the frequency)."""
        return {**self.report.to_dict(), "name": self.name,
                "min_length_rule": "max(--min-length, 2 × --prediction-length; 3 × with --tune)",
                "num_series_loaded": self.report.num_series, "num_series": len(self.train),
                "min_train_length": self.train.min_length, "test_steps": self.test_steps}


def _get(args, name, default=None):
    return getattr(args, name, default)


def _check_privacy_flags(args) -> Optional[list]:
    """``--epsilon``, ``--epsilons``, ``--noise-multiplier``, ``--delta``, ``--discretization``;
    returns the ``--epsilons`` budgets (or ``None``)."""
    if args.epsilon is None or not args.epsilon > 0:
        raise ValueError(f"--epsilon must be > 0 (or inf for non-private), got {args.epsilon}")
    budgets = parse_epsilons(_get(args, "epsilons"))
    if _get(args, "noise_multiplier") is not None:
        if budgets is not None:
            raise ValueError("--epsilons calibrates σ per budget; it cannot be combined with "
                             "--noise-multiplier")
        check_positive("--noise-multiplier", args.noise_multiplier)
    if not 0 < args.delta < 1:
        raise ValueError(f"--delta must be in (0, 1), got {args.delta}")
    check_positive("--discretization", _get(args, "discretization", 1e-4))
    return budgets


def _check_training_flags(args) -> None:
    """The recipe, the batch and the model's lengths."""
    if _get(args, "max_steps") is not None:
        check_int("--max-steps", args.max_steps, minimum=1)
    if _get(args, "epochs") is not None:
        check_positive("--epochs", args.epochs)
    for flag, name, minimum in (("--batch-size", "batch_size", 1),
                                ("--prediction-length", "prediction_length", 1),
                                ("--context-length", "context_length", 1),
                                ("--season-length", "season_length", 1),
                                ("--num-series", "num_series", 1),
                                ("--min-length", "min_length", 1),
                                ("--num-samples", "num_samples", 1),
                                ("--dataset-size", "dataset_size", 1),
                                ("--num-workers", "num_workers", 0),
                                ("--seed", "seed", 0), ("--init-seed", "init_seed", 0)):
        value = _get(args, name)
        if value is not None:
            check_int(flag, value, minimum=minimum)
    for flag, name in (("--max-grad-norm", "max_grad_norm"), ("--lr", "lr")):
        if _get(args, name) is not None:
            check_positive(flag, _get(args, name))
    tail_average = _get(args, "tail_average")
    if tail_average is not None and not 0.0 <= check_finite("--tail-average",
                                                            tail_average) <= 1.0:
        raise ValueError(f"--tail-average must be in [0, 1] (fraction of the last steps whose "
                         f"iterates are averaged), got {tail_average}")
    if (_get(args, "grad_sample_mode") == "ghost" and args.model == "deepar"
            and _get(args, "lstm_impl", "fast") != "fast"):
        raise ValueError("--grad-sample-mode ghost needs --lstm-impl fast for DeepAR: Opacus' "
                         "DPLSTM runs its linear layers once per time step")


def _check_init_flags(args) -> None:
    """``--init-from``, ``--init-public``, ``--zero-shot-weight``."""
    init_from = _get(args, "init_from", "none") or "none"
    weight = _get(args, "zero_shot_weight")
    if weight is not None:
        weight = check_zero_shot_weight(weight, "--zero-shot-weight")
        if weight > 0 and init_from == "none":
            raise ValueError("--zero-shot-weight mixes in the public zero-shot model: it needs "
                             "public initial weights, not --init-from none")
    if _get(args, "init_public", False) and init_from in ("none", "public"):
        raise ValueError("--init-public declares the weights of --init-from PATH public; it "
                         f"does not apply to --init-from {init_from}")


def _check_inference_flags(args) -> None:
    """``--inference-epsilon`` and the flags that go with it."""
    inference_epsilon = _get(args, "inference_epsilon")
    sensitivity = _get(args, "inference_sensitivity")
    if inference_epsilon is None:
        if sensitivity is not None:
            raise ValueError("--inference-sensitivity applies to --inference-epsilon only")
        return
    if not (inference_epsilon > 0 and math.isfinite(inference_epsilon)):
        raise ValueError(f"--inference-epsilon must be finite and > 0, got {inference_epsilon}")
    if sensitivity is None:
        raise ValueError("--inference-epsilon needs --inference-sensitivity V (the largest "
                         "change of one protected time step, in the data's units)")
    check_positive("--inference-sensitivity", sensitivity)
    rate = _get(args, "inference_rate", 0.5)
    if not 0 < rate <= 1:
        raise ValueError(f"--inference-rate must be in (0, 1], got {rate}")


def _check_tune_flags(args) -> None:
    """``--tune`` and what it chooses itself (docs/guides/tuning.md)."""
    if not _get(args, "tune", False):
        if _get(args, "tune_always", False):
            raise ValueError("--tune-always needs --tune")
        return
    check_finite("--tune-trials", _get(args, "tune_trials", 3.0))
    if not _get(args, "tune_trials", 3.0) >= 1:
        raise ValueError(f"--tune-trials (the mean number of trials) must be >= 1, got "
                         f"{args.tune_trials}")
    eta = check_finite("--tune-eta", _get(args, "tune_eta", 1.0))
    if not eta > -1:
        raise ValueError(f"--tune-eta must be > -1, got {eta}")
    if not math.isfinite(args.epsilon):
        raise ValueError("--tune prices the search within --epsilon: give a finite --epsilon")
    for flag, name in (("--epsilons", "epsilons"), ("--noise-multiplier", "noise_multiplier"),
                       ("--zero-shot-weight", "zero_shot_weight"), ("--epochs", "epochs"),
                       ("--save-weights", "save_weights")):
        if _get(args, name) is not None:
            why = {"--epsilons": "one search per run",
                   "--noise-multiplier": "σ is calibrated for the whole search",
                   "--zero-shot-weight": "--tune chooses W",
                   "--epochs": "--tune chooses the steps (--max-steps sets the largest)",
                   "--save-weights": ("a weights file's privacy record composes single runs; "
                                      "a search is priced by its Rényi curve")}[flag]
            raise ValueError(f"{flag} cannot be combined with --tune ({why})")
    if (_get(args, "init_from", "none") or "none") not in ("public", "none"):
        raise ValueError("--tune starts every trial from --init-from public or none, not from "
                         "a weights file (its earlier runs would have to be composed with the "
                         "search)")


def _check_data_flags(args) -> None:
    """The ``--data`` flags: only with ``--data``; ``--freq`` a pandas frequency."""
    given = {k: _get(args, k) for k in DATA_FLAGS}
    if _get(args, "data") is None:
        stray = ["--" + k.replace("_", "-") for k, v in given.items() if v is not None]
        if stray:
            raise ValueError(f"{', '.join(stray)} appl{'ies' if len(stray) == 1 else 'y'} to "
                             "--data PATH (your own CSV) only")
    if given["freq"] is not None:
        try:
            _period_freq(given["freq"])
        except ValueError as exc:
            raise ValueError(f"--freq {given['freq']!r}: {exc}") from None


def _check_budget_flags(args) -> None:
    """``--budget PATH`` and ``--budget-epsilon``: the file (read when it exists, created at
    the run otherwise) and a DP run to charge."""
    path, cap = _get(args, "budget"), _get(args, "budget_epsilon")
    if path is None:
        if cap is not None:
            raise ValueError("--budget-epsilon sets the cap of a --budget file: give --budget")
        return
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"--budget-epsilon must be finite and > 0, got {cap}")
    if not math.isfinite(args.epsilon) and _get(args, "noise_multiplier") is None:
        raise ValueError("--budget charges DP runs; --epsilon inf without --noise-multiplier "
                         "trains without privacy, whose epsilon no budget can pay for")
    if os.path.isdir(path):
        raise ValueError(f"--budget {path}: is a directory, not a budget file")
    if os.path.exists(path):
        if not os.access(path, os.R_OK | os.W_OK):
            raise ValueError(f"--budget {path}: the file is not readable and writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--budget {path}: the directory {parent} does not exist")
    if cap is None:
        raise ValueError(f"--budget {path} does not exist: give --budget-epsilon E to create it "
                         f"(with --delta as its delta)")


def check_arguments(args) -> Optional[list]:
    """Check every flag of the forecast command (ranges and combinations) and every path
    (``--data``, ``--init-from PATH``, ``--output``, ``--save-weights``); returns the
    ``--epsilons`` budgets (or ``None``). Reads no data, imports no training code."""
    budgets = _check_privacy_flags(args)
    _check_training_flags(args)
    _check_init_flags(args)
    _check_inference_flags(args)
    _check_tune_flags(args)
    _check_data_flags(args)
    _check_budget_flags(args)
    check_paths(args)
    return budgets


def load_checked_data(args, budgets: Optional[list] = None) -> CheckedData:
    """Read and check the panel of a run whose flags :func:`check_arguments` accepted."""
    # a series needs a training part as long as the forecast window plus the held-out part
    # (--tune holds out another prediction length of the training part for its scores)
    min_length = max(args.min_length,
                     (3 if _get(args, "tune", False) else 2) * args.prediction_length)
    path = _get(args, "data")
    try:
        if path is None:
            name = "us_employment"
            panel, report = load_panel(load_us_employment(), min_length=min_length)
        else:
            name = str(path)
            options = {k: (v if v is not None else DATA_FLAGS[k])
                       for k, v in ((k, _get(args, k)) for k in DATA_FLAGS)}
            panel, report = load_panel(path, min_length=min_length, **options)
    except ValueError as exc:
        if "no series left" not in str(exc):
            raise
        raise ValueError(f"{exc}; a series needs max(--min-length {args.min_length}, 2 × "
                         f"--prediction-length {args.prediction_length}) = {min_length} "
                         "steps") from None
    if _get(args, "num_series") is not None:
        if not 1 <= args.num_series <= len(panel):
            raise ValueError(f"--num-series must be in [1, {len(panel)}], got {args.num_series}")
        panel = panel.subset(range(args.num_series))
    train, test = train_test_split(panel, args.prediction_length)
    n = len(train)
    declared = _get(args, "dataset_size")
    if declared is not None:
        if declared > n:
            raise ValueError(f"--dataset-size {declared} declares more series than the panel "
                             f"holds ({n} training series after exclusions): each step would "
                             f"draw a series with probability batch/{n}, above the priced "
                             f"batch/{declared}; use --dataset-size {n} or smaller")
        if declared != n and _get(args, "top_level", "wor") != "wor":
            raise ValueError(f"--dataset-size {declared} differs from the panel's {n} series: "
                             "only --top-level wor (per-step accounting) can be priced with a "
                             f"public number of series; --top-level {args.top_level} prices "
                             "epochs of the panel's own length")
    batch_size, source = _get(args, "batch_size"), "given"
    if batch_size is None:  # fits the panel (N is public here, as in the accountant)
        batch_size = min(DEFAULTS["batch_size"], declared or n)
        source = f"default min({DEFAULTS['batch_size']}, N = {declared or n})"
    if declared is not None and batch_size > declared:
        raise ValueError(f"--batch-size {batch_size} exceeds --dataset-size {declared}: each "
                         "step draws --batch-size distinct series of the declared N")
    if batch_size > n:
        raise ValueError(f"fewer series than the batch size: {n} training series (after "
                         f"exclusions) but --batch-size {batch_size}; each step draws "
                         f"--batch-size distinct series: use --batch-size {n} or smaller")
    return CheckedData(panel=panel, train=train, test=test, report=report, name=name,
                       path=path, min_length=min_length, batch_size=batch_size,
                       batch_size_source=source, budgets=budgets,
                       test_steps=args.prediction_length)


def check_forecast(args) -> CheckedData:
    """:func:`check_arguments`, then :func:`load_checked_data`; the result is also stored on
    ``args`` (:data:`CHECKED_ATTRIBUTE`) for the run."""
    checked = load_checked_data(args, check_arguments(args))
    setattr(args, CHECKED_ATTRIBUTE, checked)
    return checked
