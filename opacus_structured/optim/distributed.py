"""Correlated (BandMF) noise under multi-process data parallelism.

Opacus' :class:`~opacus.optimizers.DistributedDPOptimizer` clips on every rank, adds the Gaussian
noise **on rank 0 only**, scales by ``1/expected_batch_size``, then all-reduces (sum, and
``/ world_size`` for ``loss_reduction="mean"``) before the inner step, so the global update is
``(Σ_r S_r + z_i) / (E_loc · W)``: one copy of the noise.

Mixing :class:`~opacus_structured.optim.correlated_noise.CorrelatedNoiseMixin` naively in front
of it would be wrong: the mixin's ``add_noise`` overrides the rank check and every rank would add
its own correlated noise (``W`` copies). :class:`DistributedCorrelatedNoiseDPOptimizer` keeps
Opacus' semantics:

* rank 0 adds ``w_i = (C^{-1} Z)_i`` (the banded recursion of the mixin, same generator call
  as the single-process optimizer, so with the same ``generator`` seed the global update is the
  single-process one up to float summation order); other ranks add nothing;
* the step counter ``noise_step`` advances on **every** rank (identical everywhere); the ring
  buffers are filled on rank 0 only (other ranks keep none: they never need past noise);
* :meth:`state_dict` carries the noise state as in the single-process optimizer. Save it from
  rank 0 (Lightning does); loading it on any rank is harmless (non-zero ranks ignore buffers),
  and a checkpoint moves between this optimizer and
  :class:`~opacus_structured.optim.correlated_noise.CorrelatedNoiseDPOptimizer`.

The privacy guarantee is the single-process one for the global batches (use
:class:`~opacus_structured.samplers.distributed.DistributedBatchSampler` so they are exactly
the single-process batches) and the same accountant. ``noise_correlation=None`` / ``[1.0]`` is
exactly ``DistributedDPOptimizer``.
"""

from __future__ import annotations

import opacus.optimizers as opacus_optimizers
from opacus.optimizers import DistributedDPOptimizer
from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
    DistributedDPOptimizerFastGradientClipping,
)

from .correlated_noise import DISTRIBUTED_VARIANTS, CorrelatedNoiseMixin

__all__ = ["DistributedCorrelatedNoiseDPOptimizer",
           "DistributedCorrelatedNoiseDPOptimizerFastGradientClipping",
           "adds_noise_once_across_ranks"]


class _RankZeroCorrelatedNoiseMixin(CorrelatedNoiseMixin):
    """Correlated noise added once, on rank 0, in front of an Opacus distributed optimizer."""

    def add_noise(self):
        """Rank 0: ``p.grad = p.summed_grad + w_i``; other ranks: ``p.grad = p.summed_grad``."""
        if self.rank == 0:
            CorrelatedNoiseMixin.add_noise(self)  # advances noise_step
            return
        self._check_clip_norm()  # every rank refuses a clip-norm change, not only rank 0
        for p in self.params:
            p.grad = p.summed_grad.view_as(p)
        self._advance()


class DistributedCorrelatedNoiseDPOptimizer(_RankZeroCorrelatedNoiseMixin, DistributedDPOptimizer):
    """``DistributedDPOptimizer`` with banded-Toeplitz correlated noise added once (rank 0).

    Args: as :class:`~opacus_structured.optim.correlated_noise.CorrelatedNoiseDPOptimizer`
    (``noise_correlation`` = first column ``c`` of ``C``). ``expected_batch_size`` is the
    **per-rank** normaliser ``E / world_size`` for ``loss_reduction="mean"`` (as Opacus'
    ``make_private(distributed=True)`` computes it). Needs an initialised process group.
    """


class DistributedCorrelatedNoiseDPOptimizerFastGradientClipping(
        _RankZeroCorrelatedNoiseMixin, DistributedDPOptimizerFastGradientClipping):
    """The same over Opacus' ``DistributedDPOptimizerFastGradientClipping`` (ghost clipping /
    book-keeping: the clipped sum is already in ``p.grad``)."""



DISTRIBUTED_VARIANTS[DistributedDPOptimizer] = DistributedCorrelatedNoiseDPOptimizer

def _opacus_distributed_bases() -> tuple[type, ...]:
    names = ("DistributedDPOptimizer", "DistributedPerLayerOptimizer",
             "SimpleDistributedPerLayerOptimizer", "DistributedDPOptimizerFastGradientClipping")
    found = tuple(getattr(opacus_optimizers, n) for n in names if hasattr(opacus_optimizers, n))
    return found + (DistributedDPOptimizerFastGradientClipping,)


def adds_noise_once_across_ranks(optimizer) -> bool:
    """Whether ``optimizer`` (an instance or a class) is safe under DDP: it adds the Gaussian
    noise once for the global batch (rank 0) and all-reduces, as Opacus' distributed optimizers
    and ours do. A single-process ``DPOptimizer`` under DDP would add ``world_size`` noise
    copies to the sum while the accountant prices one. Decided by the class hierarchy, not
    by the class name."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return issubclass(cls, _opacus_distributed_bases())
