"""Tiny seeded data, a small model and plain training loops shared by the tests of issue 46
(make_private, co-releases, phases, the noise lineage, the release rows)."""

from __future__ import annotations

from typing import Optional

import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured


def xy_dataset(n: int, features: int, *, index: bool = False) -> TensorDataset:
    """``n`` rows of standard-normal features and 0/1 labels from a generator seeded 0 (and each
    row's index as a third tensor with ``index``)."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, features, generator=g), torch.randint(0, 2, (n,), generator=g)]
    if index:
        tensors.append(torch.arange(n))
    return TensorDataset(*tensors)


def small_mlp() -> nn.Module:
    """A 4-8-2 ReLU classifier, built after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def step_modules(x, y, modules, optimizers, order=None) -> None:
    """One step of ``modules`` chained (each made private with its optimizer): zero every
    optimizer's gradients, cross-entropy of the chain's output (``0 · sum`` for an empty
    batch), backward, then step the optimizers (in ``order`` if given)."""
    for o in optimizers:
        o.zero_grad()
    out = x
    for m in modules:
        out = m(out)
    (nn.functional.cross_entropy(out, y) if len(x) else out.sum() * 0).backward()
    for o in (order or optimizers):
        o.step()


def train(model, optimizer, loader, *, steps: Optional[int] = None,
          epochs: Optional[int] = None) -> int:
    """Train ``model`` on ``(x, y)`` batches for ``steps`` steps (over as many epochs as that
    takes) or ``epochs`` epochs; an empty batch steps without a backward. Returns the steps."""
    done = epoch = 0
    while (steps is None or done < steps) and (epochs is None or epoch < epochs):
        for x, y in loader:
            optimizer.zero_grad()
            if len(x):
                nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                return done
        epoch += 1
    return done


def private_linear(dataset: TensorDataset, batch_size: int, *, seed: int, **kwargs):
    """``(engine, model, optimizer, loader)``: an ``nn.Linear(features, 2)`` built after
    ``torch.manual_seed(0)``, SGD (lr 0.1), made private by ``make_private`` under a Poisson
    accountant on ``DataLoader(dataset, batch_size)``, its sampler seeded ``seed``; ``kwargs``
    go to ``make_private`` (``noise_multiplier``, ``max_grad_norm``, ...)."""
    torch.manual_seed(0)
    model = nn.Linear(dataset.tensors[0].shape[1], 2)
    engine = PrivacyEngine(accountant="poisson")
    model, optimizer, loader = opacus_structured.make_private(
        engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset, batch_size=batch_size),
        sampler_generator=torch.Generator().manual_seed(seed), **kwargs)
    return engine, model, optimizer, loader
