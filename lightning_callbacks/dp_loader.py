"""``DPCallback``'s loader part: the train DataLoader draws the batches the accountant prices.

At fit start :class:`SamplerInstaller` takes the train DataLoader Lightning is about to use and

* **verifies** it: a batch sampler that implements a scheme must implement the callback's
  scheme (same parameters); a loader without one (e.g. ``DataLoader(shuffle=True)``) is refused
  with ``install_sampler=False`` and otherwise replaced;
* **builds** the scheme's sampler when the loader has none (:func:`build_sampler`, or the
  ``sampler=`` instance / ``(dataset, generator)`` factory given to the callback);
* under DDP **shards** it (:class:`~opacus_structured.samplers.distributed.DistributedBatchSampler`:
  every rank draws the same global batch and trains on its shard);
* **tracks** it (:class:`TrackedBatchSampler`: the sampler state to resume from, and the index
  list of every batch for the individual-accounting callbacks) and rebuilds the DataLoader
  around it (:func:`loader_with_batch_sampler`, Opacus' empty-batch collate).

:func:`resolve_scheme` decides, at construction, which scheme the callback prices from the
``scheme``, ``sampler`` and ``accountant`` it is given (all that carry one must agree).
Which scheme a batch sampler implements is
:func:`~opacus_structured.samplers.verification.scheme_of_batch_sampler`, the rule every wiring
path shares.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from opacus.data_loader import wrap_collate_with_empty
from torch.utils.data import DataLoader, IterableDataset, Sampler

from opacus_structured.samplers.distributed import DistributedBatchSampler
from opacus_structured.samplers.draw_ledger import StepDraws
from opacus_structured.samplers.verification import (
    DrawLedger,
    check_replaceable_sampler,
    describe_loader,
    innermost_sampler,
    scheme_of_batch_sampler,
)
from opacus_structured.schemes.base import Scheme

from .batch_indices import BatchIndexRecorder, loader_settings, train_loader_source

__all__ = ["TrackedBatchSampler", "ResumableDPDataLoader", "SamplerInstaller", "resolve_scheme", "build_sampler",
           "loader_with_batch_sampler", "SamplerFactory"]

#: ``(dataset, generator) -> batch sampler``: the ``sampler=`` factory form.
SamplerFactory = Callable[[Any, torch.Generator], Sampler]


def resolve_scheme(scheme: Optional[Scheme], sampler, accountant) -> Scheme:
    """The scheme the callback prices: ``scheme``, else ``sampler``'s, else ``accountant``'s.

    Every one of the three that names a scheme must name the same one (``ValueError`` saying
    which disagree); a sampler instance without a scheme, or none of the three naming one, is
    refused, since nothing would then say which accountant prices the batches.
    """
    sampler_scheme = None
    if sampler is None:
        pass
    elif hasattr(sampler, "__iter__"):
        sampler_scheme = scheme_of_batch_sampler(sampler)
        if sampler_scheme is None:
            raise ValueError(f"sampler {sampler!r} has no `scheme` attribute: the callback "
                             f"cannot tell which accountant prices it")
    elif not callable(sampler):
        raise ValueError("sampler must be a batch sampler or a (dataset, generator) factory")
    candidates = [("scheme", scheme), ("sampler.scheme", sampler_scheme),
                  ("accountant.scheme", getattr(accountant, "scheme", None))]
    given = [(k, s) for k, s in candidates if s is not None]
    if not given:
        raise ValueError("DPCallback needs a scheme (e.g. PoissonScheme(sample_rate=q)), a "
                         "sampler with a `scheme`, or an accountant with a `scheme`")
    for k, s in given[1:]:
        if s != given[0][1]:
            raise ValueError(f"{given[0][0]}={given[0][1]!r} and {k}={s!r} disagree: the "
                             f"accountant must price the sampler the DataLoader uses")
    return given[0][1]


def build_sampler(scheme: Scheme, dataset, generator: torch.Generator):
    """``scheme.sampler_for_dataset(len(dataset), generator=generator)``: the sampler the scheme's
    registry entry builds for a map-style dataset (a
    :class:`~opacus_structured.samplers.full_batch.FullBatchSampler` for ``GDPScheme``).

    Schemes whose sampler needs more than the dataset size (structured time-series windows, the
    padded truncated-Poisson dataset) raise: pass ``sampler=`` (an instance or a
    ``(dataset, generator)`` factory).
    """
    try:
        return scheme.sampler_for_dataset(len(dataset), generator=generator)
    except NotImplementedError:
        raise ValueError(f"scheme {scheme.name!r} has no sampler; pass DPCallback(sampler=...)"
                         ) from None


def loader_with_batch_sampler(loader: DataLoader, batch_sampler) -> DataLoader:
    """A copy of ``loader`` drawing batches with ``batch_sampler``.

    Keeps the dataset, workers and collate function (wrapped with Opacus'
    ``wrap_collate_with_empty`` so empty batches keep their structure, as in ``DPDataLoader``).
    """
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError("the train DataLoader wraps an IterableDataset; DP sampling needs a "
                         "map-style dataset (indexable, with len())")
    collate = loader.collate_fn
    if not hasattr(collate, "wrapped_collator_fn"):  # not yet an Opacus empty-batch wrapper
        collate = wrap_collate_with_empty(collate_fn=collate)
    cls = ResumableDPDataLoader if isinstance(batch_sampler, TrackedBatchSampler) else DataLoader
    return cls(loader.dataset, batch_sampler=batch_sampler, collate_fn=collate,
               **loader_settings(loader))


class ResumableDPDataLoader(DataLoader):
    """The train DataLoader ``DPCallback`` installs: a plain ``DataLoader`` over the tracked
    batch sampler that also implements Lightning's stateful-loader protocol (``state_dict`` /
    ``load_state_dict``). Lightning saves its state in the checkpoint's loop state and loads it
    back on a resume, so a mid-epoch resume is exact by Lightning's own mechanism (and Lightning
    no longer warns that the loader is not resumable). The state is the sampler's state from
    which the untrained rest of the epoch is drawn, and the number of batches of the epoch
    already trained on (what ``DPCheckpoint`` also keeps)."""

    def state_dict(self) -> dict[str, Any]:
        tracked = self.batch_sampler
        return {"sampler": tracked.state_for_consumed(), "consumed": tracked.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or "sampler" not in state_dict:
            return
        self.batch_sampler.restore(state_dict["sampler"], int(state_dict.get("consumed", 0)))


class TrackedBatchSampler(BatchIndexRecorder, Sampler):
    """Wraps a protocol sampler and snapshots its ``state_dict()`` before every draw.

    Lightning prefetches a batch (and workers prefetch more), so the sampler's own state at
    checkpoint time is ahead of training; the snapshot taken before drawing batch ``k`` is the
    state to resume from once ``k`` batches of the epoch have been trained on. It also records
    the index list of every batch drawn (:class:`~.batch_indices.BatchIndexRecorder`), which
    is how the individual-accounting callbacks know which examples each batch holds.

    ``inner`` is the wrapped sampler and ``scheme`` its scheme; ``consumed`` counts the batches
    of the current epoch trained on (advanced by the callback after each training batch).

    It also knows which draws the clipped sum of the next noisy step holds
    (:meth:`step_draws`): the batches trained on since the sum was last emptied (a noisy
    release, :meth:`released`, or ``zero_grad``, :meth:`sum_emptied`), up to the batch being
    trained on; ``K`` of them under ``Trainer(accumulate_grad_batches=K)``, fewer in the last
    group of an epoch. ``rows_per_example`` is what ``DPCallback`` declares (``k`` augmented
    views of each example: ``k``). The privacy ledger reads them through the sampler's
    ``cursor`` (:meth:`~opacus_structured.samplers.draw_ledger.DrawLedger.step_draws`, a
    :class:`~opacus_structured.samplers.draw_ledger.StepDraws`).
    """

    def __init__(self, inner):
        self.inner = inner
        self.scheme = scheme_of_batch_sampler(inner)
        self.consumed = 0         # batches of the current epoch trained on (set by DPCallback)
        self._offset = 0          # batches already consumed when iteration resumes mid-epoch
        #: ignore restores (Lightning's loader state): the run resumed from a checkpoint older
        #: than its last release goes on drawing new batches (set by DPCallback)
        self.hold_position = False
        #: rows each example gives a step at most (declared by ``DPCallback``)
        self.rows_per_example = 1
        #: price a release as at least this many parts (``DPCallback``: ``K`` for an
        #: accountant that prices one noise multiplier per run, so a last, shorter group keeps it)
        self.min_parts = 1
        self._snapshots: dict[int, Any] = {}
        self._draws: dict[int, Optional[int]] = {}  # batch k of the epoch -> its draw index
        self._unreleased: list[Optional[int]] = []  # draws trained on, in the clipped sum
        self._released_batch: Optional[int] = None  # batch of the epoch whose step released
        source = innermost_sampler(inner)
        if isinstance(source, DrawLedger):
            # Lightning fetches a batch ahead: the batch trained on is batch `consumed`
            source.cursor = _StepCursor(self)

    def current_draw(self) -> Optional[int]:
        """Global draw index of the batch being trained on (batch ``consumed`` of the epoch),
        the privacy ledger's cursor (:class:`~opacus_structured.samplers.verification.
        DrawLedger`)."""
        return self._draws.get(self.consumed)

    def step_draws(self) -> Optional[StepDraws]:
        """The draws whose gradients the clipped sum being released holds (class docstring),
        oldest first, the rows per example and the parts the noise is split into (at least
        :attr:`min_parts`); ``None`` when a draw is unknown."""
        draws = list(self._unreleased)
        if self._released_batch != self.consumed:
            draws.append(self.current_draw())
        if not draws or any(d is None for d in draws):
            return None
        return StepDraws([int(d) for d in draws], int(self.rows_per_example),
                         max(len(draws), int(self.min_parts)))

    def sum_emptied(self) -> None:
        """``zero_grad`` ran during the batch being trained on (before its backward): the
        clipped sum holds none of the earlier batches."""
        self._unreleased = []

    def released(self) -> None:
        """The noisy step released the clipped sum, the batch being trained on included."""
        self._unreleased = []
        self._released_batch = self.consumed

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        k, self._offset = self._offset, 0
        self.consumed = k
        self._snapshots = {}
        self._draws = {}
        self._start_recording()
        it = iter(self.inner)
        source = innermost_sampler(self.inner)
        while True:
            self._snapshots[k] = self.inner.state_dict()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._draws[k] = getattr(source, "last_draw_index", None)
            k += 1
            self._record(batch)
            yield batch

    def batch_trained(self) -> None:
        """One more batch of the epoch was trained on; forget the snapshots before it."""
        if self._released_batch != self.consumed:  # its gradient waits for the next release
            self._unreleased.append(self._draws.get(self.consumed))
        self._released_batch = None
        self.consumed += 1
        for k in [k for k in self._snapshots if k < self.consumed]:
            del self._snapshots[k]
        for k in [k for k in self._draws if k < self.consumed - 1]:
            del self._draws[k]

    def state_for_consumed(self):
        """The inner sampler's state from which the untrained rest of the epoch is drawn."""
        snap = self._snapshots.get(self.consumed)
        return snap if snap is not None else self.inner.state_dict()

    def restore(self, state, consumed: int):
        """Load the inner sampler's ``state`` and resume the epoch after ``consumed`` batches
        (nothing while :attr:`hold_position`: its later draws were released)."""
        if self.hold_position:
            return
        self.inner.load_state_dict(state)
        self._offset = consumed if 0 < consumed < len(self.inner) else 0
        self.consumed = self._offset
        self._unreleased, self._released_batch = [], None  # a resumed run's sum starts empty


class _StepCursor:
    """The privacy ledger's cursor on a :class:`TrackedBatchSampler`'s source: called, the
    draw being trained on; :meth:`step_draws`, the draws the noisy step sums."""

    def __init__(self, tracked: TrackedBatchSampler):
        self.tracked = tracked

    def __call__(self) -> Optional[int]:
        return self.tracked.current_draw()

    def step_draws(self) -> Optional[StepDraws]:
        return self.tracked.step_draws()


class SamplerInstaller:
    """Installs (or, with ``install=False``, only verifies) the scheme's sampler in the train
    DataLoader at fit start (see the module docstring).

    Args:
        scheme: the scheme the accountant prices.
        sampler: a batch sampler implementing ``scheme``, a ``(dataset, generator)`` factory,
            or ``None`` (:func:`build_sampler`).
        install: replace a loader whose batch sampler implements no scheme (else refuse it).
        generator: the generator a built sampler draws with (checkpointed with its state).
    """

    def __init__(self, scheme: Scheme, sampler: Union[Sampler, SamplerFactory, None], *,
                 install: bool, generator: torch.Generator):
        self.scheme = scheme
        self.sampler = sampler
        self.install_sampler = bool(install)
        self.generator = generator

    def install(self, trainer) -> tuple[DataLoader, TrackedBatchSampler]:
        """Verify or replace the trainer's train DataLoader; returns the loader Lightning will
        train on and its tracked batch sampler."""
        source, loader = train_loader_source(trainer, "DPCallback", "install or verify its "
                                                                    "sampler")
        if not isinstance(loader, DataLoader):
            raise ValueError(f"DPCallback needs a single torch DataLoader for training, got "
                             f"{type(loader).__name__}")
        inner = self._drawing_sampler(loader)
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(inner, method, None)):
                raise ValueError(f"sampler {inner!r} has no {method}(): a resumed run could not "
                                 f"continue its batches")
        tracked = TrackedBatchSampler(self.distribute(trainer, inner))
        new_loader = loader_with_batch_sampler(loader, tracked)
        if trainer.world_size > 1 and getattr(new_loader.collate_fn, "first_batch", 1) is None:
            new_loader.collate_fn([loader.dataset[0]])  # a rank's first shard may be empty
        source.instance = new_loader  # fit_loop.setup_data() will now use it
        return new_loader, tracked

    def sample_rate(self, tracked: TrackedBatchSampler) -> float:
        """The rate each step is priced at: the scheme's, else ``1 / len(sampler)`` (the rate
        Opacus' hook reports for a loader of ``len(sampler)`` batches)."""
        expected = self.scheme.expected_sample_rate()
        return expected if expected is not None else 1.0 / len(tracked)

    def _drawing_sampler(self, loader: DataLoader):
        """The (global) batch sampler that will draw: the loader's own if it implements the
        scheme, else the given or built one."""
        current = scheme_of_batch_sampler(loader.batch_sampler)
        if current is not None and not self.scheme.implemented_by(current):
            raise ValueError(
                f"the train DataLoader's batch sampler implements {current!r} but the accountant "
                f"prices {self.scheme!r}: build both from the same scheme")
        if current is None and not self.install_sampler:
            raise ValueError(
                f"the train DataLoader draws batches with {describe_loader(loader)}, but the "
                f"accountant prices {self.scheme!r}, whose ε is only valid for that scheme's "
                f"sampler: pass batch_sampler=scheme.sampler(...) (e.g. PoissonBatchSampler) to "
                f"the DataLoader, or let DPCallback install it (install_sampler=True)")
        if current is not None:
            inner = loader.batch_sampler
            return inner.inner if isinstance(inner, TrackedBatchSampler) else inner
        check_replaceable_sampler(loader, "DPCallback")
        if self.sampler is not None and hasattr(self.sampler, "__iter__"):
            return self.sampler
        if self.sampler is not None:
            inner = self.sampler(loader.dataset, self.generator)
            if scheme_of_batch_sampler(inner) != self.scheme:
                raise ValueError(f"the sampler factory built a sampler for "
                                 f"{scheme_of_batch_sampler(inner)!r}, not {self.scheme!r}")
            return inner
        return build_sampler(self.scheme, loader.dataset, self.generator)

    @staticmethod
    def distribute(trainer, inner):
        """Under DDP: the rank's shard of the global batches (single process: ``inner``)."""
        if trainer.world_size <= 1:
            return inner
        if getattr(trainer._accelerator_connector, "use_distributed_sampler", False):
            raise ValueError("DPCallback under DDP needs Trainer(use_distributed_sampler=False): "
                             "Lightning's DistributedSampler would re-partition the DP batches; "
                             "the callback shards the scheme's global batches itself")
        if isinstance(inner, DistributedBatchSampler):
            if (inner.num_replicas, inner.rank) != (trainer.world_size, trainer.global_rank):
                raise ValueError(f"the DistributedBatchSampler has num_replicas="
                                 f"{inner.num_replicas}, rank={inner.rank} but the trainer has "
                                 f"world_size={trainer.world_size}, rank={trainer.global_rank}")
            return inner
        return DistributedBatchSampler(inner, num_replicas=trainer.world_size,
                                       rank=trainer.global_rank)
