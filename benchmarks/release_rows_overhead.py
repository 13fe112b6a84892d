"""Step-time overhead of observing what each noisy step summed (issue 39).

The release-row record (``opacus_structured/accountants/release_rows.py``) adds host work per
step and no pass over ``grad_sample``: the loader tags the batch with row tokens
(``tag_batch``), the private module's forward pre-hook reads and strips them, the clipping
reads the number of per-sample rows (a ``len``), and the accountant summarises the step
(``RowRecorder.take``: one ``np.unique`` over the step's tokens). Labels travel as tracked
tensors too, so the loss pays ``__torch_function__`` dispatch.

Two measurements, on the same machine in the same process:

1. **components**: each piece timed alone (median of ``--reps`` calls) for batch sizes
   64 / 256 / 1024, and their sum, the per-step cost in µs;
2. **paired steps**: one DP-SGD step of an MLP (``--dim``, ``--hidden``, batch ``--batch-size``)
   with the guard only (``guarded``) and with the record (``rows``), interleaved step by step;
   the overhead is the median over pairs of ``rows / guarded − 1`` (CPU timings are noisy: the
   component sum divided by the guarded step is the steadier figure).

    python benchmarks/release_rows_overhead.py [--batch-size 256] [--dim 64] [--hidden 64] \\
        [--pairs 400] [--reps 2000] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _machine import cpu_name, write_json  # benchmarks/_machine.py (scripts run from benchmarks/)
from _timing import median_us as _median_us  # benchmarks/_timing.py
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from opacus_structured.accountants.release_guard import guard_optimizer
from opacus_structured.accountants.release_rows import install_recorder
from opacus_structured.samplers.row_provenance import tag_batch


def components(batch: int, reps: int) -> dict:
    """Median µs of each piece of the record for one step of ``batch`` rows."""
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    gsm = GradSampleModule(nn.Linear(64, 10))
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=batch)
    rec = install_recorder(opt, gsm)
    xb, yb = tag_batch((x, y), 0)
    logits = torch.randn(batch, 10)
    out = {
        "tag_batch": _median_us(lambda: tag_batch((x, y), 3), reps),
        "forward_pre_hook": _median_us(lambda: rec.forward_pre_hook(gsm, (xb,), {}), reps),
        "loss on tracked labels (extra)":
            _median_us(lambda: nn.functional.cross_entropy(logits, yb), reps)
            - _median_us(lambda: nn.functional.cross_entropy(logits, y), reps),
    }
    rec.forwards = []

    def take():
        rec.forward_pre_hook(gsm, (xb,), {})
        rec.on_clip(batch, fresh=True)
        rec.take()

    out["clip count + take"] = _median_us(take, reps) - out["forward_pre_hook"]
    out["total"] = sum(out.values())
    return out


def paired(args) -> dict:
    """Interleaved guarded / rows steps of the same MLP; medians and the paired overhead."""
    def build(rows: bool):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(),
                            nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                            nn.Linear(args.hidden, 10))
        gsm = GradSampleModule(net)
        opt = DPOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), noise_multiplier=1.0,
                          max_grad_norm=1.0, expected_batch_size=args.batch_size)
        guard_optimizer(opt)
        rec = install_recorder(opt, gsm) if rows else None
        return gsm, opt, rec

    x = torch.randn(args.batch_size, args.dim)
    y = torch.randint(0, 10, (args.batch_size,))
    variants = {name: build(name == "rows") for name in ("guarded", "rows")}

    def step(name, i):
        gsm, opt, rec = variants[name]
        xb, yb = (x, y) if rec is None else tag_batch((x, y), i)
        opt.zero_grad()
        nn.functional.cross_entropy(gsm(xb), yb).backward()
        opt.step()
        if rec is not None:
            rec.take()

    for i in range(20):
        step("guarded", i)
        step("rows", i)
    times = {"guarded": [], "rows": []}
    for i in range(args.pairs):
        order = ("guarded", "rows") if i % 2 else ("rows", "guarded")
        for name in order:
            t = time.perf_counter()
            step(name, i)
            times[name].append(time.perf_counter() - t)
    ratios = [r / g - 1 for r, g in zip(times["rows"], times["guarded"], strict=True)]
    return {"guarded_ms": 1e3 * statistics.median(times["guarded"]),
            "rows_ms": 1e3 * statistics.median(times["rows"]),
            "paired_overhead_pct": 100 * statistics.median(ratios)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--pairs", type=int, default=400)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    for name in ("batch_size", "dim", "hidden", "pairs", "reps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    comp = {b: components(b, args.reps) for b in (64, 256, 1024)}
    pair = paired(args)
    share = 100 * comp[min(comp, key=lambda b: abs(b - args.batch_size))]["total"] \
        / (1e3 * pair["guarded_ms"])
    cpu = cpu_name()
    print(f"CPU: {cpu}, torch threads={torch.get_num_threads()}")
    print("| piece (µs per step) | batch 64 | batch 256 | batch 1024 |")
    print("|---|---|---|---|")
    for piece in comp[64]:
        print(f"| {piece} | " + " | ".join(f"{comp[b][piece]:.1f}" for b in comp) + " |")
    print(f"\nMLP {args.dim}-{args.hidden}-{args.hidden}-10, batch {args.batch_size}: guarded "
          f"step {pair['guarded_ms']:.2f} ms, with the record {pair['rows_ms']:.2f} ms; "
          f"paired overhead {pair['paired_overhead_pct']:+.1f} %; component sum / guarded "
          f"step {share:.2f} %")
    out = {"cpu": cpu, "threads": torch.get_num_threads(), **vars(args),
           "components_us": comp, **pair, "component_share_pct": share}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
