"""The ``forecast`` command's arguments: its flags, the model-independent defaults and the
``--epsilons`` parser (split from :mod:`opacus_structured.commands.forecast`, which re-exports
every name; the leading underscore keeps this module out of the command discovery)."""

from __future__ import annotations

import argparse

from .._defaults import DEFAULT_DISCRETIZATION
from ..forecasting.model_defaults import MODEL_DEFAULTS
from ..forecasting.public_weights import DEFAULT_HORIZONS, FALLBACK_HORIZON

__all__ = ["DEFAULTS", "MAX_VERDICT_RUNS", "RECIPE_FLAGS", "add_arguments", "parse_epsilons"]

#: Model-independent defaults. The DP recipe of each model (clip norm, lr, steps, tail average,
#: context), chosen on public panels only (``benchmarks/forecast_recipe.py``; the studies are in
#: docs/guides/forecasting.md), is its row of ``forecasting/model_defaults.py``.
DEFAULTS = dict(model="dlinear", epsilon=1.0, delta=1e-7, batch_size=64,
                num_samples=100, verdict_runs=3)
#: The most runs ``--verdict-runs`` accepts (each one a training on the private panel).
MAX_VERDICT_RUNS = 20
#: The recipe values a flag overrides; without the flag, the model's row of
#: :data:`~opacus_structured.forecasting.model_defaults.MODEL_DEFAULTS` gives them.
RECIPE_FLAGS = {"max_grad_norm": "--max-grad-norm", "lr": "--lr", "max_steps": "--max-steps",
                "tail_average": "--tail-average", "zero_shot_weight": "--zero-shot-weight"}


def _recipe_help(key, fmt="{:g}"):
    """``"dlinear 0.0001, simpleff 0.0003, deepar 0.0003"``: each model's default, for --help."""
    return ", ".join(f"{name} {fmt.format(row[key])}" for name, row in MODEL_DEFAULTS.items())


def _add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """The privacy target and the DP recipe (model, ε, δ, σ, steps, batch, horizon, context,
    season, clipping norm, learning rate)."""
    p.add_argument("--model", choices=("deepar", "dlinear", "simpleff"),
                   default=DEFAULTS["model"], help="gluonts model (default %(default)s)")
    p.add_argument("--epsilon", type=float, default=DEFAULTS["epsilon"],
                   help="privacy budget ε > 0, or 'inf' for non-private (default %(default)g)")
    p.add_argument("--delta", type=float, default=DEFAULTS["delta"],
                   help="δ in (0, 1) (default %(default)g, as in the paper)")
    p.add_argument("--discretization", type=float, default=DEFAULT_DISCRETIZATION,
                   help="pessimistic PLD discretisation used to calibrate σ and report ε "
                        "(default %(default)g, as every other command)")
    p.add_argument("--noise-multiplier", type=float, default=None,
                   help="fix σ instead of calibrating it; training then stops before the "
                        "step that would exceed --epsilon")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=int, default=None,
                        help="optimizer steps (default: the model's, "
                             f"{_recipe_help('max_steps', '{:d}')})")
    length.add_argument("--epochs", type=float, default=None,
                        help="epochs of floor(N / batch size) steps (a fractional count is "
                             "rounded up to whole steps)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"series per step Λ (one window each; default min({DEFAULTS['batch_size']}"
                        ", N) for N training series, or the declared --dataset-size; σ is "
                        "calibrated to --epsilon for the Λ used)")
    p.add_argument("--prediction-length", type=int, default=None,
                   help="forecast horizon L_F in time steps; also the held-out test steps "
                        "(default per frequency: " + ", ".join(
                            f"{f} {h}" for f, h in DEFAULT_HORIZONS.items())
                        + f"; other frequencies {FALLBACK_HORIZON})")
    p.add_argument("--context-length", type=int, default=None,
                   help="model context before lags (default: the model's, "
                        f"{_recipe_help('context_multiple', '{:d}·L_F')})")
    p.add_argument("--season-length", type=int, default=None, metavar="M",
                   help="steps per seasonal cycle: the seasonal-naive lag, the MASE scale and "
                        "the public pretraining corpus' period (default from the frequency: "
                        "15min 96, 30min 48, h 24, D 7, B 5, W 52, M 12, Q 4, Y 1)")
    p.add_argument("--max-grad-norm", type=float, default=None,
                   help="per-window clipping norm C (default: the model's, "
                        f"{_recipe_help('max_grad_norm')})")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam learning rate (default: the model's when fine-tuning public "
                        f"weights, {_recipe_help('lr')}; from scratch "
                        f"{_recipe_help('lr_from_scratch')})")


def _add_start_arguments(p: argparse.ArgumentParser) -> None:
    """Where training starts and what is released (initial and saved weights, tail average,
    zero-shot weight)."""
    p.add_argument("--init-from", default="public", metavar="{public,none,PATH}",
                   help="start DP fine-tuning from public pretrained weights (default "
                        "'public': shipped with the package, cached, or pretrained now on the "
                        "synthetic public corpus; see `opacus-structured pretrain`), from a "
                        "weights file, or from a random initialisation ('none'). A file "
                        "written by --save-weights carries its run's privacy record: a run on "
                        "the same data is composed with it (the reported epsilon covers both); "
                        "a file without a record needs --init-public")
    p.add_argument("--init-public", action="store_true",
                   help="declare the --init-from PATH weights public (never trained on this "
                        "data); refused when their privacy record shows a run on this data")
    p.add_argument("--save-weights", default=None, metavar="PATH",
                   help="write the released model's weights with their privacy record (the "
                        "runs they went through) to PATH, for a later --init-from PATH")
    p.add_argument("--tail-average", type=float, default=None,
                   help="release the mean of the last fraction of the iterates (post-processing:"
                        " no privacy cost; 0 = the last iterate; default: the model's, "
                        f"{_recipe_help('tail_average')})")
    p.add_argument("--zero-shot-weight", type=float, default=None, metavar="W",
                   help="forecast with the mixture (1 - W) x fine-tuned + W x public zero-shot "
                        "model, W in [0, 1) (post-processing: no privacy cost; needs public "
                        "initial weights; 0 = the fine-tuned model alone; default: the "
                        f"model's, {_recipe_help('zero_shot_weight')})")


def _add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The budget sweep and the private hyperparameter search."""
    p.add_argument("--epsilons", default=None, metavar="LIST",
                   help="sweep: train once per budget in this comma-separated list (e.g. "
                        "0.5,1,2,4,inf) and write sweep.png (CRPS and MASE against ε with the "
                        "seasonal-naive and non-private lines); replaces --epsilon")
    p.add_argument("--tune", action="store_true",
                   help="choose the learning rate, the steps and the zero-shot weight W "
                        "(including W = 1: the public model) on this panel by private "
                        "selection (Papernot & Steinke 2022): a secret random number of DP "
                        "trials on the training part minus its last --prediction-length steps, "
                        "each scored privately on those steps; the whole search is priced "
                        "within --epsilon. Run only where the score can resolve the candidates "
                        "(decided on ε, δ and the public number of series: from ~3100 series "
                        "at ε = 1); otherwise the recipe is trained at the whole ε and the "
                        "reason printed (docs/guides/tuning_without_leaking.md)")
    p.add_argument("--tune-always", action="store_true",
                   help="with --tune: run the search even where its private score is too "
                        "noisy to tell the candidates apart (by default --tune then trains "
                        "the recipe once at the whole --epsilon and says why; the decision "
                        "uses public quantities only)")
    p.add_argument("--tune-trials", type=float, default=3.0, metavar="MEAN",
                   help="with --tune: mean number of trials E[K] >= 1 (default %(default)g)")
    p.add_argument("--tune-eta", type=float, default=1.0, metavar="ETA",
                   help="with --tune: shape of the truncated negative binomial law of K "
                        "(> -1; 0 logarithmic, 1 geometric; default %(default)g)")


def _add_inference_arguments(p: argparse.ArgumentParser) -> None:
    """Private inputs at prediction (inference privacy)."""
    p.add_argument("--inference-epsilon", type=float, default=None, metavar="EPS",
                   help="also forecast the test series from PRIVATE inputs: each series' "
                        "history is Poisson-subsampled in time and gets Gaussian noise "
                        "calibrated to this ε (Koga et al. 2022; Schuchardt et al. 2025 App. H); "
                        "reported separately from the training ε, as its own row")
    p.add_argument("--inference-sensitivity", type=float, default=None, metavar="V",
                   help="with --inference-epsilon: the largest change of one protected time "
                        "step, in the data's units (public; required)")
    p.add_argument("--inference-rate", type=float, default=0.5, metavar="R",
                   help="with --inference-epsilon: probability that an input time step is kept "
                        "(default %(default)g)")


def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    """The panel: the series used, the user's CSV and its layout."""
    p.add_argument("--num-series", type=int, default=None,
                   help="use only the first N series (quick runs)")
    p.add_argument("--min-length", type=int, default=1,
                   help="exclude series shorter than this many time steps (reported)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on your own CSV (long: item_id,timestamp,target columns; wide: "
                        "a timestamp column and one column per series); default: the bundled "
                        "US employment panel. Series shorter than max(--min-length, "
                        "2 × --prediction-length) are excluded and listed in the report")
    p.add_argument("--layout", choices=("auto", "long", "wide"), default=None,
                   help="CSV layout (default auto: long when the item-id and target columns "
                        "exist, else wide)")
    p.add_argument("--item-id-column", default=None,
                   help="series id column of a long CSV (default item_id)")
    p.add_argument("--timestamp-column", default=None,
                   help="timestamp column (default timestamp)")
    p.add_argument("--target-column", default=None,
                   help="value column of a long CSV (default target)")
    p.add_argument("--freq", default=None,
                   help="pandas frequency of --data (M, MS, W, D, h, ...; default: inferred, "
                        "every series must agree)")
    p.add_argument("--fill", choices=("error", "ffill", "interpolate", "drop-series"),
                   default=None,
                   help="missing values inside a series of --data: error (default), ffill "
                        "(carry the last value forward), interpolate (linear) or drop-series "
                        "(exclude it); leading/trailing ones are trimmed; all are reported")


def _add_evaluation_arguments(p: argparse.ArgumentParser) -> None:
    """The forecasts' samples and the reference rows."""
    p.add_argument("--num-samples", type=int, default=DEFAULTS["num_samples"],
                   help="sample paths per forecast")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the non-private and seasonal-naive baselines")
    p.add_argument("--no-ets", action="store_true",
                   help="skip the statsmodels ETS reference row (fitted per series WITHOUT "
                        "privacy: not private; needs statsmodels, else omitted with a notice)")


def _add_mechanism_arguments(p: argparse.ArgumentParser) -> None:
    """How the DP run is carried out (device, LSTM, clipping mode, sampling, dataset size,
    workers, seeds)."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="torch device for training (default cpu)")
    p.add_argument("--lstm-impl", choices=("fast", "opacus"), default="fast",
                   help="DP LSTM for DeepAR: fast (FastDPLSTM, default) or opacus (DPLSTM); "
                        "same per-window gradients")
    p.add_argument("--grad-sample-mode", choices=("hooks", "ghost"), default="hooks",
                   help="per-window clipping: hooks (Opacus per-sample gradients, default) or "
                        "ghost (book-keeping: norms by the Gram trick, clipped sum from the same "
                        "backward; same update)")
    p.add_argument("--top-level", choices=("wor", "deterministic", "shuffle"), default="wor",
                   help="how the series of a step are drawn: wor (fresh distinct series every "
                        "step, default), deterministic (fixed blocks, per-epoch accounting) or "
                        "shuffle (one permutation per epoch); the accountant prices the one "
                        "chosen")
    p.add_argument("--dataset-size", type=int, default=None, metavar="N",
                   help="declared public number of training series N (<= the panel's; "
                        "--top-level wor when smaller): the sampling rate, the epoch length "
                        "and the normaliser then come from N and --batch-size only, the same "
                        "for every neighbouring panel (default: the panel's own count, read "
                        "from the data, recorded as dataset_size_source=data)")
    p.add_argument("--num-workers", type=int, default=0,
                   help="DataLoader workers cutting the windows (same batches; > 0 overlaps "
                        "data and GPU steps; default 0)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed the privacy coins (window sampler and DP noise) and, unless "
                        "--init-seed is given, the weight initialisation: the run becomes "
                        "reproducible and NOT PRIVATE (the seed regenerates the noise), for "
                        "evaluation only; it is written to the report with that label. "
                        "Default: fresh OS entropy, recorded nowhere")
    p.add_argument("--init-seed", type=int, default=None,
                   help="seed only the public randomness (weight initialisation, dropout, "
                        "forecast sampling at evaluation); the run stays private. Default: "
                        "--seed, else fresh")


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The verdict's runs, the output folders, the dataset budget and what is shown."""
    p.add_argument("--verdict-runs", type=int, default=DEFAULTS["verdict_runs"], metavar="R",
                   help="runs the verdict rests on: the release and R - 1 reruns of the same "
                        "mechanism with fresh coins, scored on the test split and never "
                        "released (default %(default)s; 1: the release alone, its run-to-run "
                        f"spread unmeasured; at most {MAX_VERDICT_RUNS})")
    p.add_argument("--output", default="forecast-report", metavar="DIR",
                   help="directory (default %(default)s) of DIR/release/ (the released "
                        "weights and their model card: nothing computed from the private data "
                        "without noise, publishable) and DIR/diagnostics/ (report.json, "
                        "forecasts.png: scores on the private test split, NOT for "
                        "publication)")
    p.add_argument("--budget", default=None, metavar="PATH",
                   help="the panel's dataset budget file (opacus_structured.DatasetBudget): "
                        "every DP run of this command (the sweep, the search) is charged to it "
                        "before its noise, and stops before the step that would pass its cap; "
                        "a file that does not exist is created with --budget-epsilon and "
                        "--delta. The non-private reference rows are not charged (skip them "
                        "with --no-baselines --no-ets), nor the verdict's reruns, which are "
                        "never released (their test-split scores are diagnostics)")
    p.add_argument("--budget-epsilon", type=float, default=None, metavar="E",
                   help="the cap ε of a new --budget file (its δ is --delta); checked against "
                        "an existing one")
    p.add_argument("--no-plot", action="store_true", help="do not write forecasts.png")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true",
                   help="print the report as one JSON object instead of the table (progress "
                        "and notices go to stderr)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``forecast`` command's flags, in the order ``--help`` lists them."""
    _add_recipe_arguments(p)
    _add_start_arguments(p)
    _add_search_arguments(p)
    _add_inference_arguments(p)
    _add_data_arguments(p)
    _add_evaluation_arguments(p)
    _add_mechanism_arguments(p)
    _add_output_arguments(p)


def parse_epsilons(text):
    """``"0.5,1,inf"`` → ``[0.5, 1.0, inf]`` (``None`` stays ``None``); clear errors."""
    if text is None:
        return None
    budgets = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--epsilons: {part!r} is not a number (expected a comma-separated "
                             "list such as 0.5,1,2,4,inf)") from None
        if not value > 0:
            raise ValueError(f"--epsilons: every budget must be > 0 (or inf), got {part!r}")
        budgets.append(value)
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"--epsilons lists a budget twice: {text!r}")
    return budgets
