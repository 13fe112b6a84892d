"""Step-time overhead of individual GDP tracking / filtering vs plain Opacus DP-SGD.

Measures one optimizer step (forward, backward with per-sample gradients, clip, noise, update)
of an MLP with Opacus' DPOptimizer, with and without the ``PerSampleEpsilonTracker`` and
``IndividualGDPFilter`` updates (``update`` / ``mask_and_record``, the exact code the Lightning
hooks run) on a per-example state of 10⁶ tracked examples. Uses CUDA when available (timings
with ``torch.cuda.synchronize`` around the timed block only), CPU otherwise.

    python benchmarks/per_sample_tracking.py [--num-examples 1000000] [--batch-size 1024] \
        [--json PATH]

Prints the result as JSON; ``--json PATH`` also writes it to ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
from torch import nn

from lightning_callbacks.gdp_filter import IndividualGDPFilter
from lightning_callbacks.per_sample_epsilon import PerSampleEpsilonTracker
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus_structured.accountants.individual_gdp import per_sample_norms
from opacus_structured.accounting.individual_gdp import ApproximateIndividualPLDAccountant


def bench(mode: str, args, dev) -> float:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, 10)).to(dev)
    gsm = GradSampleModule(net)
    opt = DPOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=args.batch_size)
    tracker = filt = None
    if mode in ("tracker", "both", "tracker+pld"):
        pld = (ApproximateIndividualPLDAccountant(1.0, args.batch_size / args.num_examples,
                                                  num_sigmas=16)
               if mode == "tracker+pld" else None)
        tracker = PerSampleEpsilonTracker(args.num_examples, approximate_pld=pld)
    if mode in ("filter", "both"):
        filt = IndividualGDPFilter(args.num_examples, 1e9, require_full_batch=False)
    x = torch.randn(args.batch_size, args.dim, device=dev)
    y = torch.randint(0, 10, (args.batch_size,), device=dev)
    times = []
    for it in range(args.warmup + args.iters):
        idx = torch.randint(0, args.num_examples, (args.batch_size,), device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(gsm(x), y).backward()
        if filt is not None:
            filt.mask_and_record(opt.params, idx, per_sample_norms(opt.params), 1.0, 1.0)
        if tracker is not None:
            tracker.update(idx, per_sample_norms(opt.params), 1.0, 1.0)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if it >= args.warmup:
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-examples", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--dim", type=int, default=784)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = {m: bench(m, args, dev) for m in ("plain", "tracker", "filter", "both",
                                             "tracker+pld")}
    base = res["plain"]
    out = {"device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(),
           **vars(args), "median_step_s": res,
           "overhead_pct": {m: 100 * (t - base) / base for m, t in res.items() if m != "plain"}}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
