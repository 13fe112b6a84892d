"""Multi-process (DDP) batch sampling: one global batch per step, split across ranks.

:class:`DistributedBatchSampler` wraps **any** batch sampler of this package
(:class:`~opacus_structured.samplers.poisson.PoissonBatchSampler`,
:class:`~opacus_structured.samplers.truncated_poisson.TruncatedPoissonSampler`,
:class:`~opacus_structured.samplers.structured.StructuredWindowSampler`, the matrix-factorization
samplers of ``cyclic_poisson`` / ``balls_in_bins`` / ``bminsep`` / ``multi_attribution``).

Exact semantics (``W`` = ``num_replicas`` processes, this one has rank ``r``):

* every rank holds a copy of the **same global sampler in the same state**: at construction,
  when ``torch.distributed`` is initialised with ``W > 1`` processes, rank 0's
  ``state_dict()`` (generator state, position, participation state such as cyclic-Poisson
  groups) is broadcast and loaded on every other rank (``sync_state=True``, the default then);
  without a process group pass the same ``generator`` seed to the sampler on every rank;
* at every step each rank draws the global batch ``G`` exactly as the single-process sampler
  would (same random numbers, so the sampler's generators advance identically on all ranks) and
  yields only its shard ``G[r::W]`` (positions ``r, r+W, r+2W, …`` of the global list);
* hence the shards are disjoint as positions, their union (as a multiset) is exactly ``G``,
  and the run draws the batches the single-process run with the same seed draws: **the
  accountant of the wrapped sampler's ``scheme`` stays valid unchanged** (the noise must be
  added once per global step, e.g. by Opacus' ``DistributedDPOptimizer``, which adds it on
  rank 0 only);
* shard sizes are ``ceil`` / ``floor`` of ``|G|/W``; when ``|G| < W`` some ranks get an **empty
  list** ``[]`` — collate it with Opacus' ``wrap_collate_with_empty`` (as
  :func:`~opacus_structured.samplers.poisson.poisson_data_loader` does) and still call
  ``optimizer.step()`` on every rank (the gradient all-reduce is collective);
* fixed-shape samplers stay fixed-shape per rank: a padded truncated-Poisson batch of ``B`` slots
  gives rank ``r`` exactly ``len(range(r, B, W))`` slots (padding slots carry zero gradient).

``len()``, ``state_dict()`` / ``load_state_dict()`` and every other attribute (``scheme``,
``sample_rate``, ``expected_batch_size``, ``generator``, ``padding_index``, …) are the wrapped
sampler's: a checkpoint of the global stream is the same for every rank and every world size, so
a run saved under DDP resumes on one process (or another ``W``) with the same global batches.
The wrapped sampler, ``num_replicas`` and ``rank`` are fixed once built, and a parameter of the
wrapped sampler's law (``sample_rate``, …) assigned on the wrapper (where it would shadow the
wrapped sampler's value without changing a draw) is refused: the next draw raises
:class:`~opacus_structured.samplers.verification.SamplerParametersChangedError`, as the wrapped
sampler itself does when its own parameters change.
:attr:`local_expected_batch_size` is ``expected_batch_size / W``, the value each rank passes to
``DistributedDPOptimizer(expected_batch_size=...)`` for ``loss_reduction="mean"`` (Opacus'
``make_private`` divides by the world size the same way), so the averaged update equals the
single-process one.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch.utils.data import Sampler

from .. import distributed as _dist
from .verification import FrozenParameters, _same, parameters_changed_error

__all__ = ["DistributedBatchSampler", "shard", "empty_safe_collate", "distributed_data_loader"]


def shard(batch, num_replicas: int, rank: int) -> list:
    """Positions ``rank, rank + num_replicas, …`` of ``batch`` (the deterministic split)."""
    return list(batch)[rank::num_replicas]


class DistributedBatchSampler(FrozenParameters, Sampler[list]):
    """Draws the global batch of ``batch_sampler`` and yields this rank's shard (see module).

    Args:
        batch_sampler: any batch sampler of this package (an iterable of index lists with
            ``__len__``; ``state_dict``/``load_state_dict`` are needed for ``sync_state``).
        num_replicas: number of processes W; default ``torch.distributed.get_world_size()``.
        rank: this process' rank in ``[0, W)``; default ``torch.distributed.get_rank()``.
        sync_state: broadcast rank 0's sampler state to all ranks at construction (a
            collective: every rank must construct its sampler at the same point). Default:
            ``True`` iff ``torch.distributed`` is initialised with more than one process.

    Raises:
        ValueError: ``num_replicas``/``rank`` missing without a process group or out of range;
            ``batch_sampler`` is itself distributed, or lacks ``state_dict`` when syncing.
    """

    def __init__(self, batch_sampler, *, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, sync_state: Optional[bool] = None):
        if isinstance(batch_sampler, DistributedBatchSampler):
            raise ValueError("batch_sampler is already a DistributedBatchSampler; wrap the "
                             "global sampler once")
        if not hasattr(batch_sampler, "__iter__") or not hasattr(batch_sampler, "__len__"):
            raise ValueError(f"batch_sampler must be an iterable batch sampler with len(), got "
                             f"{type(batch_sampler).__name__}")
        self.inner = batch_sampler
        self.num_replicas, self.rank = _dist.world_info(num_replicas, rank)
        if sync_state is None:
            sync_state = _dist.is_distributed()
        if sync_state:
            for method in ("state_dict", "load_state_dict"):
                if not callable(getattr(batch_sampler, method, None)):
                    raise ValueError(f"sync_state=True needs batch_sampler.{method}(); pass the "
                                     f"same generator seed on every rank and sync_state=False")
            if _dist.is_distributed():
                state = _dist.broadcast_object(batch_sampler.state_dict(), src=0)
                if self.rank != 0:
                    batch_sampler.load_state_dict(state)
        self._freeze_law()

    #: frozen at construction, checked before every draw
    _LAW = ("inner", "num_replicas", "rank")

    def _check_law(self) -> None:
        """Also refuse a law parameter of the wrapped sampler set on the wrapper itself."""
        super()._check_law()
        names = getattr(self.inner, "_law_names", None)
        for name in (names() if callable(names) else ()):
            if name in self.__dict__:
                inner_value = getattr(self.inner, name, None)
                if not _same(inner_value, self.__dict__[name]):
                    raise parameters_changed_error(
                        type(self).__name__, name, inner_value, self.__dict__[name],
                        note=f" It was set on the wrapper, which does not change the wrapped "
                             f"{type(self.inner).__name__}'s draws but shadows its value.")

    # ---- sampling ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list]:
        batches = iter(self.inner)  # the wrapped sampler checks its own parameters per draw
        while True:
            self._check_law()
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield shard(batch, self.num_replicas, self.rank)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def local_expected_batch_size(self) -> float:
        """``expected_batch_size / num_replicas``: per-rank normaliser for ``DistributedDPOptimizer``
        with ``loss_reduction="mean"`` (it divides the all-reduced sum by W once more).

        The global size is the sampler's ``expected_batch_size``, else its ``batch_size``
        (cyclic Poisson), else ``num_samples * sample_rate``; ``ValueError`` if it has none.
        """
        inner = self.inner
        size = getattr(inner, "expected_batch_size", None)
        if size is None:
            size = getattr(inner, "batch_size", None)
        if size is None and getattr(inner, "sample_rate", None) is not None and \
                getattr(inner, "num_samples", None) is not None:
            size = inner.num_samples * inner.sample_rate
        if size is None:
            raise ValueError(f"{type(inner).__name__} has no expected_batch_size, batch_size or "
                             f"sample_rate: pass the per-rank expected_batch_size (E / "
                             f"num_replicas) to the optimizer yourself")
        return float(size) / self.num_replicas

    # ---- state: the global stream's, identical on every rank -----------------------------
    def state_dict(self) -> dict[str, Any]:
        """The wrapped sampler's :meth:`state_dict` (rank-independent)."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped sampler (a single-process checkpoint works too)."""
        self.inner.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        # only called for attributes not found normally: delegate to the global sampler
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return (f"DistributedBatchSampler({self.inner!r}, num_replicas={self.num_replicas}, "
                f"rank={self.rank})")


def empty_safe_collate(dataset, collate_fn=None):
    """Opacus' ``wrap_collate_with_empty`` primed with the structure of ``dataset[0]``.

    Opacus' wrapper learns the structure of an empty batch from the first non-empty batch it
    sees; under DDP a rank's *first* shard may be empty, and the unprimed wrapper then returns
    ``[]``. Priming it with ``collate([dataset[0]])`` only records shapes and dtypes (the values
    are never returned: empty batches are ``torch.empty`` with batch dimension 0).
    """
    from opacus.data_loader import wrap_collate_with_empty
    from torch.utils.data._utils.collate import default_collate

    wrapped = wrap_collate_with_empty(collate_fn=collate_fn or default_collate)
    if len(dataset) > 0:
        wrapped([dataset[0]])
    return wrapped


def distributed_data_loader(dataset, batch_sampler: DistributedBatchSampler, *,
                            collate_fn=None, **kwargs):
    """A DataLoader over this rank's shards with the primed empty-batch collate
    (:func:`empty_safe_collate`); ``kwargs`` go to :class:`torch.utils.data.DataLoader`."""
    from torch.utils.data import DataLoader

    if not isinstance(batch_sampler, DistributedBatchSampler):
        raise ValueError(f"batch_sampler must be a DistributedBatchSampler, got "
                         f"{type(batch_sampler).__name__}")
    return DataLoader(dataset, batch_sampler=batch_sampler,
                      collate_fn=empty_safe_collate(dataset, collate_fn), **kwargs)
