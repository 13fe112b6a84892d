"""A DataLoader that tells its sampler which batch it handed to training.

A DataLoader with ``num_workers > 0`` asks its batch sampler for indices ahead of training
(``prefetch_factor · num_workers`` batches), so the sampler's most recent draw is not the batch
the current step trains on. :class:`LedgerDataLoader` is a plain ``torch.utils.data.DataLoader``
whose iterator, for every batch it yields, pops the oldest undelivered draw record of the
sampler (:class:`~opacus_structured.samplers.verification.DrawLedger`) and installs it as the
sampler's ``cursor``. The torch iterator yields batches in the order their indices were drawn
(``in_order=True``, the default), so the delivered record is exact with any number of workers.

``opacus_structured.make_private`` returns one; nothing else about the loader changes (same
dataset, batch sampler, collate, workers, pin memory), except that ``iter(loader)`` first checks
that the sampler's parameters are those it was built with
(:class:`~opacus_structured.samplers.verification.SamplerParametersChangedError` otherwise), so
a refused epoch raises before worker processes start.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from torch.utils.data import DataLoader

from .row_provenance import tag_batch
from .draw_ledger import DrawLedger, FrozenParameters, register_delivery_tracker
from .verification import innermost_sampler

__all__ = ["LedgerDataLoader", "ledger_source", "track_deliveries"]


def ledger_source(loader) -> Optional[DrawLedger]:
    """The sampler of ``loader`` that keeps draw records (innermost wrapped sampler), or
    ``None``."""
    inner = innermost_sampler(getattr(loader, "batch_sampler", None))
    if isinstance(inner, DrawLedger):
        return inner
    counter = getattr(inner, "sampler", None)  # a stock BatchSampler's counted index sampler
    return counter if isinstance(counter, DrawLedger) else None


def _check_parameters(batch_sampler) -> None:
    """Raise :class:`~.verification.SamplerParametersChangedError` now if the batch sampler
    (or a sampler it wraps) had a law-defining parameter changed: a new iteration refuses
    before it starts worker processes, not from inside their start-up."""
    seen = 0
    while batch_sampler is not None and seen < 8:
        if isinstance(batch_sampler, FrozenParameters):
            batch_sampler._check_law()
        batch_sampler = getattr(batch_sampler, "inner", None)
        seen += 1


class _Delivery:
    """The cursor of a sampler served by a :class:`LedgerDataLoader` iterator."""

    from_ledger_loader = True

    def __init__(self):
        self.index: Optional[int] = None

    def __call__(self) -> Optional[int]:
        return self.index


class _LedgerIterator:
    """Wraps a DataLoader iterator: each yielded batch moves the sampler's cursor to its draw."""

    def __init__(self, iterator, source: DrawLedger, delivery: _Delivery):
        self._it = iterator
        self._source = source
        self._delivery = delivery

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._it)

    def __next__(self):
        batch = next(self._it)
        queue = self._source.__dict__.get("_undelivered")
        if queue:
            self._delivery.index = queue.popleft()
            states = self._source.__dict__.get("_states_after")
            if states:  # keep only the delivered draw's state and the prefetched ones
                for index in [i for i in states if i < self._delivery.index]:
                    del states[index]
        else:  # drawn synchronously and already taken (cannot happen in order): latest draw
            self._delivery.index = self._source.last_draw_index
        return tag_batch(batch, self._delivery.index)

    def __getattr__(self, name):
        return getattr(self._it, name)


def _replay_unreleased_draws(source: DrawLedger) -> None:
    """A new iteration before any noisy step was released (``next(iter(loader))`` to look at a
    batch, an aborted first epoch): the sampler goes back to its state before its first draw,
    so training replays the same draws and the released run is the scheme's own run, draw 0 at
    noise position 0. Looking at private data releases nothing. The ledger allows it only
    while its accountant has released nothing (``_rewind_ok``); the state is taken before the
    first draw."""
    state = source.__dict__.get("_state_before_draws", False)
    if state is False and source.batches_drawn == 0:
        try:
            state = source.state_dict() if callable(getattr(source, "state_dict", None)) \
                else None
        except (AttributeError, TypeError, ValueError):
            state = None
        source._state_before_draws = state
    elif source.__dict__.get("_rewind_ok") and source.batches_drawn > 0 and state:
        source.load_state_dict(state)


class LedgerDataLoader(DataLoader):
    """``DataLoader`` whose iterator reports the draw index of each batch it yields to its
    batch sampler's ledger (module docstring). Use it exactly as a DataLoader."""

    #: Its iterator reports each delivered batch's draw (``verification.sees_trained_batch``).
    reports_deliveries = True

    def __iter__(self):
        _check_parameters(self.batch_sampler)  # before any worker starts or prefetches
        source = ledger_source(self)
        if source is None:
            return super().__iter__()
        if not isinstance(source.cursor, _Delivery):
            source.cursor = _Delivery()
        if source.__dict__.get("_undelivered") is None:
            source._undelivered = deque()  # before the iterator prefetches
        if self.num_workers > 0 and source.__dict__.get("_states_after") is None \
                and callable(getattr(source, "state_dict", None)):
            source._states_after = {}      # states after prefetched draws, for checkpoints
        _replay_unreleased_draws(source)
        source._ledger_started = True      # read by the sampler's next iteration
        return _LedgerIterator(super().__iter__(), source, source.cursor)


def track_deliveries(loader) -> bool:
    """Make ``loader`` (a DataLoader whose sampler keeps draw records, e.g. the one Opacus'
    ``make_private`` returns, or a user's DataLoader over a scheme's sampler) deliver as a
    :class:`LedgerDataLoader`: its class becomes a subclass of both (``isinstance`` checks
    still hold, nothing else changes), so its batches carry row tokens
    (:mod:`~opacus_structured.samplers.row_provenance`). Returns whether it does now."""
    if isinstance(loader, LedgerDataLoader):
        return True
    source = ledger_source(loader)
    if not isinstance(loader, DataLoader) or source is None:
        return False
    cursor = getattr(source, "cursor", None)
    if cursor is not None and not getattr(cursor, "from_ledger_loader", False):
        return False  # someone who knows which batch trains (DPCallback) keeps the cursor
    base = type(loader)
    tracked = _TRACKED.get(base)
    if tracked is None:
        tracked = _TRACKED[base] = type(f"Ledger{base.__name__}", (LedgerDataLoader, base),
                                        {"__module__": base.__module__})
    loader.__class__ = tracked
    return True


_TRACKED: dict = {}

register_delivery_tracker(track_deliveries)
