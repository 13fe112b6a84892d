"""Tiny gluonts estimators shared by the DPEstimator tests (a few hundred parameters, so a
training step takes milliseconds). Import after ``pytest.importorskip("gluonts")``."""

from gluonts.torch.model.d_linear import DLinearEstimator
from gluonts.torch.model.deepar import DeepAREstimator

H = 6  # prediction length of the tests


def tiny_dlinear(**kw):
    return DLinearEstimator(**{**dict(prediction_length=H, context_length=8, hidden_dimension=2,
                                      kernel_size=5, batch_size=4), **kw})


def tiny_deepar(**kw):
    return DeepAREstimator(**{**dict(freq="M", prediction_length=H, context_length=8,
                                     num_layers=1, hidden_size=4, dropout_rate=0.0,
                                     lags_seq=[1, 2, 12], num_parallel_samples=10,
                                     batch_size=4), **kw})
