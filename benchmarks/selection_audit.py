"""Audit tuned procedures (issue 40, "Audit"): the table of the tuning guide.

    python benchmarks/selection_audit.py [--runs 1000000] [--seed 0] [--json rows.json]

One row per (trial, procedure): the ε the procedure reports (the whole search's
``selection_epsilon`` for a random number of trials K; the winner's ε for a fixed K that
reports only the winner), the winner's ε (one trial), a valid ε of the procedure (the
selection's; K trials composed for a fixed K), the likelihood-ratio attack's Clopper-Pearson
ε lower bound (one-sided, at ``--confidence``) with its point estimate (no confidence), runs
per side and seconds. ``opacus_structured.audit.selection`` describes the synthetic setting.
The script exits with status 1 if a lower bound exceeds its procedure's valid ε.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _machine import cpu_name  # benchmarks/_machine.py (scripts run from benchmarks/)

from opacus_structured.accounting.gaussian import gdp_mu
from opacus_structured.audit.selection import (
    GaussianTrial,
    LaplaceTrial,
    TrialCount,
    audit_selection,
)


def rows(delta: float):
    """(trial, procedure) pairs of the table."""
    gauss = GaussianTrial(1 / gdp_mu(1.0, delta))  # one trial: ε = 1 at δ
    laplace = LaplaceTrial(1.0)
    scored = GaussianTrial(5.0, score_noise_multiplier=5.0)
    dpsgd = GaussianTrial(1.0, steps=10, sample_rate=0.1)
    random = [TrialCount(mean_trials=10, eta=1.0), TrialCount(mean_trials=10, eta=0.0),
              TrialCount(mean_trials=10, poisson=True)]
    for trial, fixed in ((gauss, (1, 10, 50)), (laplace, (1, 10))):
        for k in fixed:
            yield trial, TrialCount(fixed=k)
        for count in random:
            yield trial, count
    for trial in (scored, dpsgd):
        yield trial, TrialCount(fixed=20)
        yield trial, random[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000,
                        help="searches per side (default 10^6)")
    parser.add_argument("--seed", type=int, default=0, help="audit seed (default 0)")
    parser.add_argument("--delta", type=float, default=1e-5, help="δ (default 1e-5)")
    parser.add_argument("--confidence", type=float, default=0.95,
                        help="confidence of the lower bounds (default 0.95)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    print(f"delta = {args.delta:g}; lower bounds: Clopper-Pearson, one-sided "
          f"{args.confidence:.0%}, thresholds chosen on the data (simultaneous bands); "
          f"{cpu_name()}")
    print("| trial | procedure | reported ε | winner's ε | valid ε | audit ε lower bound "
          "| point estimate | > winner's ε | runs/side | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    out, broken = [], False
    for trial, count in rows(args.delta):
        start = time.perf_counter()
        audit = audit_selection(trial, count, repetitions=args.runs, delta=args.delta,
                                confidence=args.confidence, seed=args.seed)
        seconds = time.perf_counter() - start
        row = {"trial": trial.describe(), **audit.row(), "seconds": seconds}
        out.append(row)
        broken |= not audit.within_upper_bound
        print(f"| {row['trial']} | {row['procedure']} | {audit.reported_epsilon:.3f} "
              f"| {audit.winner_epsilon:.3f} | {audit.upper_bound:.3f} "
              f"| {audit.lower_bound.epsilon:.3f} | {audit.estimate:.3f} "
              f"| {'yes' if audit.exceeds_winner else 'no'} | {args.runs} | {seconds:.1f} |",
              flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    if broken:
        print("A LOWER BOUND EXCEEDS ITS PROCEDURE'S VALID EPSILON", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
