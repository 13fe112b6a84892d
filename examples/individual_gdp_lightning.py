"""Individual GDP accounting and filtering on sklearn's digits (offline), on an unmodified module.

``DigitsMLP`` is a plain LightningModule: its ``training_step`` takes ``(x, y)`` and its
``configure_optimizers`` returns plain SGD. ``DPCallback`` makes it private, and the individual
callbacks learn each batch's dataset indices from the batch sampler, never from the batch.
The script does four runs, with σ and C fixed:

1. full-batch DP-GD (``GDPScheme``: every example in every step), no filter. The
   ``PerSampleEpsilonTracker`` records every example's individual GDP value
   μ_i = sqrt(Σ_j min(‖g_ij‖, C)² / (σC)²). Its histogram of individual ε(δ) shows most examples
   far below the worst case √T/σ (Koskela, Tobaben & Honkela 2023, Fig. 7);
2. the same with ``IndividualGDPFilter`` at budget B = √T₀/σ (T₀ < T). An example is dropped
   before the step that would exceed B², so every example is B-GDP (Thm 1) although the run
   takes T > T₀ steps;
3. full-batch DP-GD for only T₀ steps (the same ε without filtering), for the accuracy;
4. Poisson subsampling at rate ``--sample-rate``, no filter. The per-example ε is the smaller of
   the individual GDP ε and the population ε, so an example whose norm is always ≥ C gets
   exactly the population ε (see docs/guides/individual_gdp.md).

Usage::

    python examples/individual_gdp_lightning.py --steps 60 --filter-steps 30 --out /tmp/igdp
"""

from __future__ import annotations

import argparse
import os
import warnings

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_callbacks import DPCallback, IndividualGDPFilter, PerSampleEpsilonTracker
from opacus_structured._optional import install_excepthook, require
from opacus_structured.accounting.individual_gdp import budget_from_steps
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.poisson import PoissonScheme


class DigitsMLP(pl.LightningModule):
    """An ordinary LightningModule: nothing in it knows about DP or dataset indices."""

    def __init__(self, lr: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def run(args, train, test, *, steps: int, scheme, use_filter: bool):
    torch.manual_seed(args.seed)
    model = DigitsMLP(args.lr)
    n = len(train)
    dp = DPCallback(scheme=scheme, noise_multiplier=args.noise_multiplier,
                    max_grad_norm=args.clip, delta=args.delta, seed=args.seed)
    tracker = PerSampleEpsilonTracker(n)
    filt = None
    callbacks = [dp]
    if use_filter:
        filt = IndividualGDPFilter(n, budget_from_steps(args.filter_steps, args.noise_multiplier))
        callbacks.append(filt)
    callbacks.append(tracker)  # after the filter: dropped examples spend nothing
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, DataLoader(train, num_workers=args.workers))
    x, y = test.tensors
    with torch.no_grad():
        acc = (model.net(x).argmax(1) == y).float().mean().item()
    return acc, dp, tracker, filt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="DP-GD steps T (fixed in advance)")
    p.add_argument("--filter-steps", type=int, default=30,
                   help="T0: budget B = sqrt(T0)/sigma (worst-case examples last T0 steps)")
    p.add_argument("--noise-multiplier", type=float, default=20.0, help="noise multiplier σ")
    p.add_argument("--clip", type=float, default=2.0, help="clipping norm C")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    p.add_argument("--delta", type=float, default=1e-5, help="δ at which ε is reported")
    p.add_argument("--sample-rate", type=float, default=0.125,
                   help="Poisson rate q of run 4 (its steps: --steps / q, the same epochs)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--seed", type=int, default=0, help="data, model and noise seed")
    p.add_argument("--out", default="individual_gdp_out",
                   help="directory for the histograms and CSVs")
    args = p.parse_args(argv)
    if not 0 < args.sample_rate <= 1:
        p.error(f"--sample-rate must be in (0, 1], got {args.sample_rate}")
    if not 0 < args.filter_steps <= args.steps:
        p.error("--filter-steps must be in [1, --steps]")

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    load_digits = require("sklearn.datasets", "this example's data set").load_digits
    train_test_split = require("sklearn.model_selection").train_test_split

    xs, ys = load_digits(return_X_y=True)
    xs = (xs / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(xs, ys, test_size=0.25, random_state=args.seed)
    train = TensorDataset(torch.tensor(xtr), torch.tensor(ytr))
    test = TensorDataset(torch.tensor(xte), torch.tensor(yte))
    os.makedirs(args.out, exist_ok=True)
    d = args.delta

    acc_plain, dp_plain, tr_plain, _ = run(args, train, test, steps=args.steps,
                                           scheme=GDPScheme(), use_filter=False)
    acc_filt, _, tr_filt, filt = run(args, train, test, steps=args.steps, scheme=GDPScheme(),
                                     use_filter=True)
    acc_short, _, _, _ = run(args, train, test, steps=args.filter_steps, scheme=GDPScheme(),
                             use_filter=False)
    poisson_steps = round(args.steps / args.sample_rate)
    acc_pois, dp_pois, tr_pois, _ = run(args, train, test, steps=poisson_steps,
                                        scheme=PoissonScheme(sample_rate=args.sample_rate),
                                        use_filter=False)

    eps_plain = tr_plain.epsilons(d)
    tr_plain.plot_histogram(os.path.join(args.out, "individual_eps_no_filter.png"), d)
    tr_filt.plot_histogram(os.path.join(args.out, "individual_eps_filter.png"), d)
    tr_pois.plot_histogram(os.path.join(args.out, "individual_eps_poisson.png"), d)
    tr_plain.to_csv(os.path.join(args.out, "individual_eps_no_filter.csv"), d)
    tr_pois.to_csv(os.path.join(args.out, "individual_eps_poisson.csv"), d)
    b = budget_from_steps(args.filter_steps, args.noise_multiplier)
    print(f"N = {len(train)}, T = {args.steps}, sigma = {args.noise_multiplier}, C = {args.clip}, "
          f"delta = {d:g}")
    print(f"full batch, no filter: test accuracy {acc_plain:.4f}; population eps = "
          f"{dp_plain.epsilon():.4f}; individual eps median {np.median(eps_plain):.4f}, "
          f"max {eps_plain.max():.4f}")
    print(f"full batch, filter   : test accuracy {acc_filt:.4f}; certified eps = "
          f"{filt.epsilon(d):.4f} (B = {b:.4f}); active examples at last step "
          f"{filt.active_counts()[-1]} / {len(train)}")
    print(f"full batch, T0 = {args.filter_steps} steps (same eps, no filter): test accuracy "
          f"{acc_short:.4f}")
    eps_pois, gdp_pois = tr_pois.epsilons(d), tr_pois.gdp_epsilons(d)
    print(f"Poisson q = {args.sample_rate:g}, {poisson_steps} steps: test accuracy "
          f"{acc_pois:.4f}; population eps = {dp_pois.epsilon():.4f}; per-example eps median "
          f"{np.median(eps_pois):.4f}, max {eps_pois.max():.4f} (individual GDP alone, without "
          f"amplification: median {np.median(gdp_pois):.4f})")
    print(f"histograms and CSVs written to {args.out}/")


if __name__ == "__main__":
    install_excepthook()  # a missing extra: one install line, no traceback
    main()
