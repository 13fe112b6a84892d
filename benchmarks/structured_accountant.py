"""Benchmark: structured-subsampling accountant vs dp_accounting's Poisson PLD; sampler throughput.

For 10², 10³, 10⁴ steps, times (a) our Theorem 4.4 accountant (profile → pessimistic
connect-the-dots PLD → self-composition) and (b) dp_accounting's
``from_gaussian_mechanism(σ/2, sampling_prob=ρr)`` + ``self_compose`` — the Poisson-subsampled
Gaussian with the same privacy-loss range — at the same value discretisation. Also measures the
structured sampler's throughput in windows per second.

Run: ``python benchmarks/structured_accountant.py [--discretization 1e-4] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from dp_accounting.pld import privacy_loss_distribution as pldlib

from opacus_structured.accounting import pld as P
from opacus_structured.accounting import structured as st
from opacus_structured.schemes.structured import StructuredScheme


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--discretization", type=float, default=1e-4)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    d, sigma = args.discretization, args.sigma
    # Fig. 2 setting: ρ = 0.1, r = 0.1
    scheme = StructuredScheme(num_series=320, series_length=20, context_length=1,
                              forecast_length=1, batch_size=32)
    q = scheme.series_sampling_rate() * scheme.hit_probability()

    def ours(n):
        pld = P.pld_from_profile(st.thm_4_4(sigma, scheme.series_sampling_rate(),
                                            scheme.hit_probability()), discretization=d)
        return P.epsilon_for_delta(P.self_compose(pld, n), 1e-5)

    def theirs(n):
        pld = pldlib.from_gaussian_mechanism(sigma / 2, sensitivity=1.0, sampling_prob=q,
                                             value_discretization_interval=d)
        return pld.self_compose(n).get_epsilon_for_delta(1e-5)

    print(f"accountant, sigma={sigma}, q=rho*r={q:g}, discretization={d:g} "
          f"(best of {args.repeats}, seconds)")
    print(f"{'steps':>7} {'ours':>9} {'dp_acc':>9} {'ratio':>7} {'eps ours':>10} {'eps dp_acc':>10}")
    for n in (100, 1000, 10000):
        t_o, _, e_o = best_of(lambda: ours(n), args.repeats)
        t_t, _, e_t = best_of(lambda: theirs(n), args.repeats)
        print(f"{n:>7} {t_o:9.3f} {t_t:9.3f} {t_o / t_t:7.2f} {e_o:10.4f} {e_t:10.4f}")
        rows.append(dict(kind="accountant", steps=n, seconds_ours=t_o, seconds_dp_accounting=t_t,
                         ratio=t_o / t_t, epsilon_ours=e_o, epsilon_dp_accounting=e_t))
    print("(eps differ on purpose: ours is the substitution-relation switching profile,"
          " dp_accounting reports max(remove, add) of the add/remove relation)")

    for top, bottom in (("wor", "wr"), ("shuffle", "wr"), ("deterministic", "poisson")):
        s = StructuredScheme(num_series=2000, series_length=1000, context_length=96,
                             forecast_length=24, batch_size=256, top_level=top,
                             bottom_level=bottom)
        sampler = s.sampler(generator=torch.Generator().manual_seed(0))
        t0 = time.perf_counter()
        windows = sum(len(b) for _ in range(5) for b in sampler)
        dt = time.perf_counter() - t0
        print(f"sampler {top}+{bottom}: {windows / dt:,.0f} windows/s "
              f"({windows} windows, {dt:.2f} s)")
        rows.append(dict(kind="sampler", top_level=top, bottom_level=bottom,
                         windows_per_second=windows / dt))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"sigma": sigma, "discretization": d, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
