"""What each noisy step summed is what gets priced: five loops as users write them.

The same tiny model and Poisson run (N = 120, batch 20, σ = 1, 3 epochs) trained five ways on
synthetic data, each through ``opacus_structured.make_private`` and a stock Opacus
``PrivacyEngine``:

1. ``plain``: one batch, one noisy step;
2. ``accumulate``: manual gradient accumulation with ``optimizer.signal_skip_step(True)`` over
   two loader batches per noisy step (one noise for the sum of two Poisson draws);
3. ``two views``: two augmented views of every example in one forward (two rows per example);
4. ``gan``: a discriminator step on the private batch plus generated samples, declared public
   with ``opacus_structured.public_rows()``;
5. ``gan, undeclared``: the same without the declaration (the generated rows are priced as rows
   of unknown origin, without amplification).

For each it prints the ε the accountant reports, the ε the same number of noisy steps would
have as plain Poisson steps (what a library that assumes "one batch, one row per example"
prints), and what the accountant recorded (``history``: noise multiplier, rate, steps;
``unamplified``: Gaussian parts priced without amplification). The rows' provenance is
observed (docs/guides/what_the_accountant_checks.md); nothing here is declared except the
public rows of loop 4.

Run: ``python examples/what_a_step_sums.py`` (``--loop gan`` for one loop, ``--epochs 1``).
"""

from __future__ import annotations

import argparse
import warnings

warnings.filterwarnings("ignore", message="Secure RNG turned off")

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured.schemes.poisson import PoissonScheme

N, B, SIGMA, DELTA, EPOCHS = 120, 20, 1.0, 1e-5, 3


def _setup():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = PrivacyEngine(accountant="poisson")
    model, optimizer, loader = opacus_structured.make_private(
        engine, module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=B),
        noise_multiplier=SIGMA, max_grad_norm=1.0, dataset_size=N,
        sampler_generator=torch.Generator().manual_seed(7))
    return engine, model, optimizer, loader


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def plain(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        _loss(model, x, y).backward()
        optimizer.step()


def accumulate(model, optimizer, loader):
    for i, (x, y) in enumerate(loader):
        _loss(model, x, y).backward()
        optimizer.signal_skip_step(do_skip=i % 2 == 0)  # noise only every second batch
        optimizer.step()
        optimizer.zero_grad()


def two_views(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        views = torch.cat([x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)])
        _loss(model, views, torch.cat([y, y])).backward()
        optimizer.step()


def _gan(declare: bool):
    generator = nn.Linear(3, 4)

    def loop(model, optimizer, loader):
        for x, y in loader:
            optimizer.zero_grad()
            _loss(model, x, y).backward()                    # the private batch
            fake = generator(torch.randn(8, 3)).detach()     # generated: no private data
            if declare:
                with opacus_structured.public_rows():
                    logits = model(fake)
            else:
                logits = model(fake)
            nn.functional.cross_entropy(logits, torch.zeros(8, dtype=torch.long)).backward()
            optimizer.step()

    return loop


LOOPS = {"plain": plain, "accumulate": accumulate, "two views": two_views,
         "gan": _gan(True), "gan, undeclared": _gan(False)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", action="append", choices=sorted(LOOPS),
                        help="run only this loop (repeatable; default: all five)")
    parser.add_argument("--epochs", type=int, default=EPOCHS,
                        help=f"passes over the data per loop (default {EPOCHS})")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    naive_scheme = PoissonScheme(sample_rate=B / N)
    print(f"{'loop':18s} {'epsilon':>10s} {'as plain steps':>15s}  recorded")
    for name, loop in LOOPS.items():
        if args.loop and name not in args.loop:
            continue
        engine, model, optimizer, loader = _setup()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(args.epochs):
                loop(model, optimizer, loader)
            eps = float(engine.get_epsilon(DELTA))
        acc = engine.accountant
        releases = acc.released_steps
        naive = float(naive_scheme.epsilon(SIGMA, releases, DELTA))
        recorded = f"history={[(round(s, 3), round(q, 3), n) for s, q, n in acc.history]}"
        if acc.unamplified:
            recorded += f" unamplified={ {round(s, 4): n for s, n in acc.unamplified.items()} }"
        print(f"{name:18s} {eps:10.3f} {naive:15.3f}  {recorded}")


if __name__ == "__main__":
    main()
