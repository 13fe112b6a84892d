"""Truncated Poisson batch sampler with padding to a fixed batch shape (Ganesh 2025, Alg. 1).

Exact semantics of :class:`TruncatedPoissonSampler` (one step):

1. every index ``i`` in ``0..n-1`` joins the candidate set S independently with probability
   ``sample_rate`` = p (a fresh ``torch.rand(n) < p`` mask);
2. if ``|S| > B`` (``max_batch_size``), a **uniformly random** size-B subset of S is kept
   (``torch.randperm``; keeping "the first B" would not be covered by the analysis);
3. the kept indices (sorted) are followed by ``B - |S|`` copies of :attr:`padding_index` (= n),
   so every batch has exactly B entries (``pad=False`` yields the unpadded, possibly empty list).

So an index is in a batch with probability ``p·w₁ + q·w₂ = E[min(Bin(n,p), B)]/n``, the number of
real rows is ``min(Bin(n, p), B)``, and the batch *shape* is always B. Padding slots must
contribute nothing to the clipped gradient sum: wrap the dataset in :class:`PaddedDataset`
(index n returns a dummy item and every item carries a 0/1 ``mask``) and multiply the per-sample
loss by the mask (:func:`masked_loss`). Then a padded row's per-sample gradient is exactly zero,
clipping keeps it zero, and the noisy sum equals the sum over real rows plus noise. Normalise by
a fixed public constant (e.g. ``DPOptimizer(expected_batch_size=B, loss_reduction="mean")`` with
``GradSampleModule(loss_reduction="sum")``), never by the realised number of real rows.

Valid accountant: :class:`~opacus_structured.accountants.TruncatedPoissonAccountant` with
``sampler.scheme`` (Theorem 3.1 for add/remove with :math:`|D| = n`; 3.3 / 3.4 for zero-out /
replace-one). An "epoch" is ``steps`` draws (default ``floor(1/p)``); draws are independent
across steps, and the seeded :class:`torch.Generator` state is saved by :meth:`state_dict`, so
a resumed run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..accounting.truncated_poisson import expected_batch_size
from ..schemes.registry import register_sampler
from ..schemes.truncated_poisson import TruncatedPoissonScheme
from ._generator import fresh_seed as _fresh_seed  # noqa: F401
from ._generator import resolve_generator
from ._resumable import EpochResumableSampler
from .verification import adopt_scheme, check_dataset_size

__all__ = ["TruncatedPoissonSampler", "PaddedDataset", "masked_loss",
           "truncated_poisson_data_loader"]


class TruncatedPoissonSampler(EpochResumableSampler, Sampler[list[int]]):
    """Poisson(p) batches truncated to a uniform random B-subset and padded to exactly B.

    Args:
        num_samples: dataset size n (>= 1); real indices are ``0..n-1``.
        sample_rate: Poisson inclusion probability p in (0, 1].
        max_batch_size: B in [1, n].
        steps: batches per epoch (``len(sampler)``); default ``floor(1/p)``.
        generator: dedicated :class:`torch.Generator` (exclusive with ``seed``).
        seed: seed of a new generator; default a fresh OS-random seed.
        pad: pad every batch to B entries with :attr:`padding_index` (default True).

    Attributes:
        scheme: the :class:`TruncatedPoissonScheme` (add/remove, tight) this sampler implements;
            build the accountant from it (``TruncatedPoissonAccountant(sampler.scheme)``).

    ``num_samples``, ``sample_rate``, ``max_batch_size``, ``steps`` and ``pad`` are fixed once
    built: a draw after one was changed raises
    :class:`~.verification.SamplerParametersChangedError`.
    """

    def __init__(self, num_samples: int, sample_rate: float, max_batch_size: int, *,
                 steps: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 seed: Optional[int] = None, pad: bool = True,
                 scheme: Optional[TruncatedPoissonScheme] = None):
        own = TruncatedPoissonScheme(dataset_size=num_samples, sample_rate=sample_rate,
                                     max_batch_size=max_batch_size, epoch_steps=steps)
        self.scheme = scheme = adopt_scheme(scheme, own, "TruncatedPoissonSampler")
        self.num_samples = scheme.dataset_size
        self.sample_rate = scheme.sample_rate
        self.max_batch_size = scheme.max_batch_size
        self.steps = scheme.steps_per_epoch()
        self.pad = bool(pad)
        self.generator = resolve_generator(generator, seed, "TruncatedPoissonSampler")
        self.epoch = 0
        self._position = 0
        self._pending: Optional[dict] = None
        self._freeze_law()

    @property
    def padding_index(self) -> int:
        """Index used for padding slots (= n, out of range for the unwrapped dataset)."""
        return self.num_samples

    @property
    def expected_batch_size(self) -> float:
        """E[number of real rows] = E[min(Bin(n, p), B)]."""
        return expected_batch_size(self.num_samples, self.sample_rate, self.max_batch_size)

    def __len__(self) -> int:
        return self.steps

    def draw(self) -> list[int]:
        """One batch (advances the generator): sorted kept indices, then padding."""
        mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
        idx = mask.nonzero(as_tuple=False).reshape(-1)
        if idx.numel() > self.max_batch_size:
            keep = torch.randperm(idx.numel(), generator=self.generator)[: self.max_batch_size]
            idx = idx[keep].sort().values
        batch = idx.tolist()
        if self.pad:
            batch.extend([self.padding_index] * (self.max_batch_size - len(batch)))
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        self._resume()
        while self._position < self.steps:
            self._check_law()
            batch = self.draw()
            self._advance(len(batch))
            yield batch

    # ---- state -------------------------------------------------------------------------------
    _KEYS = ("num_samples", "sample_rate", "max_batch_size", "steps", "pad")
    _LAW = _KEYS  # frozen at construction, checked before every draw

    def state_dict(self) -> dict[str, Any]:
        """State *between* draws: generator state, position in the epoch, completed epochs."""
        return self._epoch_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` continues where it left off."""
        self._stage(state_dict)

    def __repr__(self) -> str:
        return (f"TruncatedPoissonSampler(num_samples={self.num_samples}, "
                f"sample_rate={self.sample_rate}, max_batch_size={self.max_batch_size}, "
                f"steps={self.steps}, pad={self.pad})")


@register_sampler(TruncatedPoissonScheme)
def truncated_poisson_sampler(scheme: TruncatedPoissonScheme, num_samples: Optional[int] = None,
                              *, generator=None, seed=None,
                              pad: bool = True) -> TruncatedPoissonSampler:
    """``scheme.sampler([num_samples], ...)``: exactly this scheme's batches (``len`` =
    ``scheme.steps_per_epoch()``); the sampler carries ``scheme`` (relation, analysis).
    ``num_samples``, if given, must be the scheme's ``dataset_size``."""
    check_dataset_size(num_samples, scheme.dataset_size, scheme.name)
    return TruncatedPoissonSampler(scheme.dataset_size, scheme.sample_rate, scheme.max_batch_size,
                                   steps=scheme.steps_per_epoch(), generator=generator, seed=seed,
                                   pad=pad, scheme=scheme)


def _zeros_like(item):
    if isinstance(item, torch.Tensor):
        return torch.zeros_like(item)
    if isinstance(item, (bool, int, float)):
        return type(item)(0)
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return type(item)(*(_zeros_like(x) for x in item))
    if isinstance(item, (tuple, list)):
        return type(item)(_zeros_like(x) for x in item)
    if isinstance(item, dict):
        return {k: _zeros_like(v) for k, v in item.items()}
    if dataclasses.is_dataclass(item):
        return dataclasses.replace(item, **{f.name: _zeros_like(getattr(item, f.name))
                                            for f in dataclasses.fields(item)})
    raise ValueError(f"cannot build a zero padding item from {type(item).__name__}; pass "
                     f"padding_item= to PaddedDataset")


class PaddedDataset(Dataset):
    """Adds a 0/1 mask to every item and serves padding slots (index ``len(dataset)``).

    ``PaddedDataset(ds)[i]`` is ``(*ds[i], mask)`` for tuple/list items (``mask`` a float tensor:
    1.0 for real rows, 0.0 for padding), ``{**ds[i], "mask": mask}`` for dict items and
    ``(ds[i], mask)`` otherwise. Index ``len(ds)`` returns ``padding_item`` (default: a zero-filled
    copy of the structure of ``ds[0]``; its content never matters because its loss is multiplied
    by 0). ``len(PaddedDataset(ds)) == len(ds)``, so the sampler and Opacus see n examples.
    """

    def __init__(self, dataset, padding_item: Any = None, mask_key: str = "mask"):
        self.dataset = dataset
        self.mask_key = mask_key
        if len(dataset) < 1:
            raise ValueError("PaddedDataset needs a non-empty dataset")
        self.padding_item = _zeros_like(dataset[0]) if padding_item is None else padding_item

    def __len__(self) -> int:
        return len(self.dataset)

    def _with_mask(self, item, value: float):
        mask = torch.tensor(value)
        if isinstance(item, dict):
            return {**item, self.mask_key: mask}
        if isinstance(item, (tuple, list)) and not hasattr(item, "_fields"):
            return (*item, mask)
        return (item, mask)

    def __getitem__(self, index: int):
        n = len(self.dataset)
        if index == n:
            return self._with_mask(self.padding_item, 0.0)
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for PaddedDataset of size {n} "
                             f"(padding index is {n})")
        return self._with_mask(self.dataset[index], 1.0)


def masked_loss(per_sample_loss: torch.Tensor, mask: torch.Tensor,
                normalizer: Optional[float] = None) -> torch.Tensor:
    """``sum_i mask_i * loss_i`` (divided by the public constant ``normalizer`` if given).

    Use with ``reduction="none"`` losses. Padded rows (mask 0) get an exactly-zero per-sample
    gradient. Never divide by ``mask.sum()`` (the realised batch size is private).
    """
    if per_sample_loss.shape[0] != mask.shape[0]:
        raise ValueError(f"per_sample_loss has {per_sample_loss.shape[0]} rows but mask has "
                         f"{mask.shape[0]}")
    loss = per_sample_loss.reshape(per_sample_loss.shape[0], -1).sum(dim=1)
    total = (loss * mask.to(loss.dtype)).sum()
    return total if normalizer is None else total / float(normalizer)


def truncated_poisson_data_loader(dataset, sample_rate: float, max_batch_size: int, *,
                                  steps: Optional[int] = None,
                                  generator: Optional[torch.Generator] = None,
                                  seed: Optional[int] = None, padding_item: Any = None,
                                  **kwargs) -> DataLoader:
    """A DataLoader of fixed-shape truncated Poisson batches ``(*fields, mask)``.

    Wraps ``dataset`` in :class:`PaddedDataset` and drives it with a
    :class:`TruncatedPoissonSampler` (``loader.batch_sampler``; its ``scheme`` prices the run).
    ``kwargs`` go to :class:`torch.utils.data.DataLoader` (e.g. ``collate_fn``, ``num_workers``).
    """
    sampler = TruncatedPoissonSampler(len(dataset), sample_rate, max_batch_size, steps=steps,
                                      generator=generator, seed=seed, pad=True)
    return DataLoader(PaddedDataset(dataset, padding_item=padding_item), batch_sampler=sampler,
                      **kwargs)
