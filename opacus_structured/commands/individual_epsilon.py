"""``opacus-structured individual-epsilon``: individual ε from recorded per-step gradient norms.

Reads a ``.npy`` array of per-sample gradient norms with shape ``[steps, n]`` (row j = the norms
at step j of full-batch DP-GD, global L2 norm over all parameters, before clipping) and prints
each example's individual GDP ε(δ) (Koskela et al. 2023, Cor. C.2 at μ_i = √Σ_j μ_j^(i)²,
μ_j^(i) = min(‖g‖, C)/(σC)), with summary statistics and the worst case √T/σ.

Example::

    opacus-structured individual-epsilon --norms norms.npy --noise-multiplier 10 --clip 1 \\
        --delta 1e-5 --json --histogram eps.png
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from ..accounting.gaussian import gdp_epsilon
from ..accounting.individual_gdp import individual_epsilons, sum_mu_squared
from ._registry import register_command

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--norms", required=True, metavar="FILE.npy",
                   help="per-sample gradient norms, shape [steps, n]")
    p.add_argument("--noise-multiplier", type=float, required=True, help="σ > 0")
    p.add_argument("--clip", type=float, required=True, help="clipping norm C > 0")
    p.add_argument("--delta", type=float, required=True, help="target δ in (0, 1)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with every example's ε")
    p.add_argument("--histogram", metavar="OUT.png", default=None,
                   help="write a histogram of the individual ε (needs matplotlib)")


def run(args) -> int:
    try:
        norms = np.load(args.norms, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--norms: cannot read {args.norms!r} as a .npy array ({exc})") from None
    if norms.ndim != 2:
        raise ValueError(f"--norms must hold an array of shape [steps, n], got {norms.shape}")
    sq = sum_mu_squared(norms, args.noise_multiplier, args.clip)
    eps = individual_epsilons(np.sqrt(sq), args.delta)
    steps, n = norms.shape
    worst = gdp_epsilon(args.delta, math.sqrt(steps) / args.noise_multiplier)
    record = {"steps": steps, "num_examples": n, "delta": args.delta,
              "noise_multiplier": args.noise_multiplier, "clip": args.clip,
              "worst_case_epsilon": worst, "max_epsilon": float(eps.max(initial=0.0)),
              "median_epsilon": float(np.median(eps)) if n else 0.0,
              "min_epsilon": float(eps.min(initial=worst)), "mu": np.sqrt(sq).tolist(),
              "epsilon": eps.tolist()}
    if args.histogram:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.hist(eps, bins=40)
        ax.axvline(worst, color="k", ls="--", label=f"worst case ε = {worst:.3g}")
        ax.set_xlabel(f"individual ε (δ = {args.delta:g})")
        ax.set_ylabel("examples")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.histogram, dpi=120)
        plt.close(fig)
    if args.json:
        print(json.dumps(record, sort_keys=True))
    else:
        print(f"{n} examples, {steps} steps, delta = {args.delta:g}: individual epsilon "
              f"min {record['min_epsilon']:.6g}, median {record['median_epsilon']:.6g}, "
              f"max {record['max_epsilon']:.6g} (worst case {worst:.6g})")
    return 0


register_command("individual-epsilon",
                 "individual (per-example) GDP ε from recorded per-step gradient norms",
                 add_arguments, run)
