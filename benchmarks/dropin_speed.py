"""Drop-in path timings (issue 41): how long a user waits in ``make_private`` and ``advise``.

Cases, each run in a fresh interpreter (imports excluded from the timed call, but timed
separately as ``import_s``; so is the user's own ``torch.optim.SGD(...)`` line, ``optimizer_s``:
torch's first optimizer imports ``torch._dynamo``, ~1 s on the 2-core VM, which runs whatever
accountant is used and was inside the timed call before 2026-11-29):

* ``make_private truncated-poisson (default B)`` — 640 rows, batch 64, ``epochs=2``, σ = 1,
  the default discretization: the search for ``max_batch_size`` (issue 41: 107–127 s at load 7);
* ``make_private poisson`` — the same loader and model;
* ``advise (full command)`` — ``opacus-structured advise --dataset-size 60000 --batch-size 256
  --epochs 10 --target-epsilon 2 --delta 1e-5 --bands 4 16`` as a subprocess (start-up
  included), with each row's seconds, σ and whether it was skipped.

Wall and CPU seconds are printed with the 1-minute load average before and after each case
(a busy machine inflates wall times; CPU time much less). ``--src DIR`` times another checkout
(e.g. ``git worktree add /tmp/before <commit>``); ``--skip-advise`` leaves the slow case out::

    python benchmarks/dropin_speed.py --json after.json
    python benchmarks/dropin_speed.py --src /tmp/before --json before.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from _machine import cpu_name  # benchmarks/_machine.py (scripts run from benchmarks/)

MAKE_PRIVATE = r"""
import json, os, re, sys, time, warnings
t0 = time.perf_counter()
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import opacus_structured
imported = time.perf_counter() - t0
torch.manual_seed(0)
data = TensorDataset(torch.randn(640, 4), torch.zeros(640, dtype=torch.long))
model = nn.Linear(4, 2)
engine = PrivacyEngine(accountant=sys.argv[1])
o0 = time.perf_counter()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the user's line, timed apart
optimizer_s = time.perf_counter() - o0
w0, c0 = time.perf_counter(), time.process_time()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opacus_structured.make_private(engine, module=model, optimizer=optimizer,
        data_loader=DataLoader(data, batch_size=64), noise_multiplier=1.0, max_grad_norm=1.0,
        epochs=2)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
scheme = engine.accountant.scheme
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "import_s": imported, "optimizer_s": optimizer_s,
                  "max_batch_size": getattr(scheme, "max_batch_size", None),
                  "epsilon_vs_poisson": next((m.group(1) for m in (re.search(
                      r"Poisson's, (\S+ vs \S+) at", str(w.message)) for w in caught) if m),
                      None)}))
"""

ADVISE_ARGS = ["advise", "--dataset-size", "60000", "--batch-size", "256", "--epochs", "10",
               "--target-epsilon", "2", "--delta", "1e-5", "--bands", "4", "16"]


def _load() -> float:
    return os.getloadavg()[0]


def _env(src: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _make_private(src: str, accountant: str) -> dict:
    before = _load()
    out = subprocess.run([sys.executable, "-c", MAKE_PRIVATE, accountant], env=_env(src),
                         cwd=src, capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])  # the checkout timed: cwd = src
    res.update(load_before=before, load_after=_load())
    return res


def _advise(src: str) -> dict:
    before = _load()
    w0 = time.perf_counter()
    t0 = os.times()
    out = subprocess.run([sys.executable, "-m", "opacus_structured", *ADVISE_ARGS, "--json",
                          "--no-progress"],
                         env=_env(src), cwd=src, capture_output=True, text=True, check=True)
    t1 = os.times()
    wall = time.perf_counter() - w0
    cpu = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    advice = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["label"]: {"seconds": round(r["seconds"], 2), "noise_multiplier":
                         r["noise_multiplier"], "epsilon": r["epsilon"],
                         "skipped": r["note"].startswith("skipped")} for r in advice["rows"]}
    skipped = sum(r["skipped"] for r in rows.values())
    return {"wall_s": wall, "cpu_s": cpu, "skipped_rows": skipped, "load_before": before,
            "load_after": _load(), "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="checkout to time (default: this one)")
    parser.add_argument("--skip-advise", action="store_true", help="leave the advise case out")
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args(argv)
    results = {
        "make_private truncated-poisson (default B)": _make_private(args.src,
                                                                    "truncated-poisson"),
        "make_private poisson": _make_private(args.src, "poisson"),
    }
    if not args.skip_advise:
        results["advise (full command)"] = _advise(args.src)
    print(f"{'case':46s} {'wall s':>8s} {'cpu s':>8s} {'load':>11s}  extra")
    for name, r in results.items():
        extra = ", ".join(f"{k}={r[k]:.3g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in ("max_batch_size", "epsilon_vs_poisson", "skipped_rows",
                                                   "import_s", "optimizer_s")
                          if r.get(k) is not None)
        print(f"{name:46s} {r['wall_s']:8.2f} {r['cpu_s']:8.2f} "
              f"{r['load_before']:5.2f}/{r['load_after']:5.2f}  {extra}")
        for label, row in r.get("rows", {}).items():  # the advise rows, each timed
            what = "skipped" if row["skipped"] else f"sigma={row['noise_multiplier']}"
            print(f"  {label:44s} {row['seconds']:8.2f}  {what}")
    print(f"CPU: {cpu_name()}")
    if args.json:
        meta = {"src": args.src, "python": platform.python_version(), "cpu": cpu_name(),
                "machine": platform.processor() or platform.machine(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
