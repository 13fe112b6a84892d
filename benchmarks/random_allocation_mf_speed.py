"""Time ``random-allocation-mf`` against ``balls-in-bins`` for the same run (issue 20, item 5).

Same process, same setting (C = I, ``b`` bins, ``k`` epochs, σ, δ, discretisation 1e-4):

* ``balls-in-bins``: :class:`BallsInBinsScheme` (pld-accounting PLD + Rényi, the smaller ε);
* ``random-allocation-mf --method best`` now: Rényi, then the certified lower bound on
  conditional composition, which skips the PLD when it cannot beat the Rényi ε;
* the same before the change (``--before``): Rényi + the full conditional-composition PLD,
  ``min`` of the two (what ``method="best"`` computed until issue 20; minutes).

    python benchmarks/random_allocation_mf_speed.py [--before] [--epochs 3] [--bins 100]
"""

from __future__ import annotations

import argparse
import time

from opacus_structured.accounting import conditional_composition as cc
from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme
from opacus_structured.schemes.random_allocation_mf import RandomAllocationMFScheme


def timed(f):
    t0 = time.perf_counter()
    value = f()
    return value, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bins", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--discretization", type=float, default=1e-4)
    parser.add_argument("--before", action="store_true",
                        help="also time the pre-issue-20 path (full conditional composition)")
    args = parser.parse_args()
    b, k, sigma, delta, d = args.bins, args.epochs, args.sigma, args.delta, args.discretization
    steps = b * k

    bib, t_bib = timed(lambda: BallsInBinsScheme(num_bins=b, epochs=k).epsilon(
        sigma, steps, delta, discretization=d))
    print(f"balls-in-bins               eps={bib:.6f}  {t_bib:8.2f} s  (1.00x)", flush=True)
    for method in ("renyi", "best"):
        s = RandomAllocationMFScheme(batches_per_epoch=b, epochs=k, method=method)
        eps, t = timed(lambda s=s: s.epsilon(sigma, steps, delta, discretization=d))
        print(f"random-allocation-mf {method:6s} eps={eps:.6f}  {t:8.2f} s  ({t / t_bib:.2f}x)",
              flush=True)
    if args.before:
        s = RandomAllocationMFScheme(batches_per_epoch=b, epochs=k, method="renyi")
        ren, t_ren = timed(lambda: s.epsilon(sigma, steps, delta, discretization=d))
        cond, t_cc = timed(lambda: cc.conditional_composition_epsilon(
            s.means(), sigma, delta, discretization=d))
        t = t_ren + t_cc
        print(f"before: best = min(renyi {ren:.6f}, conditional {cond:.6f}) = "
              f"{min(ren, cond):.6f}  {t:8.2f} s  ({t / t_bib:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
