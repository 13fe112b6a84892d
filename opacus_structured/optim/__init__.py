"""Correlated-noise (matrix-factorization) optimizer and strategy matrices.

``strategies`` is numpy-only; the optimizer modules import torch/opacus.
"""

from . import strategies
from .correlated_noise import CorrelatedNoiseDPOptimizer
from .privacy_engine import CorrelatedNoisePrivacyEngine

__all__ = ["strategies", "CorrelatedNoiseDPOptimizer", "CorrelatedNoisePrivacyEngine"]
