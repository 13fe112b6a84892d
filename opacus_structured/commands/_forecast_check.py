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
from ..forecasting.public_weights import default_prediction_length
from ..forecasting.timestamps import _period_freq
from ..forecasting.user_data import load_panel
from ._forecast_args import DEFAULTS, MAX_VERDICT_RUNS, parse_epsilons
from ._forecast_output import check_paths

__all__ = ["CheckedData", "DATA_FLAGS", "CHECKED_ATTRIBUTE", "RANGES", "check_arguments",
           "load_checked_data", "check_forecast"]

#: The flags that describe ``--data`` (attribute -> the loader's default when not given).
DATA_FLAGS = {"layout": "auto", "item_id_column": "item_id", "timestamp_column": "timestamp",
              "target_column": "target", "freq": None, "fill": "error"}
#: Attribute of the parsed arguments that carries the :class:`CheckedData` of a checked run.
CHECKED_ATTRIBUTE = "_checked_data"

#: The ranges the command accepts, checked before any import of the training code (issue 47:
#: every input error names its flag within 2 s). Outside them a run would fail (or hang)
#: minutes later inside the accounting or the network: a σ below 0.5 prices ε of hundreds
#: (σ = 0.5: ε = 204 on the bundled panel, 1008 on 8 series, 16 s per evaluation; σ = 0.3:
#: 54 s) and a target ε above 100 calibrates toward it, until the privacy-loss grid needs
#: billions of points (``--epsilon 1e9``); a δ below 1e-10 is under the PLD route's round-off
#: floor (8.9e-13 after 100 steps, higher after more); a discretization above 0.1 is refused
#: by every other command, below 1e-6 the grid outgrows memory; clipping norms and learning
#: rates beyond the limits overflow float32 in the noise or the update.
RANGES = {
    "--epsilon": (0.01, 100.0), "--epsilons": (0.01, 100.0),
    "--inference-epsilon": (0.01, 100.0), "--noise-multiplier": (0.5, 1e6),
    "--delta": (1e-10, 1.0), "--discretization": (1e-6, 0.1),
    "--max-grad-norm": (0.0, 1e6), "--lr": (0.0, 10.0),
    "--max-steps": (1, 1_000_000), "--num-samples": (1, 10_000),
    "--tune-trials": (1.0, 100.0), "--num-workers": (0, 64),
}


def _check_range(flag: str, value, *, open_low: bool = False, open_high: bool = False,
                 extra: str = "") -> float:
    """``value`` finite and within :data:`RANGES` ``[flag]``; the error names the flag and
    the range."""
    low, high = RANGES[flag]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or (value <= low if open_low else value < low) or (
            value >= high if open_high else value > high):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise ValueError(f"{flag} must be in {interval}{extra}, got {value}")
    return float(value)


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
    prediction_length_source: str = "given"

    def dataset_record(self) -> dict:
        """``report.json["dataset"]``: the loader's report and the panel used, in
        frequency-neutral keys (``test_steps`` and ``min_train_length`` count steps of
        ``freq``, whatever the frequency)."""
        return {**self.report.to_dict(), "name": self.name,
                "min_length_rule": "max(--min-length, 2 × --prediction-length; 3 × with --tune)",
                "num_series_loaded": self.report.num_series, "num_series": len(self.train),
                "min_train_length": self.train.min_length, "test_steps": self.test_steps,
                "prediction_length_source": self.prediction_length_source}


def _get(args, name, default=None):
    return getattr(args, name, default)


def _check_privacy_flags(args) -> Optional[list]:
    """``--epsilon``, ``--epsilons``, ``--noise-multiplier``, ``--delta``, ``--discretization``;
    returns the ``--epsilons`` budgets (or ``None``)."""
    if args.epsilon is None or not args.epsilon > 0:
        raise ValueError(f"--epsilon must be > 0 (or inf for non-private), got {args.epsilon}")
    if args.epsilon != math.inf:
        _check_range("--epsilon", args.epsilon, extra=" (or inf for non-private)")
    budgets = parse_epsilons(_get(args, "epsilons"))
    for budget in budgets or ():
        if budget != math.inf:
            _check_range("--epsilons", budget, extra=" for every finite budget")
    if _get(args, "noise_multiplier") is not None:
        if budgets is not None:
            raise ValueError("--epsilons calibrates σ per budget; it cannot be combined with "
                             "--noise-multiplier")
        _check_range("--noise-multiplier", args.noise_multiplier)
    _check_range("--delta", args.delta, open_high=True)
    _check_range("--discretization", _get(args, "discretization", 1e-4))
    return budgets


def _check_training_flags(args) -> None:
    """The recipe, the batch and the model's lengths."""
    if _get(args, "max_steps") is not None:
        check_int("--max-steps", args.max_steps, minimum=1, maximum=RANGES["--max-steps"][1])
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
            check_int(flag, value, minimum=minimum,
                      maximum=RANGES[flag][1] if flag in RANGES else None)
    check_int("--verdict-runs", _get(args, "verdict_runs", 1), minimum=1,
              maximum=MAX_VERDICT_RUNS)
    for flag, name in (("--max-grad-norm", "max_grad_norm"), ("--lr", "lr")):
        if _get(args, name) is not None:
            _check_range(flag, _get(args, name), open_low=True)
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
    _check_range("--inference-epsilon", inference_epsilon)
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
    _check_range("--tune-trials", _get(args, "tune_trials", 3.0),
                 extra=" (the mean number of trials)")
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


def _length_rule(args) -> int:
    """The steps a series needs: a training part as long as the forecast window plus the
    held-out part (--tune holds out another prediction length of the training part)."""
    return max(args.min_length,
               (3 if _get(args, "tune", False) else 2) * args.prediction_length)


def _default_horizon(args, freq: str) -> None:
    """``--prediction-length`` left out: the frequency's default (:func:`~opacus_structured.
    forecasting.public_weights.default_prediction_length`), recorded on ``args``."""
    args.prediction_length = default_prediction_length(freq)
    args.prediction_length_source = f"default for freq {freq}"


def _read_panel(args, path, options, min_length):
    """``(name, panel, report)`` of ``--data`` (or the bundled panel) with series shorter
    than ``min_length`` excluded."""
    if path is None:
        return "us_employment", *load_panel(load_us_employment(), min_length=min_length)
    return str(path), *load_panel(path, min_length=min_length, **options)


def load_checked_data(args, budgets: Optional[list] = None) -> CheckedData:
    """Read and check the panel of a run whose flags :func:`check_arguments` accepted; a
    left-out ``--prediction-length`` becomes the panel frequency's default."""
    path = _get(args, "data")
    options = {k: (v if v is not None else DATA_FLAGS[k])
               for k, v in ((k, _get(args, k)) for k in DATA_FLAGS)}
    if args.prediction_length is not None:
        args.prediction_length_source = "given"
    elif path is None or options["freq"] is not None:  # the frequency is known: M, --freq
        _default_horizon(args, "M" if path is None else options["freq"])
    try:
        if args.prediction_length is not None:
            name, panel, report = _read_panel(args, path, options, _length_rule(args))
        else:  # the frequency comes from the data: read, then exclude by its horizon
            name, panel, report = _read_panel(args, path, options, args.min_length)
            _default_horizon(args, panel.freq)
            if _length_rule(args) > args.min_length:
                first = report
                panel, report = load_panel(panel, min_length=_length_rule(args))
                report = dataclasses.replace(
                    first, min_length=report.min_length, num_series=report.num_series,
                    min_series_length=report.min_series_length,
                    max_series_length=report.max_series_length,
                    excluded=tuple(first.excluded) + tuple(report.excluded))
    except ValueError as exc:
        if "no series left" not in str(exc):
            raise
        raise ValueError(f"{exc}; a series needs max(--min-length {args.min_length}, "
                         f"{3 if _get(args, 'tune', False) else 2} × --prediction-length "
                         f"{args.prediction_length}) = {_length_rule(args)} steps") from None
    min_length = _length_rule(args)
    if _get(args, "num_series") is not None:
        if not 1 <= args.num_series <= len(panel):
            raise ValueError(f"--num-series must be in [1, {len(panel)}], got {args.num_series}")
        panel = panel.subset(range(args.num_series))
    train, test = train_test_split(panel, args.prediction_length)
    n = len(train)
    _check_lengths(args, train)
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
    epochs = _get(args, "epochs")
    if epochs is not None and math.ceil(epochs * max(1, (declared or n) // batch_size)) > \
            RANGES["--max-steps"][1]:
        raise ValueError(f"--epochs {epochs:g} runs more than {RANGES['--max-steps'][1]} steps "
                         f"({max(1, (declared or n) // batch_size)} steps per epoch)")
    return CheckedData(panel=panel, train=train, test=test, report=report, name=name,
                       path=path, min_length=min_length, batch_size=batch_size,
                       batch_size_source=source, budgets=budgets,
                       test_steps=args.prediction_length,
                       prediction_length_source=_get(args, "prediction_length_source",
                                                     "given"))


def _check_lengths(args, train: Panel) -> None:
    """``--context-length`` and ``--season-length`` against the longest training series: a
    context longer than every series is padding only (and builds a network of that width);
    a season longer than every series has no seasonal lag."""
    longest = int(train.lengths.max())
    for flag, name in (("--context-length", "context_length"),
                       ("--season-length", "season_length")):
        value = _get(args, name)
        if value is not None and value > longest:
            raise ValueError(f"{flag} {value} exceeds the longest training series ({longest} "
                             f"steps after holding out --prediction-length "
                             f"{args.prediction_length}): use at most {longest}")


def check_forecast(args) -> CheckedData:
    """:func:`check_arguments`, then :func:`load_checked_data`; the result is also stored on
    ``args`` (:data:`CHECKED_ATTRIBUTE`) for the run."""
    checked = load_checked_data(args, check_arguments(args))
    setattr(args, CHECKED_ATTRIBUTE, checked)
    return checked
