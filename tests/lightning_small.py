"""A small LightningModule, a ``fit`` helper and a noise spy shared by the Lightning tests of
issue 46 (restores, phases, the dataset budget, accumulation)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def small_module(width_in: int = 3, seed: int = 0):
    """A one-layer classifier that trains on ``(x, y)`` batches, empty ones included."""
    pl = pytest.importorskip("lightning.pytorch")

    class Small(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(width_in, 2)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self.layer(x), y) if len(x) else \
                self.layer.weight.sum() * 0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(seed)
    return Small()


def fit(cb, module, loader, max_steps: int, *, dirpath=None, every=None, ckpt_path=None):
    """``Trainer(max_steps=...).fit`` with ``cb`` (and a ``ModelCheckpoint`` every ``every``
    steps into ``dirpath``, files ``step=N.ckpt``), resuming from ``ckpt_path`` if given."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = [cb]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every,
                                         save_top_k=-1, filename="{step}"))
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                         callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=bool(every),
                         num_sanity_val_steps=0)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def spy_noise(monkeypatch) -> list:
    """Record every noise tensor an Opacus DP optimizer draws (hooks and ghost clipping), in
    order; returns the list that fills as the optimizers draw."""
    import opacus.optimizers.optimizer as opacus_optimizer
    import opacus.optimizers.optimizer_fast_gradient_clipping as opacus_ghost

    drawn: list = []
    plain = opacus_optimizer._generate_noise

    def spy(std, reference, *args, **kwargs):
        z = plain(std, reference, *args, **kwargs)
        drawn.append(z.detach().clone())
        return z

    for where in (opacus_optimizer, opacus_ghost):
        monkeypatch.setattr(where, "_generate_noise", spy)
    return drawn
