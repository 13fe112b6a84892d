"""Structured subsampling accounting: the paper's Fig. 2 and Fig. 4 comparisons as tables.

Schuchardt et al., "Privacy Amplification by Structured Subsampling for Deep Differentially
Private Time Series Forecasting" (ICML 2025). Setting (paper §5.1): N = 320 series, batch size
Λ = 32, σ = 1, L_C = L_F = 1 and L = 20 so that a window hits a given value with r = 0.1.

* Fig. 2 — deterministic top level (Theorem 4.2, composed per epoch) versus fresh
  without-replacement top level (Theorem 4.4, composed per step, 10 steps per epoch).
* Fig. 4 — λ windows per series: λ = 1 tight (Theorem 4.4) versus the *optimistic lower bounds*
  of Theorem F.7 for λ > 1 (even optimistically, λ > 1 loses after 100 steps).

Run: ``python examples/structured_accounting.py [--discretization 1e-3]``.
"""

from __future__ import annotations

import argparse

from opacus_structured.accounting import pld as P
from opacus_structured.schemes.structured import StructuredScheme

BASE = dict(num_series=320, series_length=20, context_length=1, forecast_length=1, batch_size=32)


def row(scheme: StructuredScheme, steps: int, eps, d: float) -> str:
    pld = P.self_compose(scheme.pld(1.0, discretization=d), scheme.compositions(steps))
    deltas = P.delta_for_epsilon(pld, eps)
    return " ".join(f"{x:10.4e}" for x in deltas) + f"  {P.epsilon_for_delta(pld, 1e-5):9.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--discretization", type=float, default=1e-3,
                        help="PLD grid step (pessimistic); coarser is faster and looser")
    args = parser.parse_args()
    d = args.discretization

    eps = [0.1, 0.5, 1.0, 2.0, 4.0]
    print("Fig. 2: deterministic (Thm 4.2, per epoch) vs WOR (Thm 4.4, per step); sigma = 1")
    print(f"{'setting':<36}" + " ".join(f"{'d(' + str(e) + ')':>10}" for e in eps)
          + f"  {'eps(1e-5)':>9}")
    for top, steps in (("deterministic", 10), ("deterministic", 100), ("wor", 1), ("wor", 10),
                       ("wor", 100)):
        s = StructuredScheme(top_level=top, **BASE)
        label = f"{top} {steps} steps ({s.compositions(steps)} {s.unit}s)"
        print(f"{label:<36}" + row(s, steps, eps, d))

    eps = [0.01, 0.1, 1.0, 2.0, 4.0]
    print("\nFig. 4: lambda windows per series (lambda > 1: OPTIMISTIC LOWER BOUND, Thm F.7)")
    print(f"{'setting':<36}" + " ".join(f"{'d(' + str(e) + ')':>10}" for e in eps)
          + f"  {'eps(1e-5)':>9}")
    for lam in (1, 2, 4, 8):
        s = StructuredScheme(instances_per_series=lam, bound="tight" if lam == 1 else "lower",
                             **BASE)
        for steps in (1, 100):
            label = f"lambda={lam} {steps} steps [{s.bound}]"
            print(f"{label:<36}" + row(s, steps, eps, d))


if __name__ == "__main__":
    main()
