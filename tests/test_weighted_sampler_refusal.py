"""Weighted or partial samplers are refused, not silently replaced (issue 31, item 5).

Opacus issue #813: a loader with ``WeightedRandomSampler(num_samples=128)`` and
``batch_size=16`` over 100,000 rows has ``len(loader) = 8``; replacing its sampler by uniform
Poisson sampling at q = 1/8 over every row gives batches of ~12,500 examples. Both our
``make_private`` / ``make_private_with_epsilon`` and ``DPCallback`` refuse such loaders with a
message saying what would happen and what to pass instead; plain, shuffled and sequential
loaders are still replaced.
"""

import warnings

import pytest
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import opacus_structured

warnings.filterwarnings("ignore", message="Secure RNG turned off")

ROWS = 100_000


def _data(n=ROWS):
    return TensorDataset(torch.zeros(n, 2), torch.zeros(n, dtype=torch.long))


def _issue_813_loader():
    data = _data()
    weights = torch.ones(ROWS)
    return DataLoader(data, batch_size=16,
                      sampler=WeightedRandomSampler(weights, num_samples=128))


def _partial_loaders():
    data = _data(1000)
    return {
        "weighted": DataLoader(data, batch_size=16, sampler=WeightedRandomSampler(
            torch.ones(1000), num_samples=1000)),
        "subset": DataLoader(data, batch_size=16, sampler=SubsetRandomSampler(range(200))),
        "random-num-samples": DataLoader(data, batch_size=16,
                                         sampler=RandomSampler(data, num_samples=300)),
        "random-replacement": DataLoader(data, batch_size=16,
                                         sampler=RandomSampler(data, replacement=True)),
    }


def _make_private(loader, **extra):
    model = nn.Linear(2, 2)
    kwargs = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  data_loader=loader, max_grad_norm=1.0, discretization=1e-3)
    kwargs.update(extra)
    return kwargs


def test_issue_813_loader_is_refused_by_make_private_with_the_batch_it_would_draw():
    assert len(_issue_813_loader()) == 8
    for fn, extra in ((opacus_structured.make_private, dict(noise_multiplier=1.0)),
                      (opacus_structured.make_private_with_epsilon,
                       dict(target_epsilon=2.0, target_delta=1e-5, epochs=1))):
        engine = PrivacyEngine(accountant="poisson")
        with pytest.raises(ValueError) as err:
            fn(engine, **_make_private(_issue_813_loader(), **extra))
        msg = str(err.value)
        assert fn.__name__ in msg
        assert "WeightedRandomSampler(num_samples=128)" in msg
        assert "1/8" in msg and "12500" in msg      # what would happen: 100000/8 per batch
        assert "Subset(dataset, indices)" in msg     # what to pass instead
        assert len(engine.accountant) == 0


@pytest.mark.parametrize("kind", sorted(_partial_loaders()))
def test_partial_or_weighted_samplers_are_refused(kind):
    loader = _partial_loaders()[kind]
    with pytest.raises(ValueError, match="would replace it"):
        opacus_structured.make_private(PrivacyEngine(accountant="poisson"),
                                       **_make_private(loader, noise_multiplier=1.0))


@pytest.mark.parametrize("sampler", [None, "shuffle", "sequential", "random-all"])
def test_uniform_loaders_are_still_replaced(sampler):
    data = _data(1000)
    loader = {None: lambda: DataLoader(data, batch_size=16),
              "shuffle": lambda: DataLoader(data, batch_size=16, shuffle=True),
              "sequential": lambda: DataLoader(data, batch_size=16,
                                               sampler=SequentialSampler(data)),
              "random-all": lambda: DataLoader(data, batch_size=16,
                                               sampler=RandomSampler(data))}[sampler]()
    engine = PrivacyEngine(accountant="poisson")
    _, _, dl = opacus_structured.make_private(engine,
                                              **_make_private(loader, noise_multiplier=1.0))
    assert engine.accountant.scheme.sample_rate == pytest.approx(1 / len(loader))


def test_dp_callback_refuses_the_issue_813_loader():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset

    from lightning_callbacks import DPCallback
    from opacus_structured.schemes.poisson import PoissonScheme

    data = RandomDataset(32, ROWS)
    loader = DataLoader(data, batch_size=16,
                        sampler=WeightedRandomSampler(torch.ones(ROWS), num_samples=128))
    dp = DPCallback(scheme=PoissonScheme(sample_rate=1 / 8), noise_multiplier=1.0,
                    max_grad_norm=1.0, delta=1e-5, discretization=1e-3, seed=0)
    trainer = pl.Trainer(max_steps=1, callbacks=[dp], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(ValueError) as err:
        trainer.fit(BoringModel(), loader)
    msg = str(err.value)
    assert msg.startswith("DPCallback") and "WeightedRandomSampler(num_samples=128)" in msg
    assert "12500" in msg and "Subset(dataset, indices)" in msg
    assert dp.steps == 0
