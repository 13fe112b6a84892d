"""Samples/s of the b-min-sep Monte Carlo sampler beside jax_privacy's, in one process.

The reference is jax_privacy's own ``experimental/monte_carlo/sample_generation.py`` as its
users run it: ``generate_sample`` + ``compute_privacy_loss`` (``BMinSepSampling``, warm start,
``sampling_prob = p0/(1 − (b−1)p0)``, ``p0 = 1/128``, ``σ = 1``, the BandMF square-root Toeplitz
coefficients normalised to unit norm), imported from the installed ``jax-privacy`` wheel
(``pip install "opacus-structured[peers]"``) or, with ``--reference-path DIR``, from a source
checkout (``DIR`` holds the ``jax_privacy`` package). Ours is
:func:`opacus_structured.runners.monte_carlo.sample_losses` (the numpy backend the shard runner
uses; with numba installed it runs the fused kernel of
:mod:`opacus_structured.accounting.bminsep_fused`, and the table adds the rate of the numpy
program without numba). All run single-threaded (BLAS and torch limited to one thread; the
table's JSON records jax_privacy's CPU time per wall second, ≈ 1 when it runs on one core),
interleaved, ``--reps`` times per row; the table gives the median samples/s of each and the
ratios.

Agreement per row: the mean privacy loss of each sampler (± its standard error) and a two-sample
Kolmogorov–Smirnov test on the pooled remove-direction losses. jax_privacy assigns the squared
norms of the last ``b − 1`` (truncated) columns of ``C`` in reverse order (the column-order bug
pinned by ``test_last_columns_norm_order_regression``): rows with ``b ≥ 3`` say so, since a
difference there is the reference's, not ours (at these ``n`` it is too small for the test to
see).

    python benchmarks/bminsep_mc.py --reference jax_privacy [--reference-path DIR] [--quick]
        [--bands 1 4 16 64] [--n 1000 10000] [--reps 3] [--workers W] [--json PATH]
        [--paper-settings] [--device cuda]

``--device cuda`` adds, per row, our torch backend on the GPU
(:func:`~opacus_structured.runners.bminsep_mc_torch.sample_losses_torch`, float64, chunks of
65,536 samples) and jax_privacy's same two functions on the GPU where jax has one (its users'
GPU run); the CPU columns always run jax_privacy on jax's CPU device.

``--workers W`` (W > 1) adds the steady-state throughput of our sharded runner
(:func:`~opacus_structured.runners.monte_carlo.collect_privacy_losses`) on a warm pool of ``W``
processes (what a long run sees; process start-up and the kernels' first load excluded).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import math
import sys
import time
import typing

import numpy as np
from scipy import stats

from opacus_structured.accounting.bminsep_mc import (
    BandedStrategy,
    BandMFMonteCarlo,
    _numba_kernels,
    streamed_bminsep_losses,
)
from opacus_structured.accounting.calibration import smallest_passing_int
from opacus_structured.accounting.monte_carlo import delta_upper_confidence, minimum_samples
from opacus_structured.runners.monte_carlo import collect_privacy_losses, sample_losses

P0 = 1 / 128


def load_jax_privacy(path: typing.Optional[str] = None):
    """``(batch_selection, sample_generation)`` of jax_privacy: the installed wheel, or the
    source checkout at ``path`` (put first on ``sys.path``)."""
    if path is not None:
        sys.path.insert(0, path)
    try:
        import optax

        # jax-privacy 2.0.0 annotates with optax.ArrayTree, which newer optax releases dropped.
        optax.ArrayTree = getattr(optax, "ArrayTree", typing.Any)
        batch_selection = importlib.import_module("jax_privacy.batch_selection")
        sample_generation = importlib.import_module(
            "jax_privacy.experimental.monte_carlo.sample_generation")
    except ModuleNotFoundError as exc:
        raise SystemExit(f"error: --reference jax_privacy needs jax-privacy==2.0.0 and jax "
                         f"(pip install \"opacus-structured[peers]\"): {exc}") from None
    return batch_selection, sample_generation


def jax_device(kind: str):
    """jax's first device of ``kind`` ("cpu" / "gpu"), or ``None`` when jax has none."""
    import jax

    try:
        return jax.devices(kind)[0]
    except RuntimeError:
        return None


def time_reference(sg, strategy, sigma: float, c, samples: int, seed: int, device):
    """``(losses, samples/s, CPU seconds per wall second)`` of jax_privacy's
    ``generate_sample`` + ``compute_privacy_loss`` on jax ``device``."""
    import jax

    with jax.default_device(device):
        t, cpu = time.perf_counter(), time.process_time()
        y = sg.generate_sample(strategy, sigma, c, seed=seed, positive_sample=True,
                               num_samples=samples)
        loss = np.asarray(sg.compute_privacy_loss(strategy, y, sigma, c))
        wall = time.perf_counter() - t
    return loss, samples / wall, (time.process_time() - cpu) / wall


def coefficients(b: int) -> np.ndarray:
    """BandMF's banded square-root Toeplitz coefficients, ``b`` bands, unit norm."""
    c = np.cumprod([1.0] + [(2 * j - 1) / (2 * j) for j in range(1, b)])
    return c / np.linalg.norm(c)


def single_thread() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        import threadpoolctl

        threadpoolctl.threadpool_limits(1)
    except ImportError:  # pragma: no cover - BLAS may then use more than one core
        pass


def bench_row(b: int, n: int, sigma: float, reps: int, ref_elements: int, our_elements: int,
              workers: int, bs, sg, cuda_elements: int = 0) -> dict:
    c = coefficients(b)
    p = P0 / (1 - (b - 1) * P0)
    strategy = bs.BMinSepSampling(sampling_prob=p, iterations=n, min_sep=b, warm_start=True)
    mech = BandMFMonteCarlo(BandedStrategy.toeplitz(c, n), sigma, "bminsep", p, b,
                            warm_start=True)
    s_ref = max(100, ref_elements // n)
    s_our = max(256, our_elements // n)
    ref_rates, our_rates, ref_losses, our_losses, np_rates = [], [], [], [], []
    numba = _numba_kernels() is not None
    ref_cpu = []
    if numba:  # compile (or load) the kernels outside the timings
        sample_losses(mech, 256, "remove", seed=0)
    cpu_device = jax_device("cpu")
    for rep in range(reps):
        loss, rate, cpu = time_reference(sg, strategy, sigma, c, s_ref, 1000 + rep, cpu_device)
        ref_rates.append(rate)
        ref_cpu.append(cpu)
        ref_losses.append(loss)
        t = time.perf_counter()
        ours = sample_losses(mech, s_our, "remove", seed=2000 + rep)
        our_rates.append(s_our / (time.perf_counter() - t))
        our_losses.append(ours)
        if numba:  # the numpy program (stream "numpy"), without any numba kernel
            t = time.perf_counter()
            streamed_bminsep_losses(mech, s_our, "remove", np.random.default_rng(rep),
                                    accelerator="numpy")
            np_rates.append(s_our / (time.perf_counter() - t))
    ref_all, our_all = np.concatenate(ref_losses), np.concatenate(our_losses)
    ks = stats.ks_2samp(ref_all, our_all)
    row = {"b": b, "n": n, "jax_privacy_samples_per_s": float(np.median(ref_rates)),
           "ours_samples_per_s": float(np.median(our_rates)),
           "ratio": float(np.median(our_rates) / np.median(ref_rates)),
           "mean_loss_jax_privacy": float(ref_all.mean()),
           "mean_loss_ours": float(our_all.mean()),
           "mean_loss_se": float(math.hypot(ref_all.std() / math.sqrt(ref_all.size),
                                            our_all.std() / math.sqrt(our_all.size))),
           "ks_statistic": float(ks.statistic), "ks_pvalue": float(ks.pvalue),
           "samples_compared": [int(ref_all.size), int(our_all.size)],
           "note": ("jax_privacy's last b-1 column norms are in reverse order (its bug)"
                    if b >= 3 else ""),
           "ours_accelerator": "fused" if numba else "numpy",
           "jax_privacy_cpu_per_wall": float(np.median(ref_cpu))}
    if numba:
        row["ours_numpy_only_samples_per_s"] = float(np.median(np_rates))
    if cuda_elements:
        row.update(cuda_row(mech, strategy, sigma, c, n, reps, cuda_elements, sg))
    if workers > 1:
        # Steady-state throughput of a long run: a warm pool (processes started and the
        # kernels loaded by a first small run), then shards of ≈ 2 s each.
        S = s_our * workers * 4
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
            collect_privacy_losses(mech, 64 * workers, seed=6, shard_size=16, executor=pool)
            t = time.perf_counter()
            collect_privacy_losses(mech, S, seed=7, shard_size=-(-S // (2 * workers)),
                                   executor=pool)
            rate = 2 * S / (time.perf_counter() - t)
        row[f"ours_{workers}_workers_samples_per_s"] = rate
        row["workers_ratio"] = rate / row["jax_privacy_samples_per_s"]
    return row


def cuda_row(mech, strategy, sigma, c, n: int, reps: int, elements: int, sg) -> dict:
    """Our torch backend on CUDA and, where jax has a GPU, jax_privacy on it: median
    samples/s over ``reps`` timings of ``elements // n`` samples (after one warm-up each)."""
    import torch

    from opacus_structured.runners.bminsep_mc_torch import sample_losses_torch

    S = max(1024, elements // n)
    sample_losses_torch(mech, 1024, "remove", seed=0, device="cuda")  # warm-up
    rates = []
    for rep in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        sample_losses_torch(mech, S, "remove", seed=3000 + rep, device="cuda")
        rates.append(S / (time.perf_counter() - t))  # .numpy() at the end synchronises
    out = {"cuda_samples_per_s": float(np.median(rates)), "cuda_samples": S,
           "cuda_device": torch.cuda.get_device_name(0)}
    gpu = jax_device("gpu")
    if gpu is not None:
        time_reference(sg, strategy, sigma, c, 256, 7, gpu)  # compile outside the timings
        ref = [time_reference(sg, strategy, sigma, c, S, 4000 + rep, gpu)[1]
               for rep in range(reps)]
        out["jax_privacy_gpu_samples_per_s"] = float(np.median(ref))
        out["cuda_ratio"] = out["cuda_samples_per_s"] / out["jax_privacy_gpu_samples_per_s"]
    return out


#: The paper's b-min-sep settings (Dong & Ganesh §7.1 and the §7.4 production run):
#: (name, n, b, p0, σ).
PAPER_SETTINGS = (("§7.1", 1024, 4, 1 / 128, 1.0),
                  ("§7.4 production", 7200, 256, 1793 / 14_745_600, 0.47))


def kl_certificate_samples(target_delta: float, failure_probability: float) -> int:
    """Samples per direction for the KL bound to certify ``δ(ε) ≤ δ_t`` when the true δ is
    ``δ_t/2`` (both directions at ``β/2``): the smallest ``s`` with
    ``UCB(δ_t/2, s, β/2) ≤ δ_t``."""
    ok = lambda s: delta_upper_confidence(target_delta / 2, s, failure_probability / 2) \
        <= target_delta  # noqa: E731
    hi = 2
    while not ok(hi):
        hi *= 2
    return smallest_passing_int(ok, hi // 2, hi)


def paper_settings_rows(reps: int, seconds: float, target_delta: float = 1e-6,
                        failure_probability: float = 1e-3) -> list[dict]:
    """One-core samples/s of ours at the paper's settings (warm start, BandMF square-root
    coefficients with b bands) and the time to a certificate at ``δ_t``, β."""
    alg5 = minimum_samples(target_delta / 2, target_delta)
    kl = kl_certificate_samples(target_delta, failure_probability)
    rows = []
    for name, n, b, p0, sigma in PAPER_SETTINGS:
        p = p0 / (1 - (b - 1) * p0)
        mech = BandMFMonteCarlo(BandedStrategy.toeplitz(coefficients(b), n), sigma, "bminsep",
                                p, b, warm_start=True)
        sample_losses(mech, 128, "remove", seed=0)  # kernels loaded
        t = time.perf_counter()
        sample_losses(mech, 256, "remove", seed=1)
        size = max(256, int(256 * seconds / max(time.perf_counter() - t, 1e-9)))
        rates = []
        for rep in range(reps):
            t = time.perf_counter()
            sample_losses(mech, size, "remove", seed=10 + rep)
            rates.append(size / (time.perf_counter() - t))
        rate = float(np.median(rates))
        rows.append({"setting": name, "n": n, "b": b, "p0": p0, "sigma": sigma,
                     "ours_samples_per_s": rate,
                     "algorithm5_samples_per_direction": alg5,
                     "algorithm5_hours_per_candidate": 2 * alg5 / rate / 3600,
                     "kl_samples_per_direction": kl, "kl_hours": 2 * kl / rate / 3600})
    return rows


def format_table(rows: list[dict]) -> str:
    workers_key = next((k for k in rows[0] if k.endswith("_workers_samples_per_s")), None)
    numpy_only = "ours_numpy_only_samples_per_s" in rows[0]
    head = ["b", "n", "jax_privacy /s", f"ours ({rows[0]['ours_accelerator']}) /s", "ratio"]
    if numpy_only:
        head += ["ours numpy only /s", "ratio"]
    if workers_key:
        head.append(workers_key.replace("ours_", "ours ").replace("_samples_per_s", " /s")
                    .replace("_workers", " workers"))
    cuda = "cuda_samples_per_s" in rows[0]
    if cuda:
        head += ["ours CUDA /s", "jax_privacy GPU /s", "CUDA ratio"]
    head += ["mean loss jax_privacy", "mean loss ours", "KS p", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["b"]), str(r["n"]), f"{r['jax_privacy_samples_per_s']:,.0f}",
                 f"{r['ours_samples_per_s']:,.0f}", f"{r['ratio']:.1f}×"]
        if numpy_only:
            v = r["ours_numpy_only_samples_per_s"]
            cells += [f"{v:,.0f}", f"{v / r['jax_privacy_samples_per_s']:.1f}×"]
        if workers_key:
            cells.append(f"{r[workers_key]:,.0f} ({r['workers_ratio']:.1f}×)")
        if cuda:
            gpu = r.get("jax_privacy_gpu_samples_per_s")
            cells += [f"{r['cuda_samples_per_s']:,.0f}",
                      "-" if gpu is None else f"{gpu:,.0f}",
                      "-" if gpu is None else f"{r['cuda_ratio']:.1f}×"]
        cells += [f"{r['mean_loss_jax_privacy']:.4f}",
                  f"{r['mean_loss_ours']:.4f} (±{r['mean_loss_se']:.4f})",
                  f"{r['ks_pvalue']:.2f}", r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", choices=("jax_privacy",), default="jax_privacy",
                    help="the peer sampler (jax_privacy's, from the installed wheel)")
    ap.add_argument("--reference-path", default=None, metavar="DIR",
                    help="import jax_privacy from this source checkout instead of the wheel")
    ap.add_argument("--bands", type=int, nargs="+", default=[1, 4, 16, 64], metavar="B",
                    help="b = number of bands of C (min separation)")
    ap.add_argument("--n", type=int, nargs="+", default=[1000, 10000], help="iterations")
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per row")
    ap.add_argument("--ref-elements", type=int, default=4_000_000,
                    help="samples × n per reference timing")
    ap.add_argument("--our-elements", type=int, default=8_000_000,
                    help="samples × n per timing of ours")
    ap.add_argument("--workers", type=int, default=1,
                    help="also time our sharded runner with this many processes (> 1)")
    ap.add_argument("--quick", action="store_true",
                    help="b in {4, 64}, n = 1000, 2 repetitions, fewer samples")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--paper-settings", action="store_true",
                    help="also time ours (one core) at the paper's §7.1 and §7.4 settings and "
                         "print the hours to a certificate at δ = 1e-6, β = 1e-3")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: also time our torch backend on the GPU (and jax_privacy on "
                         "jax's GPU, where it has one)")
    ap.add_argument("--cuda-elements", type=int, default=256_000_000,
                    help="samples × n per CUDA timing (with --device cuda)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device")
    if args.quick:
        args.bands, args.n, args.reps = [4, 64], [1000], 2
        args.ref_elements, args.our_elements = 2_000_000, 4_000_000
    bs, sg = load_jax_privacy(args.reference_path)
    single_thread()
    rows = []
    for n in args.n:
        for b in args.bands:
            rows.append(bench_row(b, n, args.sigma, args.reps, args.ref_elements,
                                  args.our_elements, args.workers, bs, sg,
                                  args.cuda_elements if args.device == "cuda" else 0))
            print(f"b={b} n={n}: jax_privacy {rows[-1]['jax_privacy_samples_per_s']:,.0f}/s, "
                  f"ours {rows[-1]['ours_samples_per_s']:,.0f}/s", file=sys.stderr, flush=True)
    print(format_table(rows))
    paper = []
    if args.paper_settings:
        paper = paper_settings_rows(args.reps, seconds=4.0)
        print("\n| setting | n | b | ours samples/s (one core) | Algorithm 5: samples per "
              "direction, hours per σ candidate | KL bound: samples per direction, hours |")
        print("|---|---|---|---|---|---|")
        for r in paper:
            print(f"| {r['setting']} | {r['n']} | {r['b']} | {r['ours_samples_per_s']:,.0f} | "
                  f"{r['algorithm5_samples_per_direction']:.3e}, "
                  f"{r['algorithm5_hours_per_candidate']:.2f} h | "
                  f"{r['kl_samples_per_direction']:.3e}, {r['kl_hours']:.2f} h |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"reference": "jax_privacy " + getattr(sg, "__name__", ""),
                       "sigma": args.sigma, "p0": P0, "device": args.device, "rows": rows,
                       "paper_settings": paper}, fh, indent=1)


if __name__ == "__main__":
    main()
