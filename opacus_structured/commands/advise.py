"""``opacus-structured advise``: which batching scheme gives the least noise for a setting.

Calibrates σ for every applicable scheme to the same (ε, δ) and ranks them by the prefix-sum
RMSE of the noisy averaged gradients (for independent noise: the noise std σ·C/E[batch]); see
:mod:`opacus_structured.advisor`. Example::

    opacus-structured advise --dataset-size 60000 --batch-size 256 --epochs 10 \\
        --target-epsilon 2 --delta 1e-5 --bands 4 16 [--json] [--plot advice.png]
"""

from __future__ import annotations

import argparse
import json

from .. import _progress
from ..advisor import DEFAULT_TIME_BUDGET, advise, plot_advice
from ._registry import register_command

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-size", type=int, required=True, metavar="N",
                   help="number of training examples N")
    p.add_argument("--batch-size", type=float, required=True, metavar="B",
                   help="expected batch size B, in (0, N]")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, metavar="T", help="optimizer steps T")
    length.add_argument("--epochs", type=float, metavar="E",
                        help="epochs (T = ceil(E * round(N/B)))")
    p.add_argument("--target-epsilon", type=float, required=True, help="privacy budget ε > 0")
    p.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
    p.add_argument("--bands", type=int, nargs="*", default=[], metavar="b",
                   help="band counts of the matrix-mechanism rows (BandMF with cyclic Poisson, "
                        "random-allocation MF, b-min-sep); none: no such rows")
    p.add_argument("--max-batch-size", type=int, default=None, metavar="B_max",
                   help="truncated Poisson's max batch size (default: the smallest whose ε is "
                        "within 1%% of Poisson's at the same σ)")
    p.add_argument("--discretization", type=float, default=1e-3,
                   help="pessimistic discretisation of every accountant (default %(default)g: "
                        "enough to rank; the σ shown stay valid, slightly conservative)")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET, metavar="S",
                   help="seconds shared by the random-allocation-mf rows (default %(default)g);"
                        " rows that do not finish are listed as skipped")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (schema opacus-structured/advise/1)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write RMSE against ε for each scheme (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args) -> int:
    progress = _progress.enabled(args.no_progress)
    advice = advise(dataset_size=args.dataset_size, batch_size=args.batch_size,
                    steps=args.steps, epochs=args.epochs, target_epsilon=args.target_epsilon,
                    delta=args.delta, bands=args.bands, max_batch_size=args.max_batch_size,
                    discretization=args.discretization, time_budget=args.time_budget,
                    curves=args.plot is not None, progress=progress)
    if args.plot:
        plot_advice(advice, args.plot)
    if args.json:
        print(json.dumps(advice.to_dict(), sort_keys=True))
    else:
        print(advice.format_table())
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


register_command("advise", "rank batching schemes by noise for a setting (calibrates each)",
                 add_arguments, run)
