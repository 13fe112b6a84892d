"""Correlated-noise (matrix-factorization) optimizer and strategy matrices.

``strategies`` is numpy-only; the optimizer modules import torch/opacus.
"""

from . import strategies
from .correlated_noise import CorrelatedNoiseDPOptimizer, correlated_optimizer_class
from .distributed import DistributedCorrelatedNoiseDPOptimizer
from .ghost_clipping import (
                             CorrelatedNoiseDPOptimizerFastGradientClipping,
                             ghost_per_sample_norms,
                             set_clipping_mask,
)
from .privacy_engine import CorrelatedNoisePrivacyEngine
from .strategies import BufferedToeplitz, blt_strategy

__all__ = ["strategies", "CorrelatedNoiseDPOptimizer", "CorrelatedNoisePrivacyEngine",
           "correlated_optimizer_class", "DistributedCorrelatedNoiseDPOptimizer",
           "CorrelatedNoiseDPOptimizerFastGradientClipping", "ghost_per_sample_norms",
           "set_clipping_mask", "BufferedToeplitz", "blt_strategy"]
