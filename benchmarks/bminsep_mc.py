"""Samples/s of the b-min-sep Monte Carlo sampler vs a faithful numpy port of the reference.

The reference (jax_privacy ``experimental/monte_carlo/sample_generation.py``, without numba)
draws one sample at a time: a Python ``while`` loop over the Bernoulli draws for ``x``, ``C x``
by convolution, the window dot products by ``scipy.signal.convolve`` and the dynamic program
as a Python loop of scalar ``np.logaddexp`` (with the *correct* boundary norms). Ours
(:func:`opacus_structured.accounting.bminsep_mc.sample_privacy_losses`) vectorises over
samples: geometric gaps for ``x``, banded products, and the recursion over an ``(b, S)``
circular buffer. Both run on the same CPU, single process; the torch backend
(:mod:`opacus_structured.runners.bminsep_mc_torch`) is timed on the CPU and on CUDA when
available. ``--variant`` times our truncated + padded (``--truncate``) or multi-attribution
(``--max-user-examples``) sampler as well (the reference speed is always the plain warm-start
loop, so the speedup is only comparable for the default variant).

    python benchmarks/bminsep_mc.py [--n 1024] [--bands 4] [--samples 20000] \
        [--variant plain|truncated|multi] [--json [PATH]]

``--json`` prints the record as one JSON line instead of the text table; ``--json PATH`` also
writes it to ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
from scipy import signal, special

from opacus_structured.accounting.bminsep_mc import (
    BandedStrategy,
    BandMFMonteCarlo,
    sample_privacy_losses,
)
from opacus_structured.runners.monte_carlo import sample_losses


def reference_sample_loss(c, n, b, p, sigma, warm, rng):
    """One remove-direction privacy-loss sample, the reference's per-sample loop in numpy."""
    pre = rng.binomial(1, p, size=n)
    x = np.zeros(n)
    if warm:
        i = rng.choice(range(b), p=[1 / (1 + (b - 1) * p)] + [p / (1 + (b - 1) * p)] * (b - 1))
    else:
        i = 0
    while i < n:
        if pre[i] == 1:
            x[i] = 1.0
            i += b
        else:
            i += 1
    mode = signal.convolve(c, x)[:n]  # banded Toeplitz C x (truncated last columns)
    y = rng.normal(loc=mode, scale=sigma)
    dots = signal.convolve(c[::-1], y)[c.size - 1:]
    sq = np.ones(n) * np.sum(c**2)
    for k in range(1, c.size):
        sq[-k] = np.sum(c[:k] ** 2)  # correct order (see the regression test)
    llr = (2 * dots - sq) / (2 * sigma**2)
    suffix = np.zeros(n)
    suffix[-1] = np.logaddexp(np.log1p(-p), np.log(p) + llr[-1])
    for i in range(n - 2, n - b - 1, -1):
        suffix[i] = np.logaddexp(np.log1p(-p) + suffix[i + 1], np.log(p) + llr[i])
    for i in range(n - b - 1, -1, -1):
        suffix[i] = np.logaddexp(np.log1p(-p) + suffix[i + 1],
                                 np.log(p) + llr[i] + suffix[i + b])
    if warm:
        terms = np.concatenate([[suffix[0]], np.log(p) + suffix[1:b]])
        return special.logsumexp(terms) - np.log1p((b - 1) * p)
    return suffix[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--bands", type=int, default=4)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--reference-samples", type=int, default=300)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--variant", choices=("plain", "truncated", "multi"), default="plain")
    ap.add_argument("--torch-cpu-samples", type=int, default=20000)
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="print the record as JSON; with PATH, also write it to that file")
    args = ap.parse_args(argv)
    n, b = args.n, args.bands
    c = np.cumprod([1.0] + [(2 * j - 1) / (2 * j) for j in range(1, b)])
    c /= np.linalg.norm(c)
    p0 = 1 / 128
    p = p0 / (1 - (b - 1) * p0)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    ref = [reference_sample_loss(c, n, b, p, args.sigma, True, rng)
           for _ in range(args.reference_samples)]
    ref_rate = args.reference_samples / (time.perf_counter() - t)
    st = BandedStrategy.toeplitz(c, n)
    if args.variant == "plain":
        mech = BandMFMonteCarlo(st, args.sigma, "bminsep", p, b, warm_start=True)
    elif args.variant == "truncated":  # |D| = 128 * 64 examples, B_max = 1.1 * expected batch
        mech = BandMFMonteCarlo(st, args.sigma, "bminsep", p, b, warm_start=True,
                                truncated_batch_size=71, dataset_size=128 * 64)
    else:
        mech = BandMFMonteCarlo(st, args.sigma, "bminsep", p, b, max_user_examples=2)
    t = time.perf_counter()
    ours = sample_privacy_losses(mech, args.samples, "remove", seed=0)
    our_rate = args.samples / (time.perf_counter() - t)
    record = {"n": n, "bands": b, "variant": args.variant, "reference_samples_per_s": ref_rate,
              "numpy_samples_per_s": our_rate}
    if args.variant == "plain":  # same mechanism: speedup and a sanity check of the mean loss
        record.update({"speedup": our_rate / ref_rate, "mean_loss_reference": float(np.mean(ref)),
                       "mean_loss_ours": float(np.mean(ours)),
                       "mean_loss_se": float(np.std(ours) / math.sqrt(len(ours))
                                             + np.std(ref) / math.sqrt(len(ref)))})
    else:  # a different (costlier) mechanism than the reference loop prices
        record["rate_vs_plain_reference"] = our_rate / ref_rate
    try:
        import torch

        torch.set_num_threads(1)  # same single CPU core as numpy and the reference
        t = time.perf_counter()
        sample_losses(mech, args.torch_cpu_samples, "remove", seed=1, device="cpu")
        record["torch_cpu_samples_per_s"] = args.torch_cpu_samples / (time.perf_counter() - t)
        if torch.cuda.is_available():
            sample_losses(mech, 1000, "remove", seed=1, device="cuda")  # warm-up
            torch.cuda.synchronize()
            S = max(args.samples, 200_000)
            t = time.perf_counter()
            sample_losses(mech, S, "remove", seed=1, device="cuda", chunk_size=S)
            torch.cuda.synchronize()
            record["cuda_samples_per_s"] = S / (time.perf_counter() - t)
            record["cuda_device"] = torch.cuda.get_device_name()
    except ImportError:  # pragma: no cover
        pass
    if args.json:
        print(json.dumps(record, sort_keys=True))
        if args.json != "-":
            with open(args.json, "w") as fh:
                json.dump(record, fh, sort_keys=True, indent=1)
    else:
        for k, v in record.items():
            print(f"{k:>28}: {v:.6g}" if isinstance(v, float) else f"{k:>28}: {v}")


if __name__ == "__main__":
    main()
