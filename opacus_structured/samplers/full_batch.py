r"""Full-batch sampler: the sampler that :class:`~opacus_structured.schemes.gdp.GDPScheme` prices.

Exact semantics of :class:`FullBatchSampler` (full-batch DP-GD):

* every step yields **every** index ``0, 1, …, N−1`` of the dataset, in this order (no
  subsampling, no shuffling; ``N = num_samples``);
* an epoch is one step (``len(sampler) = 1``), so Opacus' hook reports
  ``sample_rate = 1 / len(data_loader) = 1``, the rate :class:`GDPScheme` expects;
* ``expected_batch_size = N``: the fixed public normaliser of the clipped sum (the realised
  batch size is public here, it is always N);
* nothing is random: the state (:meth:`FullBatchSampler.state_dict`) is only the dataset size,
  which a resumed run must share.

Registered as ``GDPScheme``'s sampler, so ``GDPScheme().sampler(n)`` builds it (and
``DPCallback(scheme=GDPScheme())`` installs it). Valid accountant: the one the registry names for
``GDPScheme`` (the Gaussian mechanism with sensitivity C composed T times:
:math:`\sqrt{T}/\sigma`-GDP), and the individual GDP filter and tracker of Koskela, Tobaben &
Honkela, "Individual Privacy Accounting with Gaussian Differential Privacy" (ICLR 2023, arXiv:2209.15596),
whose Theorem 1 is stated for exactly this setting.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import Sampler

from .._validation import check_int
from ..schemes.base import Scheme
from ..schemes.gdp import GDPScheme
from ..schemes.registry import register_sampler
from ._generator import resolve_generator
from .verification import DrawLedger, adopt_scheme

__all__ = ["FullBatchSampler"]


class FullBatchSampler(DrawLedger, Sampler[list[int]]):
    """Full-batch DP-GD: ``len() == 1``; the one batch is every index ``0..num_samples-1``
    (see the module docstring).

    Args:
        num_samples: dataset size N (>= 1).
        scheme: the scheme the sampler carries (``scheme`` attribute); default ``GDPScheme()``.
            Any scheme given must draw the batches ``GDPScheme()`` draws.
    """

    def __init__(self, num_samples: int, *, scheme: Optional[Scheme] = None):
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.expected_batch_size = self.num_samples
        self.scheme = adopt_scheme(scheme, GDPScheme(), "FullBatchSampler")
        self.draws = 0  # batches drawn so far in the run (the next draw's global index)
        self._freeze_law()

    #: frozen at construction, checked before every draw
    _LAW = ("num_samples",)

    def __len__(self) -> int:
        return 1

    def __iter__(self):
        self._check_law()
        self._begin_draws()
        self.draws += 1
        self._count_draw(self.draws - 1, self.num_samples)
        yield list(range(self.num_samples))

    def state_dict(self) -> dict:
        """``{"num_samples": N, "draws": d}``: nothing is random; ``draws`` is the position in
        the run (the privacy ledger's draw index)."""
        return {"num_samples": self.num_samples, "draws": self.draws}

    def load_state_dict(self, state_dict) -> None:
        """Check that ``state_dict`` was saved by a sampler of the same dataset size."""
        n = state_dict.get("num_samples") if isinstance(state_dict, dict) else None
        if n != self.num_samples:
            raise ValueError(f"sampler state is for num_samples={n!r} but this sampler has "
                             f"num_samples={self.num_samples}")
        self.draws = int(state_dict.get("draws", self.draws))

    def __repr__(self) -> str:
        return f"FullBatchSampler(num_samples={self.num_samples})"


@register_sampler(GDPScheme)
def full_batch_sampler(scheme, num_samples: int, *, generator: Optional[torch.Generator] = None,
                       seed: Optional[int] = None) -> FullBatchSampler:
    """``scheme.sampler(num_samples)`` for :class:`GDPScheme` (the sampler carries ``scheme``).

    ``generator`` and ``seed`` are accepted for the common ``sampler(...)`` signature and
    checked like every sampler's, but draw nothing: every batch is the whole dataset.
    """
    resolve_generator(generator, seed, "FullBatchSampler")
    return FullBatchSampler(num_samples, scheme=scheme)
