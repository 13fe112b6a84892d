"""Poisson batch sampler: the sampler that :class:`~opacus_structured.schemes.PoissonScheme` prices.

Exact semantics (what :class:`PoissonBatchSampler` draws):

* at every step, each of the ``num_samples`` dataset indices joins the batch **independently**
  with probability ``sample_rate`` = q (a fresh ``torch.rand(num_samples) < q`` mask per step);
* batch sizes therefore vary (Binomial(n, q)); a batch may be **empty** — a DataLoader built on
  this sampler must collate empty batches, e.g. with
  ``opacus.data_loader.wrap_collate_with_empty`` (see :func:`poisson_data_loader`), exactly as
  Opacus' ``DPDataLoader`` does;
* an "epoch" is ``steps`` such draws (default ``floor(1/q)``, the same as Opacus'
  ``UniformWithReplacementSampler``, so ``1/len(sampler) >= q``: the rate Opacus' hook reports
  is never smaller than q);
* the valid accountant is the Poisson-subsampled Gaussian accountant under the add/remove
  relation (:class:`~opacus_structured.accountants.PoissonAccountant`, or
  ``SchemeAccountant(sampler.scheme)``); Opacus' ``"rdp"``/``"prv"`` price the same mechanism.

It is the same distribution as Opacus' ``UniformWithReplacementSampler`` (despite that name,
Poisson sampling), plus a ``scheme`` attribute, input validation and resumable state: a
dedicated seeded :class:`torch.Generator` drives the draws and :meth:`state_dict` records the
generator state *between* draws and the position in the epoch, so a run restored with
:meth:`load_state_dict` draws exactly the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Sampler

from .._validation import check_int, check_probability
from ..schemes.poisson import PoissonScheme
from ..schemes.registry import register_sampler
from ._generator import fresh_seed as _fresh_seed  # noqa: F401
from ._generator import resolve_generator
from ._resumable import EpochResumableSampler
from .verification import adopt_scheme

__all__ = ["PoissonBatchSampler", "poisson_data_loader", "default_steps"]


def default_steps(sample_rate: float) -> int:
    """``floor(1/q)`` steps per epoch (Opacus' convention), robust to float round-off."""
    q = check_probability("sample_rate", sample_rate)
    return max(1, math.floor(1.0 / q + 1e-9))



class PoissonBatchSampler(EpochResumableSampler, Sampler[list[int]]):
    """Poisson subsampling: every index joins each batch independently with probability q.

    Args:
        num_samples: dataset size n (indices ``0..n-1`` are sampled), >= 1.
        sample_rate: inclusion probability q in (0, 1].
        steps: batches per epoch (``len(sampler)``); default ``floor(1/q)``.
        generator: a dedicated :class:`torch.Generator` (do not share it with other consumers,
            or resumption cannot be exact). Mutually exclusive with ``seed``.
        seed: seed of a new generator; default a fresh OS-random seed.

    Attributes:
        scheme: ``PoissonScheme(sample_rate=q)``, the scheme whose accountant is valid.

    ``num_samples``, ``sample_rate`` and ``steps`` are fixed once built: a draw after one was
    changed raises :class:`~.verification.SamplerParametersChangedError` (build a new sampler
    for a new rate).
    """

    def __init__(self, num_samples: int, sample_rate: float, *, steps: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 scheme: Optional[PoissonScheme] = None):
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.sample_rate = check_probability("sample_rate", sample_rate)
        self.steps = default_steps(self.sample_rate) if steps is None else check_int(
            "steps", steps, minimum=1)
        self.generator = resolve_generator(generator, seed, "PoissonBatchSampler")
        self.scheme = adopt_scheme(scheme, PoissonScheme(sample_rate=self.sample_rate),
                                   "PoissonBatchSampler")
        self.epoch = 0            # completed epochs
        self._position = 0        # batches drawn in the current epoch
        self._pending: Optional[dict] = None  # loaded state not yet resumed from
        self._freeze_law()

    @classmethod
    def from_scheme(cls, scheme: PoissonScheme, num_samples: int, *,
                    steps: Optional[int] = None, generator: Optional[torch.Generator] = None,
                    seed: Optional[int] = None) -> "PoissonBatchSampler":
        """``PoissonScheme(q).sampler(num_samples, ...)``: this sampler at the scheme's rate."""
        if scheme.sample_rate is None:
            raise ValueError("PoissonScheme.sampler needs sample_rate to be set")
        return cls(num_samples, scheme.sample_rate, steps=steps, generator=generator, seed=seed,
                   scheme=scheme)

    @property
    def expected_batch_size(self) -> float:
        """E[batch size] = n q (the denominator Opacus' mean reduction uses is ``int(n q)``)."""
        return self.num_samples * self.sample_rate

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        self._resume()
        while self._position < self.steps:
            self._check_law()
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            batch = mask.nonzero(as_tuple=False).reshape(-1).tolist()
            self._advance(len(batch))
            yield batch

    # ---- state ---------------------------------------------------------------------------
    _KEYS = ("num_samples", "sample_rate", "steps")
    _LAW = _KEYS  # frozen at construction, checked before every draw

    def state_dict(self) -> dict[str, Any]:
        """State *between* draws: generator state, position in the epoch, completed epochs.

        Taken after the last batch of an epoch it describes the start of the next epoch.
        """
        return self._epoch_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` continues where it left off."""
        self._stage(state_dict)

    def __repr__(self) -> str:
        return (f"PoissonBatchSampler(num_samples={self.num_samples}, "
                f"sample_rate={self.sample_rate}, steps={self.steps})")


register_sampler(PoissonScheme)(PoissonBatchSampler.from_scheme)


def poisson_data_loader(dataset, sample_rate: float, *, steps: Optional[int] = None,
                        generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                        collate_fn=None, **kwargs) -> DataLoader:
    """A DataLoader drawing Poisson batches, with Opacus' empty-batch collate wrapper.

    Equivalent to Opacus' ``DPDataLoader`` but with a resumable :class:`PoissonBatchSampler`
    (``loader.batch_sampler``). ``kwargs`` go to :class:`torch.utils.data.DataLoader`.
    """
    from opacus.data_loader import wrap_collate_with_empty
    from torch.utils.data._utils.collate import default_collate

    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps=steps, generator=generator,
                                  seed=seed)
    return DataLoader(dataset, batch_sampler=sampler,
                      collate_fn=wrap_collate_with_empty(collate_fn=collate_fn or default_collate),
                      **kwargs)
