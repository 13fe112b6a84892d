"""Audit every scheme on every path it supports (issue 19): the acceptance table.

    python benchmarks/audit_sweep.py --runs 2000 --seed 10 [--json audit_sweep.json]

One row per (scheme, path[, mutation]): the ε the pipeline's accountant reports, the 95 %
Clopper-Pearson lower bound from ``run_audit``'s scores, their ratio (acceptance: <= 1 and
>= 0.5 unbroken, > 1 for a mutation), runs per side and wall-clock seconds. Per scheme and
mutation on the hooks path, ``docs/guides/auditing_table.py`` prints the same numbers with the
GDP estimate.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

from opacus_structured.audit.estimators import epsilon_lower_bound
from opacus_structured.audit.pipelines import audit_registry, run_audit

#: (scheme, path, mutation, extra flags) beyond every scheme's own paths unbroken.
EXTRA = [
    ("structured", "hooks", None,
     dict(top_level="deterministic", series_length=4, context_length=1, steps=6)),
    ("poisson", "hooks", "noise-halved", {}), ("poisson", "hooks", "rate-doubled", {}),
    ("poisson", "hooks", "no-clipping", {}),
    ("bandmf-cyclic-poisson", "hooks", "wrong-band", {}),
    ("bandmf-cyclic-poisson", "hooks", "noise-halved", {}),
    ("bminsep-mc", "hooks", "wrong-band", {}),
    ("structured", "forecaster", "noise-halved",
     audit_registry()["structured"]["path_flags"]["forecaster"]),
    ("truncated-poisson", "hooks", None,
     audit_registry()["truncated-poisson"]["mutation_flags"]["rate-doubled"]),
    ("truncated-poisson", "hooks", "rate-doubled",
     audit_registry()["truncated-poisson"]["mutation_flags"]["rate-doubled"]),
]


def sweep():
    """Every (scheme, path) of the registry unbroken, then :data:`EXTRA`."""
    for scheme, info in audit_registry().items():
        for path in info["paths"]:
            yield scheme, path, None, dict(info["path_flags"].get(path, {}))
    yield from EXTRA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="runs per side (default 2000)")
    parser.add_argument("--seed", type=int, default=10, help="audit seed (default 10)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--schemes", nargs="*", default=None, help="only these schemes")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print("| scheme | path | mutation | reported ε | audited ε lb (95 %) | ratio | runs/side "
          "| seconds |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for scheme, path, mutation, flags in sweep():
        if args.schemes and scheme not in args.schemes:
            continue
        start = time.perf_counter()
        scores = run_audit(scheme, runs=args.runs, seed=args.seed, path=path,
                           mutation=mutation, **flags)
        seconds = time.perf_counter() - start
        lb = epsilon_lower_bound(scores.scores_with, scores.scores_without,
                                 delta=scores.delta).epsilon
        ratio = lb / scores.reported_epsilon
        label = scheme if not flags else f"{scheme} ({flags.get('top_level', 'custom')})"
        print(f"| {label} | {path} | {mutation or '-'} | {scores.reported_epsilon:.3f} | "
              f"{lb:.3f} | {ratio:.2f} | {args.runs} | {seconds:.1f} |", flush=True)
        out.append({"scheme": scheme, "path": path, "mutation": mutation, "flags": flags,
                    "delta": scores.delta, "reported_epsilon": scores.reported_epsilon,
                    "audited_epsilon_lower_bound": lb, "ratio": ratio,
                    "runs_per_side": args.runs, "seed": args.seed, "seconds": seconds})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
