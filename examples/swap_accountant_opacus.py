"""A standard Opacus training script where one line switches the batching scheme.

Trains a small MLP on scikit-learn's digits (bundled, offline) with Opacus' ``PrivacyEngine``
and prints ε next to Opacus' own RDP and PRV accountants for the same steps.

The one line to change is ``SCHEME`` below (or ``--scheme``; ``--scheme all`` runs every scheme
and prints a summary table). For every scheme the script does the same two things:

1. ``engine = PrivacyEngine(accountant=SCHEME)`` — a
   :class:`~opacus_structured.optim.CorrelatedNoisePrivacyEngine` for a scheme that adds
   correlated noise;
2. ``opacus_structured.make_private(engine, ...)`` instead of ``engine.make_private(...)``,
   with Opacus' arguments plus the scheme's own options (``OPTIONS`` below: e.g.
   ``max_batch_size`` for truncated Poisson, ``bands`` for BandMF, ``epochs`` for the schemes
   that price a planned run). It builds the scheme from the DataLoader (dataset size,
   ``len(loader)`` steps per epoch), replaces the loader's sampler by the scheme's (as Opacus
   does with its ``DPDataLoader``), installs the scheme's accountant and passes the strategy's
   noise correlation.

Opacus' RDP/PRV columns price the same history as Poisson sampling at the rate Opacus' hook
reports (``1/len(loader)``): that is what Opacus would print for this script, and it is *not*
a valid ε for the other samplers (it under-reports for balls-in-bins and BandMF with few
epochs, over-reports for others). ``structured`` (time-series windows) needs a forecasting
dataset and ``bminsep-mc`` is a Monte Carlo estimate; see their guides.

Run: ``python examples/swap_accountant_opacus.py [--scheme all]``
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured._optional import install_excepthook, require
from opacus_structured.optim import CorrelatedNoisePrivacyEngine

SCHEME = "poisson"  # <- the one line: which of our schemes samples and prices training

#: The scheme options no DataLoader carries: (dataset size, steps/epoch, epochs) -> kwargs.
OPTIONS = {
    "poisson": lambda n, steps, epochs: {},
    "truncated-poisson": lambda n, steps, epochs: {
        "max_batch_size": math.ceil(1.25 * n / steps)},      # B = 1.25·E[|batch|]
    "balls-in-bins": lambda n, steps, epochs: {"epochs": epochs},
    "random-allocation-mf": lambda n, steps, epochs: {"epochs": epochs, "bands": 1},
    # cyclic Poisson needs bands <= steps per epoch (each example's cycle has `bands` steps)
    "bandmf-cyclic-poisson": lambda n, steps, epochs: {"epochs": epochs, "bands": min(4, steps)},
    "gdp-full-batch": lambda n, steps, epochs: {},
}
NOTES = {
    "poisson": "Poisson subsampling, our PLD (same mechanism as Opacus' columns)",
    "truncated-poisson": "batches truncated to B = 1.25·E[|batch|] (Ganesh 2025, tight)",
    "balls-in-bins": "each example in one fixed bin per epoch (pld-accounting)",
    "random-allocation-mf": "same sampler, Rényi DP / conditional composition (C = I)",
    "bandmf-cyclic-poisson": "BandMF correlated noise, 4 bands (fewer if an epoch is shorter), cyclic Poisson",
    "gdp-full-batch": "full-batch DP-GD: one step per epoch, no amplification",
}
CORRELATED = {"bandmf-cyclic-poisson"}


def load_data(seed: int):
    digits = require("sklearn.datasets", "this example's data set").load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, test = perm[:1400], perm[1400:]
    return TensorDataset(x[train], y[train]), x[test], y[test]


def peers(history, delta):
    """Opacus' RDP and PRV accountants on the same (σ, 1/len(loader), steps) history."""
    out = []
    for cls in (RDPAccountant, PRVAccountant):
        peer = cls()
        peer.history = list(history)
        out.append(peer.get_epsilon(delta))
    return out


def train(name: str, args, *, verbose: bool = True) -> dict:
    torch.manual_seed(args.seed)
    dataset, x_test, y_test = load_data(args.seed)
    loader = DataLoader(dataset, batch_size=math.ceil(len(dataset) / args.steps_per_epoch))
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    # ---- the swap: the engine names the scheme, the helper does the rest ---------------------
    engine = (CorrelatedNoisePrivacyEngine if name in CORRELATED else PrivacyEngine)(
        accountant=name)
    model, optimizer, loader = opacus_structured.make_private(
        engine, module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
        discretization=args.discretization,
        **OPTIONS[name](len(dataset), len(loader), args.epochs))
    # ------------------------------------------------------------------------------------------

    if verbose:
        print(f"\n[{name}] {NOTES[name]}\n  scheme: {engine.accountant.scheme!r}\n  accountant: "
              f"{type(engine.accountant).__name__} ({engine.accountant.bound}); "
              f"{len(loader)} steps/epoch, sigma={args.noise_multiplier}, delta={args.delta}")
        print(f"  {'epoch':>5} {'steps':>6} {'ours':>9} {'opacus RDP':>11} {'opacus PRV':>11} "
              f"{'test acc':>9}")
    start = time.perf_counter()
    row = {}
    for epoch in range(1, args.epochs + 1):
        model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            if len(xb):
                nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        ours = engine.get_epsilon(args.delta)
        rdp, prv = peers(engine.accountant.history, args.delta)
        row = dict(scheme=name, bound=str(getattr(engine.accountant.bound, "value",
                                                  engine.accountant.bound)),
                   steps=len(engine.accountant), epsilon=ours, opacus_rdp=rdp, opacus_prv=prv,
                   test_accuracy=acc)
        if verbose:
            print(f"  {epoch:>5} {row['steps']:>6} {ours:>9.4f} {rdp:>11.4f} {prv:>11.4f} "
                  f"{acc:>9.3f}")
    row["seconds"] = time.perf_counter() - start
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default=SCHEME, choices=sorted(OPTIONS) + ["all"],
                        help="which scheme samples and prices training; all: every scheme")
    parser.add_argument("--epochs", type=int, default=3, help="training epochs, >= 1")
    parser.add_argument("--steps-per-epoch", type=int, default=20,
                        help="steps per epoch (len(loader)), >= 1")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="noise multiplier σ")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping norm C")
    parser.add_argument("--delta", type=float, default=1e-5, help="δ at which ε is reported")
    parser.add_argument("--discretization", type=float, default=1e-3,
                        help="PLD grid step (pessimistic); coarser is faster and looser")
    parser.add_argument("--seed", type=int, default=0, help="data, model and sampler seed")
    args = parser.parse_args(argv)
    for flag in ("epochs", "steps_per_epoch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    warnings.filterwarnings("ignore")

    names = sorted(OPTIONS) if args.scheme == "all" else [args.scheme]
    rows = [train(name, args) for name in names]
    if len(rows) > 1:
        print(f"\nafter {args.epochs} epochs x {args.steps_per_epoch} steps, "
              f"sigma={args.noise_multiplier}, delta={args.delta}:")
        print(f"{'scheme':<22} {'bound':<6} {'steps':>5} {'ours':>8} {'opacus RDP':>11} "
              f"{'opacus PRV':>11} {'acc':>6}")
        for r in rows:
            print(f"{r['scheme']:<22} {r['bound']:<6} {r['steps']:>5} {r['epsilon']:>8.4f} "
                  f"{r['opacus_rdp']:>11.4f} {r['opacus_prv']:>11.4f} {r['test_accuracy']:>6.3f}")
    return rows


if __name__ == "__main__":
    install_excepthook()  # a missing extra: one install line, no traceback
    main()
