"""Lightning callbacks for opacus-structured (accounting, individual GDP filter, per-sample ε).

Import ``lightning.pytorch`` (the namespace gluonts uses), not ``pytorch_lightning``.
"""

from .batch_indices import FullBatchSampler, RecordingBatchSampler
from .dp_callback import DPCallback
from .gdp_filter import IndividualGDPFilter
from .per_sample_epsilon import PerSampleEpsilonTracker

__all__ = ["DPCallback", "IndividualGDPFilter", "PerSampleEpsilonTracker", "FullBatchSampler",
           "RecordingBatchSampler"]
