"""A standard Opacus training script where one line switches the accountant *and* sampler.

Trains a small MLP on scikit-learn's digits (bundled, offline) with Opacus'
``PrivacyEngine.make_private`` and prints ε side by side with Opacus' own RDP and PRV
accountants for the same steps.

The one line to change is ``SCHEME`` below. Each entry of ``SCHEMES`` builds a scheme of
opacus-structured from (dataset size, steps per epoch); the DataLoader then draws batches with
that scheme's sampler (``poisson_sampling=False`` leaves the loader unchanged) and
``SchemeAccountant(scheme)`` replaces the engine's accountant before ``make_private``, so the
optimizer's step hook feeds it. Only "poisson" is wired in here: other schemes (structured
time-series windows, truncated Poisson, BandMF) need their own data/optimizer and are used
from their guides; if their modules are installed they are listed as available below.

Run: ``python examples/swap_accountant_opacus.py``
"""

import argparse
import importlib
import warnings

import torch
from opacus import PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.data_loader import wrap_collate_with_empty
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.samplers.poisson import PoissonBatchSampler
from opacus_structured.schemes.poisson import PoissonScheme

SCHEME = "poisson"  # <- the one line: which of our schemes prices (and samples) training

SCHEMES = {
    # name: (dataset size, steps per epoch) -> scheme
    "poisson": lambda n, steps: PoissonScheme(sample_rate=1.0 / steps),
}
# Schemes other helpers ship (guarded: their modules may not exist in this checkout).
OPTIONAL = ["opacus_structured.schemes.truncated_poisson", "opacus_structured.schemes.structured"]


def make_sampler(scheme, n, generator):
    """The scheme's own sampler (``scheme.sampler``), or ours for Poisson."""
    try:
        return scheme.sampler(n, generator=generator)
    except NotImplementedError:
        return PoissonBatchSampler(n, scheme.sample_rate, generator=generator)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default=SCHEME, choices=sorted(SCHEMES))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--discretization", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(args.seed)

    for mod in OPTIONAL:
        try:
            importlib.import_module(mod)
            print(f"[available] {mod} (see its guide for its sampler's inputs)")
        except ImportError:
            print(f"[not installed] {mod}")

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
    train, test = perm[:1400], perm[1400:]
    dataset = TensorDataset(x[train], y[train])

    # ---- the swap: our scheme's sampler in the DataLoader, our accountant in the engine ----
    scheme = SCHEMES[args.scheme](len(dataset), args.steps_per_epoch)
    sampler = make_sampler(scheme, len(dataset), torch.Generator().manual_seed(args.seed))
    loader = DataLoader(dataset, batch_sampler=sampler,
                        collate_fn=wrap_collate_with_empty(collate_fn=default_collate))
    engine = PrivacyEngine(accountant="prv")
    engine.accountant = SchemeAccountant(scheme, discretization=args.discretization)
    # ----------------------------------------------------------------------------------------

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=args.noise_multiplier, max_grad_norm=args.max_grad_norm,
        poisson_sampling=False)  # keep our sampler (Opacus would otherwise install its own)

    print(f"scheme: {scheme!r}; {len(loader)} steps/epoch, sigma={args.noise_multiplier}, "
          f"delta={args.delta}")
    print(f"{'epoch':>5} {'steps':>6} {'ours':>9} {'opacus RDP':>11} {'opacus PRV':>11} "
          f"{'test acc':>9}")
    for epoch in range(1, args.epochs + 1):
        model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        ours = engine.get_epsilon(args.delta)
        history = [(s, q, n) for s, q, n in engine.accountant.history]
        peers = []
        for cls in (RDPAccountant, PRVAccountant):  # Opacus' Poisson accountants, same steps
            peer = cls()
            peer.history = list(history)
            peers.append(peer.get_epsilon(args.delta))
        print(f"{epoch:>5} {len(engine.accountant):>6} {ours:>9.4f} {peers[0]:>11.4f} "
              f"{peers[1]:>11.4f} {acc:>9.3f}")
    print(f"ours is {engine.accountant.bound!r} ({scheme.name}); Opacus' RDP/PRV assume Poisson "
          f"sampling at the reported rate q={engine.accountant.history[-1][1]:.4g}")


if __name__ == "__main__":
    main()
