"""Step time and memory of CorrelatedNoiseDPOptimizer vs stock Opacus DPOptimizer.

Times ``optimizer.add_noise()`` + ``step()`` (the part correlated noise changes) on a model of
``--params`` parameters (default 10M on CUDA, 1M on CPU) for b ∈ {1, 8, 64}, and a full
forward/backward/clip/noise step on an MLP. Usage::

    python benchmarks/correlated_noise.py [--params N] [--bands 1 8 64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
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


def bench_full_step(num_params, bands, device, repeats, batch=64):
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
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(repeats + 3):
        xb, yb = (t.to(device) for t in next(batches))  # drawn outside the timed region
        _sync(device)
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    times.sort()
    mem = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return n_params, times[len(times) // 2], mem


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=None)
    ap.add_argument("--bands", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_params = args.params or (10_000_000 if device.type == "cuda" else 2_000_000)
    print(f"device={device}, target params={num_params:,}")
    print("| optimizer | params | median step (ms) | × stock | peak GPU MiB |")
    print("|---|---|---|---|---|")
    n, stock, mem = bench_full_step(num_params, None, device, args.repeats)
    print(f"| stock DPOptimizer | {n:,} | {stock * 1e3:.2f} | 1.00 | {mem:.0f} |")
    rows.append(dict(kind="full_step", bands=None, params=n, ms=stock * 1e3, ratio=1.0,
                     peak_mib=mem))
    for b in args.bands:
        n, t, mem = bench_full_step(num_params, b, device, args.repeats)
        print(f"| BandMF b={b} | {n:,} | {t * 1e3:.2f} | {t / stock:.2f} | {mem:.0f} |")
        rows.append(dict(kind="full_step", bands=b, params=n, ms=t * 1e3, ratio=t / stock,
                         peak_mib=mem))
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
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": str(device), "rows": rows}, fh, indent=1, default=float)


if __name__ == "__main__":
    main()
