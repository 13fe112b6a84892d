"""Our Poisson accountant vs dp_accounting's PLD and Opacus' PRV accountant.

Prints ε(δ=1e-5) and wall time for T ∈ {10², 10³, 10⁴} steps at q = 0.01, σ = 1, and the time
ratio ours / dp_accounting at the same discretisation. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from dp_accounting.pld import privacy_loss_distribution as dpl
from opacus.accountants import PRVAccountant

from opacus_structured.accounting import epsilon_for_delta, self_compose
from opacus_structured.schemes import PoissonScheme


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sample-rate", type=float, default=0.01)
    ap.add_argument("--noise-multiplier", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--discretization", type=float, default=1e-4)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    q, s, d, vdi = a.sample_rate, a.noise_multiplier, a.delta, a.discretization
    scheme = PoissonScheme(sample_rate=q)
    rows = []
    for steps in (100, 1000, 10_000):
        ours, t_ours = timed(lambda: scheme.epsilon(s, steps, d, discretization=vdi))
        ref, t_ref = timed(lambda: epsilon_for_delta(self_compose(
            dpl.from_gaussian_mechanism(s, sampling_prob=q, value_discretization_interval=vdi),
            steps), d))

        def prv():
            acc = PRVAccountant()
            acc.history = [(s, q, steps)]
            return acc.get_epsilon(d)

        prv_eps, t_prv = timed(prv)
        rows.append(dict(steps=steps, eps_ours=ours, eps_dp_accounting=ref, eps_opacus_prv=prv_eps,
                         t_ours=t_ours, t_dp_accounting=t_ref, t_opacus_prv=t_prv,
                         ratio_vs_dp_accounting=t_ours / t_ref))
    print(f"q={q} sigma={s} delta={d} discretization={vdi}  ({platform.node()}, "
          f"{platform.processor() or platform.machine()})")
    print(f"{'T':>6} {'eps ours':>10} {'eps dp_acc':>10} {'eps PRV':>10} {'t ours':>8} "
          f"{'t dp_acc':>8} {'t PRV':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['steps']:>6} {r['eps_ours']:>10.5f} {r['eps_dp_accounting']:>10.5f} "
              f"{r['eps_opacus_prv']:>10.5f} {r['t_ours']:>7.2f}s {r['t_dp_accounting']:>7.2f}s "
              f"{r['t_opacus_prv']:>7.2f}s {r['ratio_vs_dp_accounting']:>6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(config=vars(a), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
