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


# ---- torch's own warnings inside a loop on row-tagged batches (issue 46) --------------------
def _tagged():
    from opacus_structured.samplers.row_provenance import tag_batch

    return tag_batch(torch.randn(5, 3), draw=0)


def _lines_of(caught, text):
    return [(w.filename, w.lineno) for w in caught if text in str(w.message)]


def test_torch_warnings_on_tagged_rows_name_the_user_s_line():
    """A C++ ``TORCH_WARN`` (``new_tensor`` of a tensor) and a Python ``warnings.warn(...,
    stacklevel=2)`` of ``torch.nn.functional`` (softmax without ``dim``), raised inside the
    ``__torch_function__`` of the row tokens, are reported at the user's line, as for a plain
    tensor."""
    import inspect

    x, plain = _tagged(), torch.randn(5, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        here = inspect.currentframe().f_lineno
        x.new_tensor(x)
        plain.new_tensor(plain)
        torch.nn.functional.softmax(x)
        torch.nn.functional.softmax(plain)
    assert _lines_of(caught, "copy construct") == [(__file__, here + 1), (__file__, here + 2)]
    assert _lines_of(caught, "Implicit dimension") == [(__file__, here + 3),
                                                       (__file__, here + 4)]


def test_torch_warnings_keep_the_user_s_filters_and_once_per_line():
    """The user's filters apply at the user's line: ``"default"`` shows a warning once per line
    (two lines: twice; a loop on one line: once), ``"ignore"`` for the user's module hides it,
    ``"error"`` raises at the operation; ``warnings`` is left as it was."""
    x = _tagged()
    before = (warnings.showwarning, list(warnings.filters))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        globals().pop("__warningregistry__", None)
        for _ in range(3):
            x.new_tensor(x)
        x.new_tensor(x)
    assert len(_lines_of(caught, "copy construct")) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module=__name__)
        x.new_tensor(x)
    assert not caught
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="copy construct"):
            x.new_tensor(x)
    assert (warnings.showwarning, list(warnings.filters)) == before


def _python_op(t, stacklevel):
    """A torch-style Python function (dispatched through ``handle_torch_function``, as
    ``torch.nn.functional``'s are) that warns at ``stacklevel``."""
    if torch.overrides.has_torch_function((t,)):
        return torch.overrides.handle_torch_function(_python_op, (t,), t, stacklevel)
    warnings.warn(f"op at stacklevel {stacklevel}", UserWarning, stacklevel=stacklevel)
    return t + 1


def test_python_dispatch_warnings_keep_their_stack_level():
    """Through ``handle_torch_function``: ``stacklevel=2`` names the caller of the function
    (the user's line, as for a plain tensor); ``stacklevel=1`` names the function's own line,
    which is not the package's and is left alone."""
    import inspect

    x = _tagged()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        here = inspect.currentframe().f_lineno
        _python_op(x, 2)
        _python_op(torch.randn(5, 3), 2)
        _python_op(x, 1)
        _python_op(torch.randn(5, 3), 1)
    own = inspect.getsourcelines(_python_op)[1] + 5  # its warnings.warn line
    assert _lines_of(caught, "stacklevel 2") == [(__file__, here + 1), (__file__, here + 2)]
    assert _lines_of(caught, "stacklevel 1") == [(__file__, own), (__file__, own)]
