"""Step-time overhead of the individual GDP filter and the per-sample ε tracker (issue 32).

One optimizer step (forward, backward with per-sample gradients, clip, noise, update) of an MLP
with Opacus' ``DPOptimizer``, in these variants, each built once with its own model:

* ``stock``: Opacus' ``DPOptimizer`` as released (no guard);
* ``guarded``: the same optimizer after :func:`~opacus_structured.accountants.release_guard.guard_optimizer`
  (what ``make_private`` / ``DPCallback`` install: the clipping of
  :mod:`opacus_structured.accountants.clip_factors`, non-finite examples clipped to 0) — the
  baseline of the overheads below;
* ``filter``: guarded + ``IndividualGDPFilter.attach`` (the mask folded into the clip factors);
* ``tracker``: guarded + ``PerSampleEpsilonTracker.attach`` on ``--num-examples`` examples, and
  ``tracker-small`` on ``--small-examples`` (10³): the step's work must not depend on N;
* ``both`` (filter + tracker) and ``tracker+pld`` (the approximate App. D state as well);
* ``rows``: guarded + the release-row record of issue 39 (what ``make_private`` installs: the
  batch arrives as :class:`~opacus_structured.samplers.row_provenance.PrivateRows` with its
  row tokens, the module's forward pre-hook reads them, the clipping counts its rows, and the
  step's :class:`~opacus_structured.accountants.release_rows.ReleaseRows` is taken as the
  accountant does). Its overhead is ``O(B)`` host work, no pass over ``grad_sample``.

The callbacks run exactly as under Lightning (``attach`` + ``set_batch_indices``). The variants
are **interleaved**: each round times ``--steps`` consecutive steps of every variant in turn
(a fresh batch of indices per step, drawn outside the timed region), and the table gives the
median over rounds with the min–max spread, and the overhead against ``guarded`` of the same
round (median and spread): CPU timings here are noisy, and interleaving spreads the noise over
all variants.

**Bytes per step.** The per-sample gradients dominate the traffic: the backward writes them
(``B·d`` floats) and the clipping reads them twice (norms, clipped sum): ``3·B·d`` floats. The
filter and the tracker add ``O(B)`` bytes (state rows of the batch: ≈ 100 B per example), no
``O(d)`` or ``O(N)`` term. The table prints that model, the achieved GB/s of the step and its
fraction of a STREAM-like triad (``a = b + s·c``, arrays out of cache) measured in the same
rounds.

    python benchmarks/per_sample_tracking.py [--num-examples 1000000] [--batch-size 1024] \
        [--rounds 15] [--steps 3] [--threads 1] [--json PATH]

Prints a table and the result as JSON; ``--json PATH`` also writes it to ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings

import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from lightning_callbacks.gdp_filter import IndividualGDPFilter
from lightning_callbacks.per_sample_epsilon import PerSampleEpsilonTracker
from opacus_structured.accountants.release_guard import guard_optimizer
from opacus_structured.accountants.release_rows import install_recorder
from opacus_structured.accounting.individual_gdp import ApproximateIndividualPLDAccountant
from opacus_structured.samplers.row_provenance import tag_batch

VARIANTS = ("stock", "guarded", "filter", "tracker", "tracker-small", "both", "tracker+pld",
            "rows")
#: Extra bytes per example and step of the callbacks' state updates (model, see docstring):
#: index (8) + gather of the filter's spent μ² (8) + two index_add_ read/write of float64 (32)
STATE_BYTES_PER_EXAMPLE = {"filter": 48 + 16, "tracker": 48, "tracker-small": 48,
                           "both": 48 + 16 + 48, "tracker+pld": 48 + 8}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _variant(name: str, args, device):
    """``(step, callbacks, num_params)`` of one variant; ``step(indices)`` runs one step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(args.dim, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                        nn.Linear(args.hidden, 10)).to(device)
    gsm = GradSampleModule(net)
    opt = DPOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), noise_multiplier=1.0,
                      max_grad_norm=1.0, expected_batch_size=args.batch_size)
    if name != "stock":
        guard_optimizer(opt)
    n = args.small_examples if name == "tracker-small" else args.num_examples
    cbs = []
    if name in ("filter", "both"):
        cbs.append(IndividualGDPFilter(n, 1e9, require_full_batch=False))
    if name in ("tracker", "tracker-small", "both", "tracker+pld"):
        pld = (ApproximateIndividualPLDAccountant(1.0, args.batch_size / n, num_sigmas=16)
               if name == "tracker+pld" else None)
        cbs.append(PerSampleEpsilonTracker(n, approximate_pld=pld))
    for cb in cbs:
        if not cb.attach(opt):
            raise RuntimeError(f"{type(cb).__name__} could not be folded into the clipping")
    x = torch.randn(args.batch_size, args.dim, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    recorder = install_recorder(opt, gsm) if name == "rows" else None
    draws = iter(range(1 << 30))

    def step(indices):
        for cb in cbs:
            cb.set_batch_indices(indices)
        xb, yb = (x, y) if recorder is None else tag_batch((x, y), next(draws))
        opt.zero_grad()
        nn.functional.cross_entropy(gsm(xb), yb).backward()
        opt.step()
        if recorder is not None:  # what the accountant's step hook takes
            recorder.take()

    return step, n, sum(p.numel() for p in net.parameters())


def run(args, device) -> dict:
    steps, sizes = {}, {}
    for name in VARIANTS:
        steps[name], sizes[name], num_params = _variant(name, args, device)
    # the triad moves as many bytes as the step's per-sample gradient traffic (out of cache)
    grad_sample_elems = 3 * args.batch_size * num_params
    n = max(1 << 20, grad_sample_elems // 3)
    a, b, c = (torch.rand(n, device=device) for _ in range(3))

    def triad(_):
        torch.add(b, c, alpha=3.0, out=a)

    order = ["triad", *VARIANTS]
    steps["triad"] = triad
    gen = torch.Generator().manual_seed(0)

    def indices(name):  # the CPU tensor a batch sampler yields (drawn outside the timing)
        return torch.randint(0, sizes.get(name, 1), (args.batch_size,), generator=gen)

    for name in order:  # warm-up: allocations, per-example state moved to the device
        for _ in range(2):
            steps[name](indices(name))
    times = {name: [] for name in order}
    shuffle = random.Random(0)
    for _ in range(args.rounds):
        shuffle.shuffle(order)
        for name in order:
            batch = [indices(name) for _ in range(args.steps)]
            _sync(device)
            t = time.perf_counter()
            for idx in batch:
                steps[name](idx)
            _sync(device)
            times[name].append((time.perf_counter() - t) / args.steps)
    size = 4  # float32
    rows = {}
    triad_gbs = [3 * n * size / t / 1e9 for t in times["triad"]]
    for name in VARIANTS:
        ts = times[name]
        over = [100 * (t - g) / g for t, g in zip(ts, times["guarded"], strict=True)]
        moved = grad_sample_elems * size + STATE_BYTES_PER_EXAMPLE.get(name, 0) * args.batch_size
        gbs = [moved / t / 1e9 for t in ts]
        frac = [g / tg for g, tg in zip(gbs, triad_gbs, strict=True)]
        rows[name] = dict(
            num_examples=sizes[name] if name in STATE_BYTES_PER_EXAMPLE else None,
            median_ms=1e3 * statistics.median(ts), min_ms=1e3 * min(ts), max_ms=1e3 * max(ts),
            overhead_pct=statistics.median(over), overhead_min=min(over),
            overhead_max=max(over), bytes_per_step=moved, gbs=statistics.median(gbs),
            frac_triad=statistics.median(frac))
    return dict(rows=rows, triad_gbs=statistics.median(triad_gbs), params=num_params)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-examples", type=int, default=1_000_000)
    p.add_argument("--small-examples", type=int, default=1_000)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--dim", type=int, default=784)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=3, help="steps timed per variant and round")
    p.add_argument("--iters", type=int, default=None, help=argparse.SUPPRESS)  # old name
    p.add_argument("--warmup", type=int, default=None, help=argparse.SUPPRESS)  # (unused)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.iters is not None:
        args.rounds = args.iters
    for name in ("num_examples", "small_examples", "batch_size", "rounds", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    res = run(args, device)
    rows = res["rows"]
    name = str(device) if device.type == "cpu" else torch.cuda.get_device_name()
    print(f"device={name}, params={res['params']:,}, batch={args.batch_size}, "
          f"rounds={args.rounds} x {args.steps} steps, torch threads={torch.get_num_threads()}, "
          f"triad {res['triad_gbs']:.1f} GB/s")
    print("| variant | examples | median ms [min–max] | vs guarded: median [min–max] | "
          "MB/step | GB/s | of triad |")
    print("|---|---|---|---|---|---|---|")
    for v, r in rows.items():
        n = f"{r['num_examples']:,}" if r["num_examples"] else "-"
        print(f"| {v} | {n} | {r['median_ms']:.2f} [{r['min_ms']:.2f}–{r['max_ms']:.2f}] | "
              f"{r['overhead_pct']:+.1f} % [{r['overhead_min']:+.1f}–{r['overhead_max']:+.1f}] | "
              f"{r['bytes_per_step'] / 1e6:.1f} | {r['gbs']:.1f} | {r['frac_triad']:.0%} |")
    settings = {k: v for k, v in vars(args).items() if k not in ("iters", "warmup", "device")}
    out = {"device": name, **settings,
           "params": res["params"], "triad_gbs": res["triad_gbs"], "rows": rows,
           # the keys benchmarks/gpu_acceptance.py reads (overheads against the guarded step)
           "median_step_s": {"plain": rows["guarded"]["median_ms"] / 1e3,
                             **{v: r["median_ms"] / 1e3 for v, r in rows.items()}},
           "overhead_pct": {v: r["overhead_pct"] for v, r in rows.items()
                            if v not in ("stock", "guarded")},
           "step_ratio_n_large_vs_small": rows["tracker"]["median_ms"]
           / rows["tracker-small"]["median_ms"]}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
