"""Red-team loop shapes on the Lightning path (``DPCallback``), for
tests/test_privacy_ledger_redteam.py; the oracle and the schemes are tests/redteam.py's.

The module records, at every optimizer step (its ``on_before_optimizer_step``), the batches
the step sums and the rows each example gave, so that :func:`redteam.oracle` prices what ran:

* ``skip2`` (``training_step`` returns ``None``: Lightning skips the step),
  ``limit_train_batches`` (every epoch stops early), ``max_steps`` (training stops mid-epoch),
  ``public_fakes`` (generated samples declared public through the module's forward);
* rows per example: ``two_views`` (two augmented views of each example, undeclared: the
  batches carry no row tokens under Lightning, so refusing is the answer) and
  ``two_views_declared`` (``rows_per_example=2``: priced at σ/2);
* draws per release (issue 46): ``accumulate2`` / ``accumulate3`` / ``accumulate4``
  (``Trainer(accumulate_grad_batches=K)``; 6 batches per epoch, so ``K = 4`` leaves a last
  group of 2 at every epoch's end, where Lightning steps anyway);
* ``ghost_*``: the same with ``DPCallback(grad_sample_mode="ghost")`` (book-keeping).
"""

from __future__ import annotations

import warnings

import torch
from redteam import DELTA, EPOCHS, SCHEMES, SEED, SIGMA, B, D, N, Outcome, _data
from redteam_rows import LIGHTNING_MERGING
from torch import nn
from torch.utils.data import DataLoader

import opacus_structured
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

__all__ = ["LIGHTNING_SHAPES", "LIGHTNING_MERGING", "run_lightning_case"]

_BASE = ("plain", "skip2", "limit_train_batches", "max_steps", "two_views", "public_fakes",
         "two_views_declared", "accumulate2", "accumulate3", "accumulate4")
LIGHTNING_SHAPES = _BASE + ("ghost_plain", "ghost_two_views", "ghost_two_views_declared",
                            "ghost_accumulate2", "ghost_accumulate4")


def _settings(shape: str) -> dict:
    base = shape.removeprefix("ghost_")
    return {"mode": "ghost" if shape.startswith("ghost_") else "hooks", "base": base,
            "views": 2 if base.startswith("two_views") else 1,
            "declared": base.endswith("_declared"),
            "k": int(base.removeprefix("accumulate")) if base.startswith("accumulate") else 1}


def run_lightning_case(scheme_name: str, shape: str, workers: int = 0) -> Outcome:
    """Run one Lightning loop shape through ``DPCallback`` (module docstring)."""
    import lightning.pytorch as pl

    from lightning_callbacks import DPCallback

    scheme = SCHEMES[scheme_name]
    cfg = _settings(shape)
    released: list = []
    parts: list = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(4, 2)
            self.pending: list = []

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            if cfg["base"] == "skip2" and batch_idx % 2:
                return None
            self.pending.append((tuple(sorted(idx.tolist())), cfg["views"]))
            if cfg["views"] > 1:
                x, y = torch.cat([x, x + 0.01 * torch.randn_like(x)]), torch.cat([y, y])
            loss = nn.functional.cross_entropy(self.layer(x), y) if len(x) else \
                self.layer.weight.sum() * 0.0
            if cfg["base"] == "public_fakes":  # generated samples through the module's forward
                with opacus_structured.public_rows():
                    out = self(torch.randn(4, 4))
                loss = loss + nn.functional.cross_entropy(out, torch.zeros(4, dtype=torch.long))
            return loss

        def on_before_optimizer_step(self, optimizer):
            if self.pending:  # the batches this step sums (recorded before it is priced)
                released.append(tuple(sorted(i for keys, _ in self.pending for i in keys)))
                parts.append(list(self.pending))
            self.pending = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    extra = {"pad": False} if isinstance(scheme, TruncatedPoissonScheme) else {}
    sampler = scheme.sampler(N, generator=torch.Generator().manual_seed(SEED), **extra)
    kwargs: dict = {"grad_sample_mode": cfg["mode"]}
    if cfg["declared"]:
        kwargs["rows_per_example"] = cfg["views"]
    if scheme.correlated_noise:
        from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
        kwargs.update(optimizer_class=CorrelatedNoiseDPOptimizer, optimizer_kwargs={
            "noise_correlation": scheme.noise_correlation(EPOCHS * (N // B))})
    cb = DPCallback(delta=DELTA, noise_multiplier=SIGMA, max_grad_norm=1.0, scheme=scheme,
                    sampler=sampler, discretization=D, seed=SEED, **kwargs)
    limits = {"limit_train_batches": {"limit_train_batches": 4},
              "max_steps": {"max_steps": 7}}.get(cfg["base"], {})
    trainer = pl.Trainer(max_epochs=EPOCHS if not isinstance(scheme, GDPScheme) else 4,
                         callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", accumulate_grad_batches=cfg["k"], **limits)
    out = Outcome(released, [], scheme=scheme, shape=shape, parts=parts, lightning=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Module(), DataLoader(_data(), batch_size=B, num_workers=workers))
            out.epsilon = float(cb.accountant.get_epsilon(DELTA, discretization=D))
    except (RuntimeError, ValueError) as err:
        out.error = err
    out.sigmas = [SIGMA] * len(released)
    return out
