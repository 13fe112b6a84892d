"""Truncated Poisson DP-SGD: fixed-shape batches, the tight accountant, and ε versus B.

Run: ``python examples/truncated_poisson.py`` (about a minute on 2 CPU cores), or
``python examples/truncated_poisson.py --plot docs/guides/truncated_poisson_eps_vs_b.png`` to
redraw the guide's figure (its setting: n = 10000, p = 0.01, σ = 1, T = 1000, δ = 1e-5).

1. Price the setting (Ganesh 2025 Thm 3.1 versus dp_accounting's event and the
   (ε, δ + e^ε η) baseline) and pick the smallest B within 1% of untruncated Poisson.
2. Train a small classifier with Opacus on fixed-shape batches (padding masked out).
"""

import argparse
import math
import warnings

import torch
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from torch import nn
from torch.utils.data import TensorDataset

from opacus_structured.accountants.truncated_poisson import TruncatedPoissonAccountant
from opacus_structured.accounting import truncated_poisson as tp
from opacus_structured.samplers.truncated_poisson import masked_loss, truncated_poisson_data_loader

warnings.filterwarnings("ignore", category=UserWarning)
D = 1e-3  # PLD discretisation (pessimistic; 1e-4 for reported numbers)


def dp_accounting_eps(n, p, b, sigma, steps, delta):
    pld = dp_pld.from_truncated_subsampled_gaussian_mechanism(
        n, p, b, sigma, value_discretization_interval=D)
    return pld.self_compose(steps, tail_mass_truncation=1e-15).get_epsilon_for_delta(delta)


def curve(n=10000, p=0.01, sigma=1.0, steps=1000, delta=1e-5, bs=range(100, 205, 5)):
    rows = []
    for b in bs:
        rows.append((b,
                     tp.truncated_poisson_epsilon(n, p, b, sigma, steps, delta, discretization=D),
                     dp_accounting_eps(n, p, b, sigma, steps, delta),
                     tp.truncated_poisson_epsilon(n, p, b, sigma, steps, delta,
                                                  analysis="baseline", discretization=D)))
    return rows, tp.poisson_epsilon(p, sigma, steps, delta, discretization=D)


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, poisson = curve()
    bs = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ax.plot(bs, [r[1] for r in rows], "o-", ms=3, label="tight (Thm 3.1, this package)")
    ax.plot(bs, [r[2] for r in rows], "s--", ms=3, label="dp_accounting event (RO r=2 branch)")
    finite = [(r[0], r[3]) for r in rows if math.isfinite(r[3])]
    ax.plot([b for b, _ in finite], [e for _, e in finite], "^-", ms=3,
            label="baseline (ε, δ+e^ε η), finite part")
    ax.axhline(poisson, color="k", lw=0.8, ls=":", label=f"untruncated Poisson ({poisson:.3f})")
    ax.axvline(100, color="grey", lw=0.5)
    ax.set_yscale("log")
    ax.set_xlabel("max batch size B  (E[Poisson batch] = np = 100)")
    ax.set_ylabel("ε at δ = 1e-5")
    ax.set_title("n=10000, p=0.01, σ=1, T=1000 steps", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    for b, tight, builtin, base in rows:
        print(f"B={b:4d}  tight {tight:8.4f}  dp_accounting {builtin:8.4f}  baseline {base:8.4f}")


def train():
    n, p, sigma, delta, epochs = 2000, 0.05, 1.0, 1e-5, 2
    steps = epochs * math.floor(1 / p)
    b = tp.smallest_max_batch_size(n, p, sigma, steps, delta, max_overhead=0.01,
                                   discretization=D)
    print(f"smallest B within 1% of Poisson's ε: B = {b} (np = {n * p:g}, "
          f"truncation weight w2 = {tp.truncation_weight(n, p, b):.2e})")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :2].sum(dim=1) > 0).long()
    loader = truncated_poisson_data_loader(TensorDataset(x, y), p, b, seed=0)
    scheme = loader.batch_sampler.scheme

    from opacus import PrivacyEngine

    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine()
    engine.accountant = TruncatedPoissonAccountant(scheme, discretization=D)
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=1.0, poisson_sampling=False)  # keep our fixed-shape batch sampler
    for epoch in range(epochs):
        for xb, yb, mask in loader:  # every batch has exactly B rows
            optimizer.zero_grad()
            per_sample = nn.functional.cross_entropy(model(xb), yb, reduction="none")
            masked_loss(per_sample, mask, normalizer=b).backward()  # mean over the B slots
            optimizer.step()
        with torch.no_grad():
            acc = (model(x).argmax(1) == y).float().mean().item()
        print(f"epoch {epoch + 1}: accuracy {acc:.3f}, ε = {engine.get_epsilon(delta):.3f} "
              f"(Poisson alone: {tp.poisson_epsilon(p, sigma, steps * (epoch + 1) // epochs, delta, discretization=D):.3f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="PNG", help="draw the ε-vs-B figure to this path")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot)
    else:
        train()
