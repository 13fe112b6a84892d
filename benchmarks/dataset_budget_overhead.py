"""Step-time overhead of charging a run to a dataset budget (issue 46, item 3).

``make_private(..., budget=DatasetBudget(...))`` wraps the optimizer's ``add_noise`` (the step
must be covered by the run's reservation in the budget file) and its step hook (the step was
priced as reserved); the file is locked, read, appended to and ``fsync``-ed once per block of
8, 16, ..., 256 steps (:mod:`opacus_structured.accountants.budget_guard`).

Three measurements, in one process on one machine:

1. **paired steps**: the same DP-SGD loop (an MLP, Poisson sampling through
   ``opacus_structured.make_private``) without a budget (``plain``) and with one (``budget``),
   interleaved step by step (order alternating); the overhead is the median over pairs of
   ``budget / plain − 1`` and the ratio of the medians;
2. **guard pieces** (µs): the covered-step check before the noise and the after-hook check,
   each timed alone (median of ``--reps`` calls);
3. **a reservation** (ms): one ``DatasetBudget.reserve`` (lock, read, bisect, append,
   ``fsync``) on the temporary file, and its cost per step at the largest block.

    python benchmarks/dataset_budget_overhead.py [--batch-size 64] [--dim 64] [--hidden 64] \\
        [--pairs 400] [--reps 2000] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
from _machine import cpu_name  # benchmarks/_machine.py (scripts run from benchmarks/)
from _timing import median_us as _median_us  # benchmarks/_timing.py
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured.accountants.budget_guard import MAX_BLOCK, guards_of
from opacus_structured.accounting import renyi_filter as rf


def _loop(args, budget):
    """A make_private loop; returns ``step()`` (one optimizer step on the next batch) and the
    optimizer."""
    torch.manual_seed(0)
    n = args.batch_size * args.steps_per_epoch
    data = TensorDataset(torch.randn(n, args.dim), torch.randint(0, 10, (n,)))
    net = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, 10))
    engine = PrivacyEngine(accountant="poisson")
    model, opt, loader = opacus_structured.make_private(
        engine, module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        data_loader=DataLoader(data, batch_size=args.batch_size), noise_multiplier=1.0,
        max_grad_norm=1.0, budget=budget, dataset_size=n)
    state = {"it": iter(loader)}

    def step():
        try:
            xb, yb = next(state["it"])
        except StopIteration:
            state["it"] = iter(loader)
            xb, yb = next(state["it"])
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()

    return step, opt


def measure(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        budget = opacus_structured.DatasetBudget(os.path.join(tmp, "bench.budget"),
                                                 epsilon=1e6, delta=1e-5)
        loops = {"plain": _loop(args, None), "budget": _loop(args, budget)}
        for _ in range(20):  # warm-up (and the first reservations)
            for name in loops:
                loops[name][0]()
        times = {name: [] for name in loops}
        for i in range(args.pairs):
            for name in (("plain", "budget") if i % 2 else ("budget", "plain")):
                t = time.perf_counter()
                loops[name][0]()
                times[name].append(time.perf_counter() - t)
        ratios = [b / p - 1 for b, p in zip(times["budget"], times["plain"], strict=True)]
        guard = guards_of(loops["budget"][1])[budget.path]
        opt = loops["budget"][1]
        pieces = {"before the noise (covered step)": _median_us(
            lambda: guard._covered(*guard._next_step(opt)), args.reps)}
        acc = guard.accountant
        before = (len(acc), 0, *guard._next_step(opt))

        def after():
            guard._before = before
            used = guard._used
            guard.after_release()
            guard._used = used

        pieces["after the hook (priced as reserved)"] = _median_us(after, args.reps)
        step = rf.poisson_gaussian_rdp(1 / args.steps_per_epoch, 1.0, budget.orders)
        writes = []
        for k in range(20):
            t = time.perf_counter()
            budget.reserve("bench-reserve", lambda j, k=k: ((k + j) * step, 0.0), MAX_BLOCK)
            writes.append(time.perf_counter() - t)
        reserve_ms = 1e3 * statistics.median(writes)
        records = len(budget.records())
    return {"plain_ms": 1e3 * statistics.median(times["plain"]),
            "budget_ms": 1e3 * statistics.median(times["budget"]),
            "paired_overhead_pct": 100 * statistics.median(ratios),
            "ratio_of_medians": statistics.median(times["budget"])
            / statistics.median(times["plain"]),
            "pieces_us": pieces, "reserve_ms": reserve_ms,
            "reserve_us_per_step_at_max_block": 1e3 * reserve_ms / MAX_BLOCK,
            "file_records": records, "steps": args.pairs + 20}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--pairs", type=int, default=400)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    for name in ("batch_size", "steps_per_epoch", "dim", "hidden", "pairs", "reps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    out = measure(args)
    print(f"CPU: {cpu_name()}, torch threads={torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"MLP {args.dim}-{args.hidden}-{args.hidden}-10, batch {args.batch_size}, "
          f"q = 1/{args.steps_per_epoch}, {args.pairs} interleaved pairs")
    print("| loop | median step (ms) |")
    print("|---|---|")
    print(f"| make_private | {out['plain_ms']:.3f} |")
    print(f"| make_private(budget=...) | {out['budget_ms']:.3f} |")
    print(f"\npaired overhead {out['paired_overhead_pct']:+.2f} %, ratio of medians "
          f"{out['ratio_of_medians']:.4f}")
    for piece, us in out["pieces_us"].items():
        print(f"  {piece}: {us:.2f} µs")
    print(f"  one reservation (lock, read, bisect, append, fsync): {out['reserve_ms']:.2f} ms "
          f"= {out['reserve_us_per_step_at_max_block']:.1f} µs per step at {MAX_BLOCK} steps")
    out.update(cpu=cpu_name(), threads=torch.get_num_threads(), args=vars(args),
               load_average=os.getloadavg()[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=lambda v: float(v) if np.isscalar(v) else v)
    return out


if __name__ == "__main__":
    main()
