"""Cost of the guarded step and of ``get_epsilon`` against stock Opacus 1.6 (issue 46, item 5).

Targets: the guarded step ≤ 1.03× a stock Opacus step, and ``get_epsilon`` ≤ 2× Opacus' own
PRV accountant, in one process on one CPU.

The setting of the issue: Opacus' MNIST example network (``examples/mnist.py``'s
``SampleConvNet``: two convolutions, two linear layers), MNIST-sized synthetic data (60 000
images 1×28×28, 10 classes), Poisson sampling at q = 64/60 000 (expected batch 64), σ = 1,
C = 1, SGD, δ = 1e-5, on ``--threads`` torch threads.

* **stock**: ``PrivacyEngine()`` (Opacus' PRV accountant) and ``engine.make_private``, the
  loop written as in Opacus' example;
* **guarded**: ``PrivacyEngine(accountant="poisson")`` and
  :func:`opacus_structured.make_private` (our sampler and loader tagging the rows, the release
  guard, the row record and the ledger; everything a user of this package runs).

Each run builds both from the same initial weights and the same sampler seed (the two draw
the same batches: each pair of steps compares batches of one size), trains 5 warm-up steps of
each, then
``--steps`` steps **interleaved** (stock, guarded, guarded, stock, ...: the order alternates to
cancel drift); a step is timed from drawing the batch to the end of ``optimizer.step()``.
Per run: the median step of each, and the median over steps of the paired ratio guarded /
stock, of wall time and of the thread's CPU time (steadier on a shared machine; the targets
are wall time on an idle one). After the run (``--steps`` + 5 steps each), ``engine.get_epsilon(1e-5)`` is timed once
on each engine (a first call for that history: nothing cached for it; our accountant's
per-(σ, q) caches from earlier runs are cleared before it, so every run pays them).

    OMP_NUM_THREADS=1 python benchmarks/opacus_parity.py [--runs 3] [--steps 50] \\
        [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from _machine import cpu_name, write_json  # benchmarks/_machine.py (scripts run from benchmarks/)
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured.accountants import ledger as _ledger  # noqa: F401 (loads the layer)

N, BATCH, SIGMA, CLIP, DELTA, WARMUP = 60_000, 64, 1.0, 1.0, 1e-5, 5


class SampleConvNet(nn.Module):
    """Opacus' ``examples/mnist.py`` network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 1)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 1)
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def _clear_caches() -> None:
    """Our accountant's process-wide caches (per (σ, q) PLDs and RDP curves), so each run's
    ``get_epsilon`` pays them as a first run would."""
    from opacus_structured.schemes import poisson

    for name in dir(poisson):
        fn = getattr(poisson, name)
        if callable(getattr(fn, "cache_clear", None)):
            fn.cache_clear()


def build(kind: str, data, state, seed: int):
    """``(engine, model, optimizer, batch iterator)``; both kinds draw the same Poisson
    batches (the same generator seed, the same ``torch.rand(N) < q`` draw), so each pair of
    steps trains batches of the same size."""
    model = SampleConvNet()
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0)
    loader = DataLoader(data, batch_size=BATCH)
    if kind == "stock":
        engine = PrivacyEngine()
        model, opt, loader = engine.make_private(module=model, optimizer=opt,
                                                 data_loader=loader, noise_multiplier=SIGMA,
                                                 max_grad_norm=CLIP)
        loader.batch_sampler.generator = torch.Generator().manual_seed(seed)
    else:
        engine = PrivacyEngine(accountant="poisson")
        model, opt, loader = opacus_structured.make_private(
            engine, module=model, optimizer=opt, data_loader=loader, noise_multiplier=SIGMA,
            max_grad_norm=CLIP, dataset_size=N,
            sampler_generator=torch.Generator().manual_seed(seed))
    return engine, model, opt, iter(loader)


def step(run) -> tuple[float, float, int]:
    """One DP-SGD step as Opacus' example writes it; (wall, thread CPU) seconds, batch size."""
    engine, model, opt, batches = run
    t, c = time.perf_counter(), time.thread_time()
    x, y = next(batches)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return time.perf_counter() - t, time.thread_time() - c, len(x)


def one_run(data, steps: int, seed: int) -> dict:
    torch.manual_seed(seed)
    state = SampleConvNet().state_dict()
    runs = {kind: build(kind, data, state, seed) for kind in ("stock", "guarded")}
    for _ in range(WARMUP):
        for kind in runs:
            step(runs[kind])
    times: dict = {"stock": [], "guarded": []}
    for i in range(steps):
        for kind in (("stock", "guarded") if i % 2 == 0 else ("guarded", "stock")):
            times[kind].append(step(runs[kind]))
    wall = {k: [w for w, _, _ in v] for k, v in times.items()}
    cpu = {k: [c for _, c, _ in v] for k, v in times.items()}
    if [b for _, _, b in times["stock"]] != [b for _, _, b in times["guarded"]]:
        raise RuntimeError("the two runs drew different batches; the pairs would compare "
                           "different batch sizes")
    _clear_caches()
    eps = {}
    for kind in ("stock", "guarded"):
        t, c = time.perf_counter(), time.process_time()
        value = float(runs[kind][0].get_epsilon(DELTA))
        eps[kind] = (value, time.perf_counter() - t, time.process_time() - c)

    def paired(d):
        return statistics.median(g / s for g, s in zip(d["guarded"], d["stock"], strict=True))

    return {"stock_step_ms": 1e3 * statistics.median(wall["stock"]),
            "guarded_step_ms": 1e3 * statistics.median(wall["guarded"]),
            "step_ratio_median": paired(wall), "step_cpu_ratio_median": paired(cpu),
            "step_ratio_of_medians": statistics.median(wall["guarded"])
            / statistics.median(wall["stock"]),
            "eps_stock_prv": eps["stock"][0], "eps_guarded": eps["guarded"][0],
            "get_epsilon_stock_s": eps["stock"][1], "get_epsilon_guarded_s": eps["guarded"][1],
            "get_epsilon_ratio": eps["guarded"][1] / eps["stock"][1],
            "get_epsilon_cpu_ratio": eps["guarded"][2] / eps["stock"][2]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    for name in ("runs", "steps", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(N, 1, 28, 28, generator=g),
                         torch.randint(0, 10, (N,), generator=g))
    rows = [one_run(data, args.steps, seed) for seed in range(args.runs)]
    cpu = cpu_name()
    print(f"CPU: {cpu}, torch threads={torch.get_num_threads()}; MNIST CNN, Poisson q=64/60000, "
          f"{args.steps} interleaved steps after {WARMUP} warm-up, get_epsilon after "
          f"{args.steps + WARMUP} steps")
    print("| run | stock step ms | guarded step ms | guarded/stock wall (median of pairs) | "
          "CPU | eps PRV | eps ours | get_epsilon PRV s | ours s | ratio wall | CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['stock_step_ms']:.2f} | {r['guarded_step_ms']:.2f} | "
              f"{r['step_ratio_median']:.3f} | {r['step_cpu_ratio_median']:.3f} | "
              f"{r['eps_stock_prv']:.4f} | {r['eps_guarded']:.4f} | "
              f"{r['get_epsilon_stock_s']:.3f} | {r['get_epsilon_guarded_s']:.3f} | "
              f"{r['get_epsilon_ratio']:.2f} | {r['get_epsilon_cpu_ratio']:.2f} |")
    step_ratio = max(r["step_ratio_median"] for r in rows)
    eps_ratio = max(r["get_epsilon_ratio"] for r in rows)
    print(f"\nworst run (wall): step {step_ratio:.3f}x stock (target <= 1.03), get_epsilon "
          f"{eps_ratio:.2f}x PRV (target <= 2); CPU time: step "
          f"{max(r['step_cpu_ratio_median'] for r in rows):.3f}x, get_epsilon "
          f"{max(r['get_epsilon_cpu_ratio'] for r in rows):.2f}x")
    median_step = statistics.median(r["step_ratio_median"] for r in rows)
    median_eps = statistics.median(r["get_epsilon_ratio"] for r in rows)
    print(f"median of the {len(rows)} runs: step {median_step:.3f}x stock, get_epsilon "
          f"{median_eps:.2f}x PRV (a run's median moves by about ±1 % with the VM's noise: "
          f"several runs are the figure)")
    out = {"cpu": cpu, "threads": torch.get_num_threads(), **vars(args), "runs_detail": rows,
           "worst_step_ratio": step_ratio, "worst_get_epsilon_ratio": eps_ratio,
           "median_step_ratio": median_step, "median_get_epsilon_ratio": median_eps}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
