"""A standard Opacus training script where one line switches the accountant *and* sampler.

Trains a small MLP on scikit-learn's digits (bundled, offline) with Opacus'
``PrivacyEngine.make_private`` and prints ε next to Opacus' own RDP and PRV accountants for the
same steps.

The one line to change is ``SCHEME`` below (or ``--scheme``; ``--scheme all`` runs every
recipe and prints a summary table). Each recipe builds one of our schemes from the dataset
size, the steps per epoch and the planned epochs, and the script then does the same three
things for every scheme:

1. the DataLoader draws batches with ``scheme.sampler(...)`` (``poisson_sampling=False`` keeps
   it: Opacus would otherwise install its own Poisson loader);
2. ``engine.accountant = SchemeAccountant(scheme)`` — which returns the accountant registered
   for that scheme (``BallsInBinsAccountant`` for balls-in-bins, …) — *before* ``make_private``
   so the optimizer's step hook feeds it;
3. for a scheme that prices correlated noise (``scheme.prices_correlated_noise``) the engine is
   :class:`~opacus_structured.optim.CorrelatedNoisePrivacyEngine` and ``make_private`` gets the
   strategy's ``noise_correlation``.

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
from dataclasses import dataclass, field
from typing import Callable

import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.data_loader import wrap_collate_with_empty
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.optim import CorrelatedNoisePrivacyEngine
from opacus_structured.samplers.truncated_poisson import masked_loss, truncated_poisson_data_loader
from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme
from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.poisson import PoissonScheme
from opacus_structured.schemes.random_allocation_mf import RandomAllocationMFScheme
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

SCHEME = "poisson"  # <- the one line: which of our schemes samples and prices training


@dataclass
class Recipe:
    """How one scheme is built and fed (everything else in the script is shared)."""

    build: Callable[[int, int, int], object]  # (dataset size, steps/epoch, epochs) -> scheme
    loader: Callable[[object, TensorDataset, int], DataLoader] = None  # default: scheme.sampler
    padded: bool = False  # batches carry a 0/1 mask (truncated Poisson's fixed-shape padding)
    notes: str = ""
    make_private_kwargs: Callable[[object, int], dict] = field(default=lambda scheme, steps: {})


def _collate():
    return wrap_collate_with_empty(collate_fn=default_collate,
                                   sample_empty_shapes=[(0, 64), (0,)],
                                   dtypes=[torch.float32, torch.int64])


def _sampler_loader(sampler_of):
    def make(scheme, dataset, seed):
        sampler = sampler_of(scheme, len(dataset), torch.Generator().manual_seed(seed))
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=_collate())
    return make


RECIPES: dict[str, Recipe] = {
    "poisson": Recipe(
        build=lambda n, steps, epochs: PoissonScheme(sample_rate=1.0 / steps),
        loader=_sampler_loader(lambda s, n, g: s.sampler(n, generator=g)),
        notes="Poisson subsampling, our PLD (same mechanism as Opacus' columns)"),
    "truncated-poisson": Recipe(
        build=lambda n, steps, epochs: TruncatedPoissonScheme(
            dataset_size=n, sample_rate=1.0 / steps,
            max_batch_size=math.ceil(1.25 * n / steps)),
        loader=lambda s, ds, seed: truncated_poisson_data_loader(
            ds, s.sample_rate, s.max_batch_size, seed=seed),
        padded=True,
        notes="fixed-shape batches of B = 1.25·E[|batch|] (Ganesh 2025, tight)"),
    "balls-in-bins": Recipe(
        build=lambda n, steps, epochs: BallsInBinsScheme(num_bins=steps, epochs=epochs),
        loader=_sampler_loader(lambda s, n, g: s.sampler(n, generator=g)),
        notes="each example in one fixed bin per epoch (pld-accounting)"),
    "random-allocation-mf": Recipe(
        build=lambda n, steps, epochs: RandomAllocationMFScheme(
            strategy="identity", epochs=epochs, batches_per_epoch=steps),
        loader=_sampler_loader(lambda s, n, g: s.sampler(n, generator=g)),
        notes="same sampler, Rényi DP / conditional composition (Schuchardt & Kalinin)"),
    "bandmf-cyclic-poisson": Recipe(
        build=lambda n, steps, epochs: BandMFCyclicPoissonScheme(
            dataset_size=n, batch_size=n / steps, bands=4),
        loader=_sampler_loader(lambda s, n, g: s.sampler(generator=g)),
        make_private_kwargs=lambda s, total: {"noise_correlation": s.noise_correlation(total)},
        notes="BandMF correlated noise, 4 bands, cyclic Poisson (ε of the matrix mechanism)"),
    "gdp": Recipe(
        build=lambda n, steps, epochs: GDPScheme(),
        loader=lambda s, ds, seed: DataLoader(ds, batch_size=len(ds), shuffle=False),
        notes="full-batch DP-GD: one step per epoch, no amplification"),
}


def load_data(seed: int):
    digits = load_digits()
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
    recipe = RECIPES[name]
    torch.manual_seed(args.seed)
    dataset, x_test, y_test = load_data(args.seed)

    # ---- the swap: our scheme's sampler in the DataLoader, its accountant in the engine ----
    scheme = recipe.build(len(dataset), args.steps_per_epoch, args.epochs)
    loader = recipe.loader(scheme, dataset, args.seed)
    engine = (CorrelatedNoisePrivacyEngine(scheme=scheme)
              if scheme.prices_correlated_noise else PrivacyEngine())
    engine.accountant = SchemeAccountant(scheme, discretization=args.discretization)
    # ------------------------------------------------------------------------------------------

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
        poisson_sampling=False,  # keep our sampler (Opacus would otherwise install its own)
        **recipe.make_private_kwargs(scheme, args.epochs * len(loader)))
    if verbose:
        print(f"\n[{name}] {recipe.notes}\n  scheme: {scheme!r}\n  accountant: "
              f"{type(engine.accountant).__name__} ({engine.accountant.bound}); "
              f"{len(loader)} steps/epoch, sigma={args.noise_multiplier}, delta={args.delta}")
        print(f"  {'epoch':>5} {'steps':>6} {'ours':>9} {'opacus RDP':>11} {'opacus PRV':>11} "
              f"{'test acc':>9}")
    start = time.perf_counter()
    row = {}
    for epoch in range(1, args.epochs + 1):
        model.train()
        for batch in loader:
            optimizer.zero_grad()
            if recipe.padded:
                xb, yb, mask = batch
                per_sample = nn.functional.cross_entropy(model(xb), yb, reduction="none")
                masked_loss(per_sample, mask, normalizer=xb.shape[0]).backward()
            else:
                xb, yb = batch
                nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        ours = engine.get_epsilon(args.delta)
        rdp, prv = peers(engine.accountant.history, args.delta)
        row = dict(scheme=name, bound=engine.accountant.bound, steps=len(engine.accountant),
                   epsilon=ours, opacus_rdp=rdp, opacus_prv=prv, test_accuracy=acc)
        if verbose:
            print(f"  {epoch:>5} {row['steps']:>6} {ours:>9.4f} {rdp:>11.4f} {prv:>11.4f} "
                  f"{acc:>9.3f}")
    row["seconds"] = time.perf_counter() - start
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default=SCHEME, choices=sorted(RECIPES) + ["all"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--discretization", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    names = sorted(RECIPES) if args.scheme == "all" else [args.scheme]
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
    main()
