"""Balls-in-bins batch sampler (random allocation with the bins reused every epoch).

Exact semantics of :class:`BallsInBinsBatchSampler` (Definition 2.7 of Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random Allocation"):

* once, at construction, every index gets an independent uniform bin in ``{0, …, T−1}``
  (``T = num_bins``); the bins are **never redrawn** and their order never changes;
* global step ``i`` (0-indexed, counted across epochs) yields exactly the indices of bin
  ``i mod T``: each example participates once per epoch, in the same position every epoch;
* batch sizes vary (Binomial(N, 1/T)); batches may be empty; ``len(sampler) = T``.

Valid accountants: ``balls-in-bins`` (:class:`~opacus_structured.schemes.balls_in_bins.
BallsInBinsScheme`, DP-SGD, priced by ``pld-accounting`` for the planned number of epochs; the
``scheme`` attribute) and, for correlated noise, the Monte Carlo / Rényi random-allocation
accountants. Independent assignment matters: "shuffle and cut into equal batches" is a different
scheme that these accountants do not cover.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._validation import check_int
from ..schemes.balls_in_bins import BallsInBinsScheme
from ..schemes.base import Scheme
from ..schemes.random_allocation_mf import RandomAllocationMFScheme
from ..schemes.registry import register_sampler
from ._mf_base import MFBatchSampler
from .verification import adopt_scheme

__all__ = ["BallsInBinsBatchSampler"]


class BallsInBinsBatchSampler(MFBatchSampler):
    """Balls-in-bins with ``num_bins`` bins, for ``epochs`` epochs (see module docstring)."""

    _params = ("num_samples", "num_bins", "epochs")
    _state_tensors = ("bins",)

    def __init__(self, num_samples: int, num_bins: int, *, epochs: int = 1,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 scheme: Optional[Scheme] = None):
        self.num_bins = check_int("num_bins", num_bins, minimum=1)
        self.epochs = check_int("epochs", epochs, minimum=1)
        self.scheme = adopt_scheme(scheme, BallsInBinsScheme(num_bins=self.num_bins,
                                                             epochs=self.epochs),
                                   "BallsInBinsBatchSampler")
        super().__init__(num_samples, steps=self.num_bins, generator=generator, seed=seed)
        self.bins = torch.randint(0, self.num_bins, (self.num_samples,), generator=self.generator)
        self._freeze_law()

    def _draw(self) -> list[int]:
        if self.step >= self.num_bins * self.epochs:
            raise RuntimeError(f"balls-in-bins sampler planned for {self.epochs} epochs is "
                               f"exhausted; its accountant does not cover more epochs")
        return (self.bins == self.step % self.num_bins).nonzero().reshape(-1).tolist()


@register_sampler(BallsInBinsScheme, RandomAllocationMFScheme)
def balls_in_bins_sampler(scheme, num_samples: int, *, generator=None,
                          seed=None) -> BallsInBinsBatchSampler:
    """``scheme.sampler(num_samples, ...)`` for balls-in-bins and random-allocation MF schemes
    (the same batches; the sampler carries ``scheme``)."""
    bins = (scheme.num_bins if isinstance(scheme, BallsInBinsScheme)
            else scheme.batches_per_epoch)
    return BallsInBinsBatchSampler(num_samples, bins, epochs=scheme.epochs, generator=generator,
                                   seed=seed, scheme=scheme)
