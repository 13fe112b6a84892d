"""The package's warnings are reported at the user's line, not inside the package, contextlib
or Lightning (issue 41: ``DatasetSizeFromDataWarning`` was reported at ``contextlib.py:81``)."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured
from opacus_structured import _warnings
from opacus_structured.samplers import public_sizes
from opacus_structured.samplers.public_sizes import DatasetSizeFromDataWarning


@pytest.fixture(autouse=True)
def _fresh_once_per_process_warnings():
    saved = set(public_sizes._warned)
    public_sizes._warned.clear()
    yield
    public_sizes._warned.clear()
    public_sizes._warned.update(saved)


def _ours(caught, category):
    return [w for w in caught if issubclass(w.category, category)]


def test_make_private_warnings_name_this_file():
    data = TensorDataset(torch.zeros(64, 2), torch.zeros(64, dtype=torch.long))
    model = nn.Linear(2, 2)
    engine = PrivacyEngine(accountant="truncated-poisson")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opacus_structured.make_private(
            engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0,
            max_grad_norm=1.0, epochs=1, discretization=1e-3)
    size = _ours(caught, DatasetSizeFromDataWarning)
    chosen = [w for w in caught if "max_batch_size=" in str(w.message)]
    assert len(size) == 1 and len(chosen) == 1
    for w in size + chosen:
        assert w.filename == __file__, (w.filename, w.lineno)


# A warning's stack level from a forecaster training (no privacy bound).
@pytest.mark.slow  # 2 s: out of the README command (issue 41: <= 5 min); CI runs it
def test_train_forecaster_warning_names_this_file():
    pytest.importorskip("gluonts")
    from opacus_structured.forecasting.data import Panel
    from opacus_structured.forecasting.training import train_forecaster

    rng = np.random.default_rng(0)
    panel = Panel(targets=tuple(rng.uniform(5, 10, 48).astype(np.float32) for _ in range(6)),
                  starts=tuple(pd.Period("2000-01", "M") for _ in range(6)),
                  item_ids=tuple(f"s{i}" for i in range(6)), freq="M")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_forecaster("dlinear", panel, prediction_length=4, context_length=8,
                         batch_size=2, max_steps=1, noise_multiplier=1.0, delta=1e-5, seed=0)
    size = _ours(caught, DatasetSizeFromDataWarning)
    assert len(size) == 1 and size[0].filename == __file__, [
        (w.filename, w.lineno) for w in size]


def test_caller_stacklevel_walks_out_of_the_package():
    def user_line():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _warnings.warn("from inside", UserWarning)  # a package frame calls warnings.warn
        return caught

    (w,) = user_line()
    assert w.filename == __file__ and str(w.message) == "from inside"
