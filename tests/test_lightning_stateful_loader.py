"""DPCallback's train loader implements Lightning's stateful-loader protocol (issue 31, item 4):
a mid-epoch resume is exact by Lightning's own mechanism and Lightning does not warn that the
loader is not resumable."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")
from lightning.fabric.utilities.types import _Stateful  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

from lightning_callbacks.dp_callback import DPCallback  # noqa: E402
from lightning_callbacks.dp_loader import ResumableDPDataLoader  # noqa: E402
from opacus_structured.schemes.poisson import PoissonScheme  # noqa: E402


def _data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 32, generator=g)), batch_size=8)


class Boring(BoringModel):
    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()


def _fit(cb, max_steps, **kwargs):
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[cb, *kwargs.pop("callbacks", [])],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", num_sanity_val_steps=0, limit_val_batches=0,
                         **kwargs)
    return trainer


def _callback(seed):
    return DPCallback(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0,
                      scheme=PoissonScheme(sample_rate=1 / 8), seed=seed, discretization=1e-3)


def test_mid_epoch_resume_is_lightnings_own_and_exact(tmp_path):
    torch.manual_seed(0)
    model_a, cb_a = Boring(), _callback(3)
    _fit(cb_a, 12).fit(model_a, _data())
    # the same run stopped at step 3 (its last release: a resume there provably continues it)
    torch.manual_seed(0)
    model_s, cb_s = Boring(), _callback(3)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1,
                           filename="{step}")
    trainer_a = _fit(cb_s, 3, callbacks=[ckpt])
    trainer_a.fit(model_s, _data())
    loader = trainer_a.fit_loop._combined_loader.flattened[0]
    assert isinstance(loader, ResumableDPDataLoader) and isinstance(loader, _Stateful)
    path = os.path.join(tmp_path, "step=3.ckpt")
    saved = torch.load(path, weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] == 3

    torch.manual_seed(1)
    model_b, cb_b = Boring(), _callback(999)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(cb_b, 12).fit(model_b, _data(), ckpt_path=path)
    assert not [w for w in caught if "not resumable" in str(w.message)]
    assert cb_b.steps == cb_a.steps == 12
    assert cb_b.epsilon() == cb_a.epsilon()
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b)
