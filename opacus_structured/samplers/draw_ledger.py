"""The draw records of a sampler: which batch of its stream each draw is, and its frozen law.

Every sampler of this package mixes in :class:`DrawLedger` (with :class:`FrozenParameters`):

* each batch it yields has a **global draw index** (its place in the sampler's whole stream,
  restored with its state), a size, and a tick of a process-wide clock
  (:func:`draw_clock`, :func:`live_samplers_drawn_since`); the privacy ledger
  (:mod:`opacus_structured.accountants.ledger`) prices the sequence of released draws;
* the parameters that define its law are recorded at construction and compared before every
  draw: a change raises :class:`SamplerParametersChangedError` (the accountant prices the
  parameters the sampler had when it was attached);
* a DataLoader that tags its batches with row tokens registers itself here
  (:func:`register_delivery_tracker`, :func:`track_deliveries`) so that an accountant can make
  any loader over our samplers deliver tagged batches without importing the loader module.

The loader checks built on these records are in :mod:`opacus_structured.samplers.verification`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import weakref
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

__all__ = ["DrawLedger", "StepDraws", "FrozenParameters", "SamplerParametersChangedError",
           "parameters_changed_error", "draw_clock", "live_samplers_drawn_since",
           "register_delivery_tracker", "track_deliveries"]

_CLOCK = itertools.count(1)
_LAST_TICK = 0
#: Samplers that have drawn at least one batch (weak: a sampler alive only here is dropped).
_DRAWN: "weakref.WeakSet[DrawLedger]" = weakref.WeakSet()


def draw_clock() -> int:
    """The tick of the most recent draw by any sampler (0 before the first)."""
    return _LAST_TICK


class SamplerParametersChangedError(ValueError):
    """A parameter that defines a batch sampler's law (``sample_rate``, ``num_samples``, the
    batch size, ``steps``, …) differs from its value when the sampler was built, so the
    accountant, which prices the parameters the sampler had when it was attached, would report
    an ε that does not describe the batches drawn. Raised before the next draw; the message
    names the attribute, its old and new value and the fix.

    Attributes:
        owner: the sampler's class name (or the object whose attribute changed).
        attribute: the attribute's name.
        old: its value when the sampler was built.
        new: its value now.
    """

    owner: Optional[str] = None
    attribute: Optional[str] = None
    old: Any = None
    new: Any = None


def _short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parameters_changed_error(owner: str, attribute: str, old: Any, new: Any,
                             note: str = "") -> SamplerParametersChangedError:
    """The :class:`SamplerParametersChangedError` for ``owner.attribute`` changed from ``old``
    to ``new`` (``note``: an extra sentence on what the change does)."""
    name = f"{owner}.{attribute}"
    if (dataclasses.is_dataclass(old) and not isinstance(old, type)
            and type(old) is type(new)):  # a scheme: name the fields that differ
        fields = [f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
                  for f in dataclasses.fields(old)
                  if not _same(getattr(old, f.name), getattr(new, f.name))]
        if fields:
            note = f" Fields changed: {', '.join(fields)}.{note}"
    error = SamplerParametersChangedError(
        f"{name} was changed from {_short_repr(old)} to {_short_repr(new)} after the sampler "
        f"was built.{note} The accountant prices the parameters the sampler had when it was "
        f"attached ({attribute}={_short_repr(old)}): drawing batches with "
        f"{attribute}={_short_repr(new)} would print an epsilon that does not describe them "
        f"(an under-report for a larger rate or batch, e.g. a batch-size ramp-up). Fix: for new "
        f"sampling parameters build a new scheme and sampler (scheme.sampler(...)) and a new "
        f"make_private run with its own accountant, or use a noise / batch schedule the scheme "
        f"supports; to continue this run, set {attribute} back to {_short_repr(old)}.")
    error.owner, error.attribute, error.old, error.new = owner, attribute, old, new
    return error


def _same(old: Any, new: Any) -> bool:
    """Whether a recorded parameter value ``old`` equals the current value ``new`` (arrays and
    tensors elementwise; anything whose ``==`` fails counts as changed unless identical)."""
    if old is new:
        return True
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        return (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)
                and old.shape == new.shape and bool(torch.equal(old, new)))
    if isinstance(old, np.ndarray) or isinstance(new, np.ndarray):
        return (isinstance(old, np.ndarray) and isinstance(new, np.ndarray)
                and bool(np.array_equal(old, new)))
    try:
        return bool(old == new)
    except Exception:  # noqa: BLE001 - an uncomparable value is a changed one
        return False


def _record(value: Any) -> Any:
    """A copy of ``value`` that later in-place edits of it do not reach (containers, arrays)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (list, dict, set)):
        return copy.deepcopy(value)
    return value


class FrozenParameters:
    """Mixin: the parameters that define a sampler's law are fixed once it is built.

    A sampler's scheme, and the accountant attached to it, describe the sampler's parameters
    when it was built (``sample_rate``, ``num_samples``, the batch size, ``steps``, the bands
    or bins, …). :meth:`_freeze_law` (called at the end of construction) records their values;
    :meth:`_check_law`, called before every draw, raises
    :class:`SamplerParametersChangedError` when one differs. Assigning the attribute itself is
    allowed (``load_state_dict`` and internal code set attributes; setting it back to the
    recorded value continues the run); only drawing with a changed value is refused. State that
    legitimately moves (generator state, position, epoch, step counters, participation state,
    the ledger's cursor) is not recorded.

    Subclasses list the attribute names in ``_LAW`` (or override :meth:`_law_values`).
    """

    _LAW: tuple[str, ...] = ()
    _law: Optional[dict] = None

    def _law_owner(self) -> str:
        """The name the error message gives the object whose attributes are checked."""
        return type(self).__name__

    def _law_names(self) -> tuple[str, ...]:
        """The attributes that define the law (default ``_LAW``)."""
        return self._LAW

    def _law_values(self) -> dict[str, Any]:
        """The current values of the law's parameters, by name."""
        return {name: getattr(self, name, None) for name in self._law_names()}

    def _freeze_law(self) -> None:
        """Record the law's parameters (the values every later draw must use)."""
        self._law = {name: _record(value) for name, value in self._law_values().items()}

    def _check_law(self) -> None:
        """Raise :class:`SamplerParametersChangedError` if a recorded parameter changed (a
        sampler never frozen is frozen now: its first draw defines the law)."""
        frozen = self.__dict__.get("_law")
        if frozen is None:
            self._freeze_law()
            return
        for name, new in self._law_values().items():
            old = frozen.get(name, new)
            if not _same(old, new):
                raise parameters_changed_error(self._law_owner(), name, old, new)


class StepDraws(NamedTuple):
    """What one noisy step sums, as the training driver counted it (no row tokens).

    ``draws``: the global draw indices whose gradients the clipped sum holds, oldest first;
    ``rows_per_example``: the most rows one example gives (declared); ``parts``: the number of
    parts the noise is split into (``>= len(draws)``: a group shorter than the others may be
    priced as the full group, its missing parts empty, so that a run keeps one noise
    multiplier)."""

    draws: list
    rows_per_example: int = 1
    parts: int = 1


class DrawLedger(FrozenParameters):
    """Mixin giving a sampler a ledger of the batches it yields (the *draw records*).

    Every batch a sampler yields has a **global draw index**: its position in the sampler's
    whole stream of batches (0 for the first batch of a fresh sampler, counted across epochs
    and restored by ``load_state_dict``: the ``i``-th batch of an uninterrupted run and of a run
    resumed from a saved state have the same index). The accountant's step hook reads the draw
    index of the batch each noisy step trained on (:meth:`current_draw`) and prices the
    sequence of released draws (:mod:`opacus_structured.accountants.ledger`).

    * ``batches_drawn``: batches yielded by this object in this process (a runtime counter).
    * ``last_draw_index``: the index of the most recent batch drawn (``None`` before any).
    * ``cursor``: who knows which batch is being trained on. ``None`` means the most recent
      draw (a synchronous loop: ``num_workers=0`` and no look-ahead); a loader that prefetches
      (:class:`~opacus_structured.samplers.ledger_loader.LedgerDataLoader` with workers,
      ``DPCallback`` under Lightning's one-batch look-ahead) installs a callable returning the
      index of the batch it handed to training.
    * ``fingerprint``: identifies the sampler's stream (class, public parameters and the
      generator state it started from); kept in ``state_dict`` so a restored sampler keeps the
      fingerprint of the run it continues.

    The public parameters are frozen (:class:`FrozenParameters`): a sampler whose law-defining
    attributes changed after it was built raises before its next draw.
    """

    batches_drawn: int = 0
    last_draw_tick: int = 0
    last_draw_index: Optional[int] = None
    cursor = None
    fingerprint: Optional[str] = None

    def _count_draw(self, index: Optional[int] = None, size: Optional[int] = None) -> None:
        """Record one yielded batch whose global draw index is ``index`` (default: the number
        of batches this object yielded before it) and, when known, its number of rows."""
        global _LAST_TICK
        index = self.batches_drawn if index is None else int(index)
        if size is not None:
            sizes = self.__dict__.setdefault("_draw_sizes", {})
            sizes[index] = int(size)
            if len(sizes) > 512:  # keep the recent draws only
                for old in sorted(sizes)[:256]:
                    del sizes[old]
        self.batches_drawn = self.batches_drawn + 1
        self.last_draw_index = index
        self.last_draw_tick = _LAST_TICK = next(_CLOCK)
        pending = self.__dict__.get("_undelivered")
        if pending is not None:
            pending.append(index)
        states = self.__dict__.get("_states_after")
        if states is not None:  # a prefetching LedgerDataLoader: keep the state after it
            states[index] = self.state_dict()
        _DRAWN.add(self)

    def size_of(self, index: Optional[int]) -> Optional[int]:
        """The number of rows of draw ``index`` (``None``: not known or no longer kept)."""
        return None if index is None else self.__dict__.get("_draw_sizes", {}).get(int(index))

    def _begin_draws(self) -> None:
        """A new iteration over the sampler starts: draws of an abandoned iterator that were
        never delivered (prefetched) are dropped from the delivery queue. Whether a
        :class:`~opacus_structured.samplers.ledger_loader.LedgerDataLoader` started it is
        kept: a plain DataLoader rebuilt over the same sampler draws synchronously, so its
        batches are the sampler's latest draws, not the ledger loader's deliveries."""
        self._ledger_iteration = bool(self.__dict__.pop("_ledger_started", False))
        pending = self.__dict__.get("_undelivered")
        if pending is not None:
            pending.clear()

    def state_after(self, index: int) -> Optional[dict]:
        """The sampler state right after draw ``index`` (from which the rest of the stream is
        drawn) when it is known: the current state if ``index`` is the last draw, else a state
        kept for a prefetched draw; ``None`` otherwise."""
        if index is None:
            return None
        if self.last_draw_index == index:
            return self.state_dict()
        states = self.__dict__.get("_states_after")
        return None if states is None else states.get(index)

    def current_draw(self) -> Optional[int]:
        """Global draw index of the batch being trained on now (see ``cursor``)."""
        cursor = self.cursor
        if cursor is None or (getattr(cursor, "from_ledger_loader", False)
                              and not self.__dict__.get("_ledger_iteration", True)):
            return self.last_draw_index
        return cursor()

    def step_draws(self) -> Optional["StepDraws"]:
        """The :class:`StepDraws` of the noisy step being priced, when whoever drives training
        knows them (``DPCallback`` under Lightning: the draws whose gradients the step sums,
        ``K`` of them with ``Trainer(accumulate_grad_batches=K)``, and the rows per example it
        declares); ``None`` otherwise (the step trained on :meth:`current_draw`)."""
        report = getattr(self.cursor, "step_draws", None)
        return report() if callable(report) else None

    def _stamp_fingerprint(self, *parts) -> None:
        """Set :attr:`fingerprint` from the class, ``parts`` (public parameters) and the
        generator state the stream starts from (called once, at construction)."""
        h = hashlib.sha256(type(self).__name__.encode())
        for part in parts:
            h.update(repr(part).encode())
        generator = getattr(self, "generator", None)
        if generator is not None:
            h.update(bytes(generator.get_state().numpy().tobytes()))
        self.fingerprint = h.hexdigest()[:16]

    def _ledger_state(self) -> dict:
        """The part of ``state_dict`` that the ledger needs (the fingerprint)."""
        return {} if self.fingerprint is None else {"fingerprint": self.fingerprint}

    def _load_ledger_state(self, state: dict) -> None:
        if isinstance(state, dict) and state.get("fingerprint") is not None:
            self.fingerprint = str(state["fingerprint"])


_DELIVERY_TRACKERS: list = []


def register_delivery_tracker(tracker) -> None:
    """Register ``tracker(loader) -> bool`` (:func:`~opacus_structured.samplers.ledger_loader.
    track_deliveries`, registered when that module is imported: it needs this one)."""
    if tracker not in _DELIVERY_TRACKERS:
        _DELIVERY_TRACKERS.append(tracker)


def track_deliveries(loader) -> bool:
    """Make ``loader``'s batches carry row tokens (see the registered tracker); ``False``
    when it cannot."""
    return any(tracker(loader) for tracker in _DELIVERY_TRACKERS)


def live_samplers_drawn_since(tick: int) -> list:
    """Samplers (still alive) whose last draw came after ``tick``, most recent first."""
    found = [s for s in list(_DRAWN) if s.last_draw_tick > tick]
    return sorted(found, key=lambda s: -s.last_draw_tick)
