"""Cyclic Poisson batch sampler (BandMF with amplification, Choquette-Choo et al. 2023).

Exact semantics of :class:`CyclicPoissonBatchSampler`:

* once, at construction, the ``num_samples`` indices are split into ``cycle_length = b`` groups:
  ``partition="equal"`` cuts a uniformly random permutation into ``b`` near-equal parts
  (sizes differ by at most 1); ``"independent"`` gives each index an independent uniform group;
* at global step ``i`` (0-indexed, counted across epochs) each index of group ``i mod b``
  joins the batch independently with probability ``q = b·B/N``; indices of other groups
  cannot appear. Batch sizes vary (Binomial); batches may be empty;
* an epoch is ``steps`` batches (default ``round(N/B)``, so Opacus' ``1/len`` ≈ ``B/N`` and its
  ``expected_batch_size`` ≈ ``B``); the cycle phase continues across epochs.

Valid accountant: ``bandmf-cyclic-poisson`` (:class:`~opacus_structured.schemes.
bandmf_cyclic_poisson.BandMFCyclicPoissonScheme`, which the ``scheme`` attribute holds) with a
``b``-banded strategy whose bands ≤ ``b``; with ``b = 1`` plain Poisson accounting.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._validation import check_int, check_positive
from ..schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme, default_steps_per_epoch
from ..schemes.registry import register_sampler
from ._mf_base import MFBatchSampler
from .verification import adopt_scheme, check_dataset_size

__all__ = ["CyclicPoissonBatchSampler"]


class CyclicPoissonBatchSampler(MFBatchSampler):
    """Cyclic Poisson sampling over ``cycle_length`` groups (see module docstring)."""

    _params = ("num_samples", "batch_size", "cycle_length", "partition", "steps")
    _LAW = ("sample_rate",)  # the rate each draw uses (q = b·B/N), frozen with _params
    _state_tensors = ("groups",)

    def __init__(self, num_samples: int, batch_size: float, cycle_length: int, *,
                 partition: str = "equal", steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 scheme: Optional[BandMFCyclicPoissonScheme] = None):
        self.scheme = adopt_scheme(
            scheme, BandMFCyclicPoissonScheme(dataset_size=num_samples, batch_size=batch_size,
                                              bands=cycle_length, partition=partition),
            "CyclicPoissonBatchSampler")
        self.batch_size = check_positive("batch_size", batch_size)
        self.cycle_length = check_int("cycle_length", cycle_length, minimum=1)
        self.partition = partition
        super().__init__(num_samples, generator=generator, seed=seed,
                         steps=default_steps_per_epoch(num_samples, batch_size)
                         if steps is None else steps)
        self.sample_rate = self.scheme.sample_rate
        if partition == "equal":
            perm = torch.randperm(self.num_samples, generator=self.generator)
            groups = torch.empty(self.num_samples, dtype=torch.int64)
            groups[perm] = torch.arange(self.num_samples) % self.cycle_length
        else:
            groups = torch.randint(0, self.cycle_length, (self.num_samples,),
                                   generator=self.generator)
        self.groups = groups
        self._freeze_law()

    def _draw(self) -> list[int]:
        members = (self.groups == self.step % self.cycle_length).nonzero().reshape(-1)
        keep = self._bernoulli(members.numel(), self.sample_rate)
        return members[keep].tolist()


@register_sampler(BandMFCyclicPoissonScheme)
def cyclic_poisson_sampler(scheme: BandMFCyclicPoissonScheme, num_samples: Optional[int] = None,
                           *, generator=None, seed=None,
                           steps: Optional[int] = None) -> CyclicPoissonBatchSampler:
    """``scheme.sampler([num_samples], ...)``: cyclic Poisson over the scheme's ``bands`` groups
    (``num_samples``, if given, must be the scheme's ``dataset_size``)."""
    check_dataset_size(num_samples, scheme.dataset_size, scheme.name)
    return CyclicPoissonBatchSampler(scheme.dataset_size, scheme.batch_size, scheme.bands,
                                     partition=scheme.partition, steps=steps,
                                     generator=generator, seed=seed, scheme=scheme)
