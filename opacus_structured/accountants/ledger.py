"""The privacy ledger: every released noisy step is matched to the sampler draw it trained on.

One invariant replaces the case-by-case guards. Each batch a sampler of this package yields has a
**global draw index** (its place in the sampler's whole stream, restored on resume; see
:class:`~opacus_structured.samplers.verification.DrawLedger`). At every noisy step the
accountant's hook reads the draw index of the batch the step trained on (the sampler's
``cursor``) and hands it to :meth:`ReleaseLedger.take`, which requires

    the released draws are strictly increasing, come from the run's own sampler stream,
    and — where the scheme needs it — are exactly the draws in order,

and prices what actually ran according to the scheme's
:attr:`~opacus_structured.schemes.base.Scheme.release_policy`:

* ``"independent"`` (per-step schemes, independent noise: Poisson, truncated Poisson,
  structured with a WOR top level, full batch): the released steps are priced one each; draws
  that were never released (a skipped batch, an evaluation pass over the private loader, a
  ``break``) cost nothing. A fresh sampler stream (a new seed) may replace the old one: its
  draws are independent of the old ones.
* ``"span"`` (independent noise, units of several steps: balls-in-bins, a deterministic or
  shuffled structured top level, cyclic Poisson with the identity strategy, b-min-sep with one
  band): every draw up to the last released one is priced (releasing a subset of a unit's
  steps is post-processing of releasing them all), so a skipped draw is priced as released.
* ``"exact"`` (correlated noise: BandMF, random allocation with a matrix mechanism, b-min-sep
  with bands): the noise of step ``i`` is correlated with the steps before it, so the released
  draws must be the sampler's draws ``0, 1, 2, …`` in order; any gap raises.

In every policy a draw is released at most once: two optimizer steps on one batch, a loop that
trains on batches from another loader, or a sampler restarted from an older state (a resume that
did not restore it) raise :class:`LedgerError` naming the cause and the fix.

The ledger also watches the torch optimizer under the ``DPOptimizer``: every step it takes must
be a step this accountant priced. If ``make_private`` is called again on the model and optimizer
it returned (Opacus unwraps the ``DPOptimizer``, so this accountant's hook stops firing) or the
inner optimizer is stepped directly, :meth:`ReleaseLedger.check_optimizer` raises at
``get_epsilon``; an accountant whose optimizer already took noisy steps priced by another
accountant raises at its first step.

``state_dict`` holds the sampler's fingerprint and the last released draw index (and the
sampler's own state when the sampler has drawn nothing beyond the last release), so Opacus'
``save_checkpoint`` / ``load_checkpoint``, Lightning checkpoints and ``state_dict`` carry the
sampler with the accountant: a resumed run continues the recorded stream or raises.

The ledger also owns the run's **noise position** (:attr:`ReleaseLedger.noise`, a
:class:`~opacus_structured.accountants.noise_lineage.NoiseLineage`): which generator states the
run's noise was drawn from, so that no noise value is added to two releases
(:mod:`~opacus_structured.accountants.noise_lineage`).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from .noise_lineage import NoiseLineage

__all__ = ["LedgerError", "ReleaseLedger", "POLICIES"]

#: The release policies a scheme can declare (``Scheme.release_policy``).
POLICIES = ("independent", "span", "exact")

_RESTORE_FIX = ("restore the sampler together with the accountant: load the accountant's "
                "state (Opacus' load_checkpoint does) into an accountant attached to the new run's "
                "DataLoader (it carries the sampler state), or call "
                "sampler.load_state_dict(state) with the sampler state saved at the same step")


class LedgerError(RuntimeError):
    """The noisy steps released are not a sequence of sampler draws the scheme can price, or a
    resumed run does not continue the stream its checkpoint recorded."""


class _OptimizerSteps:
    """Counts the steps of one torch optimizer (a step post-hook) and which ledgers priced how
    many of them."""

    def __init__(self, optimizer):
        self.total = 0
        self.ledgers: "weakref.WeakKeyDictionary[ReleaseLedger, int]" = \
            weakref.WeakKeyDictionary()
        self._handle = optimizer.register_step_post_hook(self._count)

    def _count(self, *_args, **_kwargs) -> None:
        self.total += 1


_STEPS: "weakref.WeakKeyDictionary[Any, _OptimizerSteps]" = weakref.WeakKeyDictionary()


def _steps_of(optimizer) -> Optional[_OptimizerSteps]:
    if not callable(getattr(optimizer, "register_step_post_hook", None)):
        return None
    try:
        counter = _STEPS.get(optimizer)
    except TypeError:  # not weak-referenceable
        return None
    if counter is None:
        counter = _STEPS[optimizer] = _OptimizerSteps(optimizer)
    return counter


class ReleaseLedger:
    """Which draw of the run's sampler each released noisy step trained on (module docstring).

    Attributes:
        last_draw: global draw index of the last released batch (``None`` before any).
        releases: noisy steps released through this ledger (restored on resume).
        skipped: draws that were never released, before the last release.
        fingerprint: the sampler stream's fingerprint (``DrawLedger.fingerprint``).
    """

    def __init__(self):
        self.last_draw: Optional[int] = None
        self.releases = 0
        self.skipped = 0
        self.fingerprint: Optional[str] = None
        #: the accountant's history was restored from a state without a ledger (saved by an
        #: older version): whether the sampler continues that history cannot be checked
        self.unverified_history = False
        self._source = None              # weakref to the DrawLedger sampler
        self._pending_sampler: Optional[dict] = None
        self._new_stream = False         # the bound sampler cannot continue the saved stream
        self._stream_unchecked = False   # check the stream's identity at the next step
        self._optimizer = None           # weakref to the torch optimizer under the DPOptimizer
        self._optimizer_steps_at_watch = 0
        self._releases_at_watch = 0
        self._released: set[int] = set()   # draws released (observed rows, "independent")
        self._floor: Optional[int] = None  # draws <= floor were released before a restore
        #: the run's noise draws: lineage id, position, state digests (noise_lineage)
        self.noise = NoiseLineage()

    # ---- binding ---------------------------------------------------------------------------
    @property
    def source(self):
        """The sampler whose draws are released (``None``: not bound, or garbage-collected)."""
        return self._source() if self._source is not None else None

    def bind(self, source) -> None:
        """Follow ``source``'s draws from now on; a checkpoint's sampler state loaded before
        the ledger was bound is applied to it now."""
        previous = self.source
        self._source = None if source is None else weakref.ref(source)
        if source is not None and source is not previous and self.last_draw is not None:
            self._stream_unchecked = True
        if source is not None and self._pending_sampler is not None:
            state, self._pending_sampler = self._pending_sampler, None
            self._restore_sampler(source, state)
        if source is not None:  # a run that released nothing may replay its draws
            source.__dict__["_rewind_ok"] = self.releases == 0 and self.last_draw is None

    def _restore_sampler(self, source, state: dict) -> None:
        """Load a checkpoint's sampler state into ``source``; a sampler that keeps no state
        (Opacus' own) continues on a new stream, which :meth:`take` accepts only for schemes
        whose steps do not depend on the stream (``Scheme.accepts_new_stream``)."""
        if callable(getattr(source, "load_state_dict", None)):
            source.load_state_dict(state)
        else:
            self._new_stream = True

    # ---- the invariant ---------------------------------------------------------------------
    def take(self, scheme, *, batches: int = 1, priced_steps: int = 0, optimizer=None,
             draws: Optional[list[int]] = None) -> int:
        """Record one released noisy step that trained on the last ``batches`` draws up to the
        source's current draw, or on exactly ``draws`` (observed from the rows of the step,
        :mod:`~opacus_structured.accountants.release_rows`); return the number of skipped draws
        the scheme prices as released (``"span"`` policy), else 0. Raises
        :class:`LedgerError` (module docstring).

        ``priced_steps`` is the number of steps the accountant priced before this one (the
        noise position of an ``"exact"`` scheme when the ledger has no release yet).
        """
        self._watch(optimizer)
        source = self.source
        if source is None:
            return 0
        source.__dict__["_rewind_ok"] = False
        policy = scheme.release_policy
        step_no = priced_steps + 1
        if self.unverified_history and self.last_draw is None:
            raise LedgerError(
                f"noisy step {step_no}: the accountant's {priced_steps} earlier step(s) were "
                f"restored from a state without a privacy ledger (saved by an older version), so "
                f"whether this run's sampler continues the stream they were drawn from cannot be "
                f"checked; a sampler restarted with the same seed would release the same batches "
                f"again. Resume from a checkpoint saved by this version, or price a new run with "
                f"a new accountant (its epsilon then covers only the new run)")
        if self._stream_unchecked:  # first step after a resume or on another sampler object
            self._stream_unchecked = False
            same = self.fingerprint is not None and source.fingerprint == self.fingerprint
            self._new_stream = self._new_stream or not same
        new_stream = self._new_stream or (
            self.fingerprint is not None and source.fingerprint is not None
            and source.fingerprint != self.fingerprint)
        if new_stream and self.last_draw is not None:
            self._new_stream = False
            if not scheme.accepts_new_stream:
                raise LedgerError(
                    f"noisy step {step_no} trains on a sampler stream other than the one this run "
                    f"drew from (fingerprint {source.fingerprint} != {self.fingerprint}: another "
                    f"seed, other parameters, or a new sampler after a resume); scheme "
                    f"{scheme.name!r} prices one stream of draws for the whole run. Fix: "
                    f"{_RESTORE_FIX}")
            self.last_draw = None  # a fresh, independent stream (new randomness)
            self._released, self._floor = set(), None
            fresh = True
        else:
            self._new_stream = False
            fresh = False
        index = source.current_draw() if not draws else int(max(draws))
        if draws and policy == "independent":
            return self._take_observed(draws, step_no, source)
        if index is None:
            raise LedgerError(
                f"noisy step {step_no} is being priced but the scheme's sampler has drawn no "
                f"batch: the loop trains on another DataLoader than the one that was checked "
                f"(use the loader make_private returns)")
        first = int(index) - int(batches) + 1 if not draws else int(min(draws))
        inner_gaps = 0 if not draws else (int(max(draws)) - int(min(draws)) + 1 - len(draws))
        if self.last_draw is not None and first <= self.last_draw:
            if index == self.last_draw:
                cause = ("no new batch was drawn since the previous noisy step: two optimizer "
                         "steps on one batch, or the step trains on a batch that did not come "
                         "from the scheme's DataLoader")
                fix = "call optimizer.step() once per batch of the loader make_private returned"
            else:
                cause = (f"the sampler went back to draw {index} after draw {self.last_draw} had "
                         f"been released: it was restarted or loaded from an older state, so "
                         f"batches already released would be released again")
                fix = _RESTORE_FIX
            raise LedgerError(f"noisy step {step_no}: {cause}. Fix: {fix}")
        # Without a released draw on record, a run priced by its draws ("span": the history
        # holds one entry per draw, padding included; "exact") continues at the draw the
        # priced steps reached; an "independent" stream may start anywhere.
        expected = (self.last_draw + 1) if self.last_draw is not None else (
            priced_steps if policy != "independent" and not fresh else first)
        skipped = first - expected
        if skipped < 0:
            raise LedgerError(
                f"noisy step {step_no} trains on draw {index} of the sampler, but {priced_steps} "
                f"steps were already priced for this run: the sampler was restarted (a resume "
                f"that did not restore it). Fix: {_RESTORE_FIX}")
        skipped += inner_gaps
        padding = 0
        if skipped > 0:
            if policy == "exact":
                raise LedgerError(
                    f"noisy step {step_no} trains on draw {index} of the sampler, but scheme "
                    f"{scheme.name!r} adds correlated noise priced for the draws in order "
                    f"(draw {expected} at this position): {skipped} batch(es) the sampler drew "
                    f"were never released (a skipped batch, a break in the middle of an epoch, "
                    f"extra batches taken from the private loader, or a resume that did not "
                    f"restore the sampler), so the groups released no longer match their noise "
                    f"positions. Fix: call optimizer.step() on every batch the loader yields "
                    f"(no `continue` before it, no other iteration of the private loader); on a "
                    f"resume, {_RESTORE_FIX}")
            if policy == "span":
                padding = skipped
        self.skipped += max(skipped, 0)
        self.last_draw = int(index)
        self.releases += 1
        if source.fingerprint is not None:
            self.fingerprint = source.fingerprint
        return padding

    def _take_observed(self, draws: list[int], step_no: int, source) -> int:
        """``"independent"`` policy with the draws observed from the rows: any order (a cached
        epoch, a prefetcher, a rebuilt loader), but every draw at most once. A draw at or below
        the last release of a restored state counts as released."""
        again = [int(d) for d in draws
                 if int(d) in self._released or (self._floor is not None and d <= self._floor)]
        if again:
            raise LedgerError(
                f"noisy step {step_no} sums rows of draw {again[0]} of the sampler, which an "
                f"earlier noisy step already released: a batch trained on twice (kept from an "
                f"earlier step, or a second optimizer.step() on the same batch). Two releases "
                f"of one subsample are not two independent subsampled steps. Fix: train on each "
                f"batch the loader yields once")
        self._released.update(int(d) for d in draws)
        top = int(max(draws))
        self.last_draw = top if self.last_draw is None else max(self.last_draw, top)
        self.releases += 1
        if source.fingerprint is not None:
            self.fingerprint = source.fingerprint
        return 0

    def count_release(self, optimizer=None) -> None:
        """Record a released step whose draw cannot be seen (Opacus' own sampler behind a
        prefetching loader; the draw *count* is checked instead): only the optimizer watch
        and the release count."""
        self._watch(optimizer)
        self.releases += 1

    # ---- the optimizer ---------------------------------------------------------------------
    def _watch(self, optimizer) -> None:
        """At the first step: count the steps of the torch optimizer under ``optimizer`` (a
        DPOptimizer), and refuse one whose noisy steps another live accountant priced."""
        if optimizer is None:
            return
        base = getattr(optimizer, "original_optimizer", optimizer)
        current = self._optimizer() if self._optimizer is not None else None
        if current is base:
            return
        counter = _steps_of(base)
        if counter is None:
            return
        others = sum(n for ledger, n in counter.ledgers.items() if ledger is not self)
        if others:
            raise LedgerError(
                f"this optimizer already took {others} noisy step(s) priced by another "
                f"accountant (make_private was called again on the model and optimizer an "
                f"earlier make_private returned, or a second engine wraps them): this "
                f"accountant's epsilon would leave those steps out. Use one PrivacyEngine and "
                f"accountant for the whole training, or load the first accountant's state into "
                f"this one (accountant.load_state_dict(first.state_dict())) before training")
        self._optimizer = weakref.ref(base)
        self._optimizer_steps_at_watch = counter.total
        self._releases_at_watch = self.releases
        counter.ledgers[self] = 0

    def note_priced(self) -> None:
        """One released step was priced (after :meth:`take`): credit it to the optimizer."""
        base = self._optimizer() if self._optimizer is not None else None
        counter = _STEPS.get(base) if base is not None else None
        if counter is not None:
            counter.ledgers[self] = counter.ledgers.get(self, 0) + 1

    def check_optimizer(self) -> None:
        """Raise :class:`LedgerError` if the watched optimizer took steps this ledger did not
        price (it was re-wrapped by a second ``make_private``, or stepped directly)."""
        base = self._optimizer() if self._optimizer is not None else None
        counter = _STEPS.get(base) if base is not None else None
        if counter is None:
            return
        stepped = counter.total - self._optimizer_steps_at_watch
        priced = self.releases - self._releases_at_watch
        if stepped > priced:
            raise LedgerError(
                f"the model's optimizer took {stepped} step(s) since this accountant was "
                f"attached, but only {priced} went through its DP step and were priced: the "
                f"optimizer was re-wrapped (make_private called again on the optimizer "
                f"make_private returned: Opacus unwraps the DPOptimizer, so this accountant's "
                f"hook no longer fires) or stepped outside the DPOptimizer "
                f"(optimizer.original_optimizer.step()). This epsilon would not cover the "
                f"model; use one PrivacyEngine for the whole training")

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Fingerprint, last released draw, counts, and the sampler's state when it has drawn
        nothing beyond the last release (a synchronous loop)."""
        state: dict[str, Any] = {"fingerprint": self.fingerprint, "last_draw": self.last_draw,
                                 "releases": self.releases, "skipped": self.skipped,
                                 "noise": self.noise.state_dict()}
        source = self.source
        sampler = None
        if source is not None and self.last_draw is not None \
                and callable(getattr(source, "state_dict", None)):
            sampler = source.state_after(self.last_draw)
        if sampler is not None:
            state["sampler"] = sampler
        elif self._pending_sampler is not None:
            state["sampler"] = self._pending_sampler
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the sampler state it carries is loaded into the bound
        sampler (now, or when one is bound)."""
        last = state.get("last_draw")
        self.last_draw = None if last is None else int(last)
        self._released = set()
        self._floor = self.last_draw
        self.unverified_history = False
        self.releases = int(state.get("releases", 0))
        self.skipped = int(state.get("skipped", 0))
        self.fingerprint = state.get("fingerprint")
        self.noise.load_state_dict(state.get("noise"))
        self._releases_at_watch = self.releases
        base = self._optimizer() if self._optimizer is not None else None
        counter = _STEPS.get(base) if base is not None else None
        self._optimizer_steps_at_watch = counter.total if counter is not None else 0
        sampler_state = state.get("sampler")
        source = self.source
        self._new_stream = False
        self._stream_unchecked = self.last_draw is not None
        if sampler_state is not None and source is not None:
            self._pending_sampler = None
            self._restore_sampler(source, sampler_state)
        else:
            self._pending_sampler = sampler_state
