"""Step time, memory and memory bandwidth of CorrelatedNoiseDPOptimizer vs stock Opacus.

Times a full forward/backward/clip/noise step on an MLP of ``--params`` parameters (default 10M
on CUDA, 2M on CPU) for b ∈ {1, 8, 64} against stock Opacus (interleaved rounds: one step of
each variant per round; median, min–max, and the ratio to the same round's stock step),
``optimizer.add_noise()`` alone, and (issue 32) the
**bandwidth** of ``add_noise()``: for each b of ``--bw-bands`` the repetitions of

* a STREAM-like triad ``a = b + s·c`` and a copy ``a = b`` (same dtype, arrays sized so that
  the triad moves as many bytes as the BandMF step: out of cache),
* stock Opacus ``DPOptimizer.add_noise()``,
* the former per-parameter BandMF (``benchmarks/_bandmf_reference.py``),
* the contiguous-ring BandMF (default, bit-identical) and its ``single_gemv`` variant

are interleaved (one call of each per round), and each row reports the median time with its
spread (min–max over the rounds), the bytes a step must move (model below), the achieved GB/s
and its fraction of the triad's GB/s of the same round (median and min–max over rounds).

Bytes per step, in elements of ``d`` (parameters) × dtype size: Opacus' ``_generate_noise``
writes a zero tensor and the draw (2), ``p.grad = S + w`` reads two and writes one (3): stock
5. Ring BandMF adds the ring read ``(b − 1)``, the reduction's output ``t`` (1) and
``torch.sub(z, t, out=slot)`` (3): ``b + 8``; the per-parameter one ``z − t`` (3) and the copy
into the slot (2): ``b + 10``. ``c_0 ≠ 1`` adds a division (2) to both. Usage::

    python benchmarks/correlated_noise.py [--params N] [--bands 1 8 64] [--repeats 20]
    python benchmarks/correlated_noise.py --bandwidth-only [--bw-bands 64] [--bw-repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer
from torch import nn

from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine
from opacus_structured.optim.strategies import banded_sqrt_coefficients
from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bandmf_reference import PerParameterBandMF  # noqa: E402

warnings.filterwarnings("ignore")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _mlp(num_params: int, width: int = 1024) -> nn.Module:
    depth = max(1, round(num_params / (width * width + width)))
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _forever(loader):
    """Batches of ``loader``, epoch after epoch (every step gets a freshly drawn batch)."""
    while True:
        yield from loader


def _full_step_setup(num_params, bands, device, batch=64):
    """``(step, num_params, state_bytes)``: one forward/backward/clip/noise step of an MLP with
    stock Opacus (``bands=None``) or BandMF with ``bands`` bands, on freshly drawn batches."""
    torch.manual_seed(0)
    model = _mlp(num_params).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # |D| = batch * bands: cyclic Poisson at rate 1 within each group, so every step has exactly
    # `batch` rows, as the stock run's fixed-size batches (a fair per-step comparison)
    rows = batch * (bands or 4)
    x = torch.randn(rows, 1024)
    y = torch.randint(0, 10, (rows,))
    ds = torch.utils.data.TensorDataset(x, y)
    kw = {} if bands is None else {"noise_correlation": banded_sqrt_coefficients(bands)}
    # the engine refuses correlated noise under an accountant that does not price it, and the
    # accountant refuses a loader that does not draw with its scheme's sampler
    if bands is None:
        engine, loader = PrivacyEngine(), torch.utils.data.DataLoader(ds, batch_size=batch)
    else:
        scheme = BandMFCyclicPoissonScheme(dataset_size=rows, batch_size=batch, bands=bands)
        engine = CorrelatedNoisePrivacyEngine(scheme=scheme)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=scheme.sampler(seed=0))
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False, **kw)
    batches = _forever(loader)

    def draw():  # outside the timed region
        return tuple(t.to(device) for t in next(batches))

    def step(batch_xy):
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch_xy[0]), batch_xy[1]).backward()
        opt.step()

    def state_bytes():
        return sum(b.numel() * b.element_size() for b in getattr(opt, "_noise_buffers", [])
                   if b is not None)

    return step, draw, n_params, state_bytes


def bench_full_steps(num_params, bands_list, device, repeats, batch=64):
    """Full steps of stock and BandMF(b) for b in ``bands_list``, **interleaved**: each round
    times one step of every variant (in a shuffled order). Returns rows with the median time,
    its min–max spread and the ratio to the same round's stock step (median, min–max), and the
    step's transient CUDA peak (measured alone after the timing; NaN on CPU)."""
    variants = [None, *bands_list]
    built = {b: _full_step_setup(num_params, b, device, batch) for b in variants}
    for b in variants:  # warm-up: allocations, the ring's first steps
        for _ in range(3):
            built[b][0](built[b][1]())
    times = {b: [] for b in variants}
    order = list(variants)
    shuffle = random.Random(0)
    for _ in range(repeats):
        shuffle.shuffle(order)
        for b in order:
            step, draw = built[b][0], built[b][1]
            xy = draw()
            _sync(device)
            t = time.perf_counter()
            step(xy)
            _sync(device)
            times[b].append(time.perf_counter() - t)
    rows = []
    for b in variants:
        step, draw, n_params, state_bytes = built[b]
        peak = float("nan")
        if device.type == "cuda":
            xy = draw()
            _sync(device)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(xy)
            _sync(device)
            peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        ratios = [t / s for t, s in zip(times[b], times[None], strict=True)]
        rows.append(dict(kind="full_step", bands=b, params=n_params,
                         ms=statistics.median(times[b]) * 1e3, ms_min=min(times[b]) * 1e3,
                         ms_max=max(times[b]) * 1e3, ratio=statistics.median(ratios),
                         ratio_min=min(ratios), ratio_max=max(ratios), peak_mib=peak,
                         state_mib=state_bytes() / 2**20, repeats=repeats))
    return rows


def bench_noise_only(num_params, bands, device, repeats):
    """Median time of ``add_noise()`` alone (clipped sums preset), and noise-state bytes."""
    params = [nn.Parameter(torch.zeros(num_params // 4, device=device)) for _ in range(4)]
    sgd = torch.optim.SGD(params, lr=0.01)
    if bands is None:
        opt = DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=1)
    else:
        opt = CorrelatedNoiseDPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0,
                                         expected_batch_size=1,
                                         noise_correlation=banded_sqrt_coefficients(bands))
    times = []
    for i in range(repeats + 3):
        for p in params:
            p.summed_grad = torch.zeros_like(p)
        _sync(device)
        t = time.perf_counter()
        opt.add_noise()
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    times.sort()
    state = sum(b.numel() * b.element_size() for b in getattr(opt, "_noise_buffers", [])
                if b is not None)
    return times[len(times) // 2], state / 2**20


def _noise_elements(variant: str, bands: int, c0: float) -> int:
    """Elements of ``d`` that one ``add_noise()`` must read or write (module docstring)."""
    if variant == "stock":
        return 5
    div = 0 if c0 == 1.0 else 2
    if variant == "per_parameter":
        return bands + 10 + div
    return bands + 8 + div  # ring, single_gemv


def _noise_setup(variant, num_params, bands, device, dtype, pieces=4):
    params = [nn.Parameter(torch.zeros(num_params // pieces, device=device, dtype=dtype))
              for _ in range(pieces)]
    sgd = torch.optim.SGD(params, lr=0.01)
    common = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=1,
                  generator=torch.Generator(device=device).manual_seed(0))
    coefs = banded_sqrt_coefficients(bands)
    if variant == "stock":
        opt = DPOptimizer(sgd, **common)
    elif variant == "per_parameter":
        opt = PerParameterBandMF(sgd, noise_correlation=coefs, **common)
    else:
        opt = CorrelatedNoiseDPOptimizer(sgd, noise_correlation=coefs,
                                         single_gemv=variant == "single_gemv", **common)
    sums = [torch.zeros_like(p) for p in params]

    def step():
        for p, s in zip(params, sums, strict=True):
            s.__dict__.pop("_processed", None)  # Opacus' processed flag: reuse the tensor
            p.summed_grad = s
        opt.add_noise()
    return step, float(coefs[0])


def bench_bandwidth(num_params, bands, device, repeats, dtype=torch.float32):
    """Interleaved rounds of triad, copy, stock, per-parameter and ring BandMF ``add_noise``."""
    size = torch.tensor([], dtype=dtype).element_size()
    d = num_params // 4 * 4
    variants = ["stock", "per_parameter", "ring", "single_gemv"]
    steps, elements = {}, {}
    for v in variants:
        steps[v], c0 = _noise_setup(v, d, bands, device, dtype)
        elements[v] = _noise_elements(v, bands, c0) * d
    n = max(d, elements["ring"] // 3)  # triad moves ≈ as many bytes as the BandMF step
    a, b, c = (torch.rand(n, device=device, dtype=dtype) for _ in range(3))
    elements["triad"], elements["copy"] = 3 * n, 2 * n
    steps["triad"] = lambda: torch.add(b, c, alpha=3.0, out=a)
    steps["copy"] = lambda: a.copy_(b)
    order = ["triad", "copy", *variants]
    for name in order:  # warm-up: allocations, the ring's first (reduction-free) step
        for _ in range(2):
            steps[name]()
    times = {name: [] for name in order}
    for _ in range(repeats):
        for name in order:
            _sync(device)
            t = time.perf_counter()
            steps[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t)
    rows = []
    triad_gbs = [elements["triad"] * size / t / 1e9 for t in times["triad"]]
    for name in order:
        ts = times[name]
        gbs = [elements[name] * size / t / 1e9 for t in ts]
        frac = [g / tg for g, tg in zip(gbs, triad_gbs, strict=True)]
        rows.append(dict(kind="bandwidth", variant=name, bands=None if name in (
            "triad", "copy", "stock") else bands, params=d, dtype=str(dtype).split(".")[-1],
            bytes_per_step=elements[name] * size, ms=statistics.median(ts) * 1e3,
            ms_min=min(ts) * 1e3, ms_max=max(ts) * 1e3, gbs=statistics.median(gbs),
            frac_triad=statistics.median(frac), frac_min=min(frac), frac_max=max(frac),
            repeats=repeats))
    return rows


def print_bandwidth(rows):
    print("| variant | b | MB/step | median ms [min–max] | GB/s | of triad: median [min–max] |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['bands'] or '-'} | {r['bytes_per_step'] / 1e6:.1f} | "
              f"{r['ms']:.2f} [{r['ms_min']:.2f}–{r['ms_max']:.2f}] | {r['gbs']:.1f} | "
              f"{r['frac_triad']:.0%} [{r['frac_min']:.0%}–{r['frac_max']:.0%}] |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=None)
    ap.add_argument("--bands", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    ap.add_argument("--bw-bands", type=int, nargs="+", default=[64],
                    help="bands of the interleaved add_noise() bandwidth section")
    ap.add_argument("--bw-repeats", type=int, default=None,
                    help="rounds of the bandwidth section (default: --repeats, at least 5)")
    ap.add_argument("--bandwidth-only", action="store_true",
                    help="only the interleaved add_noise() bandwidth section")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 on a shared machine: an OpenMP region waits "
                         "for its slowest thread, and a descheduled one stalls it by a "
                         "scheduler time slice)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be ≥ 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows = []
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    num_params = args.params or (10_000_000 if device.type == "cuda" else 2_000_000)
    print(f"device={device}, target params={num_params:,}, torch threads="
          f"{torch.get_num_threads()}")
    print("\nadd_noise() memory bandwidth (interleaved rounds; fraction of the same round's "
          "STREAM-like triad):")
    for b in args.bw_bands:
        bw_rows = bench_bandwidth(num_params, b, device, max(5, args.bw_repeats or args.repeats))
        print_bandwidth(bw_rows)
        rows += bw_rows
    if args.bandwidth_only:
        _write(args.json, device, rows)
        return
    print("\nfull step (fwd+bwd+clip+noise), interleaved rounds; ratio to the same round's "
          "stock step:")
    print("| optimizer | params | median step ms [min–max] | × stock: median [min–max] | "
          "noise state MiB | step peak GPU MiB |")
    print("|---|---|---|---|---|---|")
    for r in bench_full_steps(num_params, args.bands, device, max(5, args.repeats)):
        name = "stock DPOptimizer" if r["bands"] is None else f"BandMF b={r['bands']}"
        print(f"| {name} | {r['params']:,} | {r['ms']:.2f} [{r['ms_min']:.2f}–{r['ms_max']:.2f}] "
              f"| {r['ratio']:.3f} [{r['ratio_min']:.3f}–{r['ratio_max']:.3f}] | "
              f"{r['state_mib']:.0f} | {r['peak_mib']:.0f} |")
        rows.append(r)
    print("\nadd_noise() alone:")
    print("| optimizer | params | median add_noise (ms) | × stock | noise state MiB |")
    print("|---|---|---|---|---|")
    stock, _ = bench_noise_only(num_params, None, device, args.repeats)
    print(f"| stock DPOptimizer | {num_params:,} | {stock * 1e3:.2f} | 1.00 | 0 |")
    rows.append(dict(kind="add_noise", bands=None, params=num_params, ms=stock * 1e3,
                     ratio=1.0, state_mib=0))
    for b in args.bands:
        t, state = bench_noise_only(num_params, b, device, args.repeats)
        print(f"| BandMF b={b} | {num_params:,} | {t * 1e3:.2f} | {t / stock:.2f} | {state:.0f} |")
        rows.append(dict(kind="add_noise", bands=b, params=num_params, ms=t * 1e3,
                         ratio=t / stock, state_mib=state))
    _write(args.json, device, rows)


def _write(path, device, rows):
    if path:
        with open(path, "w") as fh:
            json.dump({"device": str(device), "rows": rows}, fh, indent=1, default=float)


if __name__ == "__main__":
    main()
