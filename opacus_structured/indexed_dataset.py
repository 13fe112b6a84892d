"""A dataset wrapper that passes each example's dataset index through the DataLoader.

Individual accounting (:class:`~opacus_structured.accountants.individual_gdp.IndividualGDPAccountant`,
the GDP filter and the per-sample ε tracker in :mod:`lightning_callbacks`) must know *which*
examples are in a batch to update the right rows of the per-example state.

``IndexedDataset(ds)[i]`` returns ``(*ds[i], i)`` when ``ds[i]`` is a tuple or list (e.g.
``(x, y, i)`` for a ``TensorDataset``) and ``(ds[i], i)`` otherwise; the index is a 0-d
``torch.int64`` tensor, so the default collate (and Opacus' ``DPDataLoader``, whose empty-batch
collate inspects ``dataset[0]``) produces a ``LongTensor`` of indices as the **last** element of
every batch. :func:`batch_indices` reads it back.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["IndexedDataset", "batch_indices"]


class IndexedDataset(Dataset):
    """Map-style dataset returning ``(*item, index)``; see the module docstring."""

    def __init__(self, dataset):
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ValueError("dataset must be a map-style dataset (with __getitem__ and __len__)")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        item = self.dataset[index]
        idx = torch.tensor(int(index), dtype=torch.int64)
        if isinstance(item, (tuple, list)):
            return (*item, idx)
        return (item, idx)


def batch_indices(batch) -> torch.Tensor:
    """The dataset indices of a batch produced from an :class:`IndexedDataset` (last element)."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError("batch must be a tuple/list whose last element holds dataset indices "
                         "(wrap the dataset in IndexedDataset)")
    idx = batch[-1]
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.ndim != 1:
        raise ValueError("the last batch element must be a 1-d int64 tensor of dataset indices "
                         "(wrap the dataset in IndexedDataset)")
    return idx
