r"""Which dataset examples make up each training batch, without changing the batch.

Individual (per-example) accounting must know the dataset index of every row of a batch. The
index is **not** passed through the batch (the LightningModule's ``training_step`` receives
exactly what it would without DP); instead the *batch sampler* records the index list of
every batch it draws:

* :class:`BatchIndexRecorder` is the recording part: each index list a batch sampler yields
  is appended to a FIFO, and each trained batch takes the oldest one.
  The batch sampler runs in the main process even with DataLoader workers, and a DataLoader
  with ``in_order=True`` (the default) delivers batches in the order their index lists were
  drawn, so the FIFO stays aligned with training despite Lightning's one-batch prefetch and the
  workers' ``prefetch_factor``. A new iteration of the sampler (a new epoch) drops index lists
  drawn but never delivered (e.g. after ``limit_train_batches`` or a stop mid-epoch).
  ``DPCallback``'s sampler wrapper records (it subclasses this mixin); without a
  ``DPCallback``, :class:`RecordingBatchSampler` wraps the train DataLoader's batch sampler.
* :class:`~opacus_structured.samplers.full_batch.FullBatchSampler` (re-exported here): every
  example in every step, the batch sampler of :class:`~opacus_structured.schemes.gdp.GDPScheme`
  (full-batch DP-GD, the setting of the individual GDP filter); ``GDPScheme().sampler(n)``
  builds it.
* :class:`IndexSource`: how ``IndividualGDPFilter`` and ``PerSampleEpsilonTracker`` find the
  indices of the current batch: from the recorder (one index list per trained batch, shared by
  every callback through a per-batch key), or from the batch itself for the older
  :class:`~opacus_structured.indexed_dataset.IndexedDataset` convention (``index_fn=``).

Row order: the ``k``-th row of the per-sample gradients is the ``k``-th index drawn; torch's
default collate (and Opacus' empty-batch wrapper) keep that order. The callbacks check that the
number of rows equals the number of indices at every step.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from opacus_structured.indexed_dataset import batch_indices
from opacus_structured.samplers.full_batch import FullBatchSampler
from opacus_structured.samplers.verification import scheme_of_batch_sampler

__all__ = ["BatchIndexRecorder", "RecordingBatchSampler", "FullBatchSampler", "IndexSource",
           "find_recorder", "train_scheme", "train_loader_source", "loader_settings", "to_device"]


class BatchIndexRecorder:
    """Mixin for batch samplers: a FIFO of the index lists drawn and not yet trained on.

    Subclasses call :meth:`_start_recording` when an iteration (an epoch) starts and
    :meth:`_record` for every index list they yield; consumers call :meth:`take`.
    """

    _drawn: Optional[collections.deque] = None
    _taken_key: Any = None
    _taken: Optional[torch.Tensor] = None

    def _start_recording(self) -> None:
        self._drawn = collections.deque()
        self._taken_key, self._taken = None, None

    def _record(self, batch) -> None:
        if self._drawn is None:
            self._drawn = collections.deque()
        self._drawn.append(batch)

    def take(self, key) -> torch.Tensor:
        """The dataset indices (1-d int64, in row order) of the batch identified by ``key``.

        The first call with a new ``key`` pops the oldest drawn index list; later calls with the
        same key return it again (several callbacks read the same batch).
        """
        if self._taken is not None and key == self._taken_key:
            return self._taken
        if not self._drawn:
            raise RuntimeError(
                "a batch is being trained on but its batch sampler recorded no index list for "
                "it: the train DataLoader does not draw its batches with this sampler (was it "
                "replaced after fit started?)")
        raw = self._drawn.popleft()
        idx = torch.as_tensor(raw, dtype=torch.int64)
        if idx.ndim != 1:
            raise ValueError(
                f"the batch sampler yields {type(raw).__name__} items of shape "
                f"{tuple(idx.shape)}, not lists of dataset indices: individual accounting "
                f"needs one dataset index per batch row")
        self._taken_key, self._taken = key, idx
        return idx


def to_device(indices: torch.Tensor, device) -> torch.Tensor:
    """``indices`` on ``device`` with no host synchronisation: a CPU tensor bound for a CUDA
    device is staged in pinned memory and copied asynchronously (a plain ``.to("cuda")`` from
    pageable memory waits for the stream)."""
    device = torch.device(device)
    if indices.device == device:
        return indices
    if device.type == "cuda" and indices.device.type == "cpu":
        return indices.pin_memory().to(device, non_blocking=True)
    return indices.to(device)


class RecordingBatchSampler(BatchIndexRecorder, Sampler):
    """Wraps any batch sampler, yielding its batches unchanged and recording their indices.

    ``len``, ``state_dict`` / ``load_state_dict`` and the sampler's scheme are the wrapped
    sampler's (``inner``), so the wrapper is invisible to resumption and to sampler checks.
    """

    def __init__(self, inner):
        if inner is None or not hasattr(inner, "__iter__"):
            raise ValueError(f"inner must be a batch sampler, got {inner!r}")
        self.inner = inner

    @property
    def scheme(self):
        return scheme_of_batch_sampler(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        self._start_recording()
        for batch in self.inner:
            self._record(batch)
            yield batch

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)


# ---- how the callbacks find the indices ---------------------------------------------------
def _dp_callbacks(trainer) -> list:
    # DPCallback (which imports this module) marks itself: its sampler records the indices
    return [cb for cb in trainer.callbacks if getattr(cb, "installs_recording_sampler", False)]


def find_recorder(batch_sampler) -> Optional[BatchIndexRecorder]:
    """The outermost :class:`BatchIndexRecorder` in a chain of wrapper samplers (``inner``)."""
    seen = 0
    while batch_sampler is not None and seen < 10:
        if isinstance(batch_sampler, BatchIndexRecorder):
            return batch_sampler
        batch_sampler = getattr(batch_sampler, "inner", None)
        seen += 1
    return None


def _train_loader(trainer) -> Optional[DataLoader]:
    loader = getattr(trainer, "train_dataloader", None)
    if isinstance(loader, (list, tuple)) and len(loader) == 1:
        loader = loader[0]
    if isinstance(loader, dict) and len(loader) == 1:
        loader = next(iter(loader.values()))
    return loader if isinstance(loader, DataLoader) else None


def train_scheme(trainer):
    """The batching scheme of the run: ``DPCallback``'s, else the train batch sampler's
    (:func:`~opacus_structured.samplers.verification.scheme_of_batch_sampler`), else ``None``
    (e.g. a plain sequential or shuffled DataLoader)."""
    dps = _dp_callbacks(trainer)
    loader = _train_loader(trainer)
    found = scheme_of_batch_sampler(loader.batch_sampler) if loader is not None else None
    if dps and found is None:
        return dps[0].scheme
    return found


def _batch_key(trainer):
    # Incremented once per fetched batch, before on_train_batch_start: a key shared by every
    # callback of the batch (and restored on resume, so never repeated within a fit).
    return trainer.fit_loop.epoch_loop.batch_progress.total.ready


def train_loader_source(trainer, owner: str, purpose: str):
    """``(source, loader)``: Lightning's train data source and the DataLoader it would build.

    A callback replaces the loader in ``on_fit_start`` by setting ``source.instance`` (the fit
    loop builds its combined loader from it afterwards). Raises ``RuntimeError`` if the loader
    was set up already, naming ``owner`` and what it could then not do (``purpose``).
    """
    fit_loop = trainer.fit_loop
    if getattr(fit_loop, "_combined_loader", None) is not None:
        raise RuntimeError(f"the train DataLoader was set up before {owner}.on_fit_start; "
                           f"{owner} cannot {purpose}")
    source = fit_loop._data_source
    return source, source.dataloader()


def loader_settings(loader: DataLoader) -> dict:
    """The worker settings of ``loader`` (keyword arguments of ``DataLoader``), so a loader
    rebuilt around another batch sampler loads exactly as the original did."""
    kwargs = dict(num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  multiprocessing_context=loader.multiprocessing_context,
                  persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def _wrap_train_loader(trainer, owner: str) -> Optional[RecordingBatchSampler]:
    """Rebuild the train DataLoader around a :class:`RecordingBatchSampler` (no DPCallback)."""
    source, loader = train_loader_source(trainer, owner, "record the batches' dataset indices")
    if not isinstance(loader, DataLoader) or loader.batch_sampler is None \
            or isinstance(loader.dataset, IterableDataset):
        return None  # nothing to wrap: the batches must carry their indices (IndexedDataset)
    existing = find_recorder(loader.batch_sampler)
    if existing is not None:
        return existing
    if not getattr(loader, "in_order", True):
        raise ValueError(f"the train DataLoader has in_order=False: its batches may arrive in "
                         f"another order than drawn, so {owner} could not tell which examples "
                         f"a batch holds; use in_order=True (the default)")
    recorder = RecordingBatchSampler(loader.batch_sampler)
    source.instance = DataLoader(loader.dataset, batch_sampler=recorder,
                                 collate_fn=loader.collate_fn, generator=loader.generator,
                                 **loader_settings(loader))
    return recorder


class IndexSource:
    """Finds the dataset indices of each trained batch for one callback (see module doc).

    Args:
        owner: the callback's class name (for messages).
        index_fn: ``batch -> LongTensor``; when given, indices are read from the batch (e.g.
            :func:`~opacus_structured.indexed_dataset.batch_indices` for ``IndexedDataset``)
            and no sampler is wrapped.
    """

    def __init__(self, owner: str, index_fn: Optional[Callable] = None):
        if index_fn is not None and not callable(index_fn):
            raise ValueError(f"index_fn must be callable (batch -> LongTensor), got {index_fn!r}")
        self.owner = owner
        self.index_fn = index_fn
        self.recorder: Optional[BatchIndexRecorder] = None

    def on_fit_start(self, trainer) -> None:
        self.recorder = None
        if self.index_fn is not None or _dp_callbacks(trainer):
            return  # DPCallback's sampler records; or the batches carry their indices
        if trainer.world_size > 1:
            return  # Lightning shards the loader itself: use IndexedDataset (index_fn)
        _wrap_train_loader(trainer, self.owner)

    def on_train_start(self, trainer) -> None:
        if self.index_fn is not None:
            return
        loader = _train_loader(trainer)
        self.recorder = find_recorder(loader.batch_sampler) if loader is not None else None

    def indices(self, trainer, batch) -> torch.Tensor:
        if self.index_fn is not None:
            return self.index_fn(batch)
        if self.recorder is not None:
            return self.recorder.take(_batch_key(trainer))
        try:
            return batch_indices(batch)
        except ValueError as err:
            raise ValueError(
                f"{self.owner} cannot tell which examples this batch holds: the train "
                f"DataLoader's batch sampler could not be recorded (no DPCallback and no "
                f"batch_sampler / a map-style dataset), and the batch carries no index ({err}). "
                f"Use a DataLoader over a map-style dataset, or add DPCallback") from None
