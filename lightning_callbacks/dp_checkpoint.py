"""``DPCallback``'s checkpoint part: what a resumed run needs to go on exactly.

:class:`DPCheckpoint` writes into and reads from the callback's entry of a Lightning checkpoint
(Lightning calls ``Callback.state_dict`` / ``load_state_dict``;
https://lightning.ai/docs/pytorch/stable/extensions/callbacks_state.html):

* ``accountant`` — the accountant's ``state_dict`` (every priced step: a resumed run neither
  loses nor double-counts one) and ``scheme`` — the scheme it priced. A callback of another
  scheme (another batch size or rate: a phase schedule) resumes it as a **new phase**, composed
  with the earlier ones (:mod:`~opacus_structured.accountants.phases`); its sampler then starts
  its own stream (the checkpoint's sampler state, of another law, is not loaded);
* ``noise_generator`` — the state of the generator the optimizer draws its noise from, and
  ``noise_tag`` — the run's noise lineage and position at the save
  (:mod:`~opacus_structured.accountants.noise_lineage`); ``noise_lineage`` — the lineage itself
  when the accountant keeps none (an accountant without a privacy ledger);
* ``sampler`` / ``consumed`` — the sampler state from which the untrained rest of the epoch is
  drawn and the number of batches of the epoch already trained on (see
  :class:`~lightning_callbacks.dp_loader.TrackedBatchSampler`: Lightning prefetches);
* ``optimizer_noise`` — an optimizer's extra noise state when it defines ``noise_state_dict`` /
  ``load_noise_state_dict`` (the ring buffers of correlated noise).

Lightning restores callback state before ``on_fit_start``, when the sampler and optimizer do
not exist yet: then the accountant is restored at once (so ``DPCallback.epsilon`` reports the
restored steps) and the rest is kept pending until the callback has built its objects.

**The noise generator is restored only when the resume provably continues the run from its
last released step** (:func:`~opacus_structured.accountants.noise_lineage.may_restore`: this
process drew the checkpoint's lineage up to exactly its position). Resuming from an earlier
checkpoint (``trainer.fit(..., ckpt_path=<an earlier epoch>)``, the "reload the best and go on"
habit) would otherwise add the noise of the later steps again, to other batches: the
difference of two such releases carries no noise (true ε = ∞). The generator is then reseeded
from OS entropy instead (a :class:`~opacus_structured.accountants.noise_lineage.FreshNoiseWarning`
says so), and the run continues under a new lineage id. In a new process the checkpoint's run
is unknown (it may have released steps after the checkpoint), so the noise is fresh too: the
resumed run is not bit-identical to an uninterrupted one, and nothing is replayed; with the
run's :class:`~opacus_structured.DatasetBudget` (``DPCallback(budget=...)``) its journal proves
where the run's draws ended, and a resume from that step is exact in a new process too. A
correlated-noise state restored behind noise already released raises
:class:`~opacus_structured.accountants.noise_lineage.NoiseReplayError` (its noise needs its
positions).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from opacus_structured.accountants import noise_lineage
from opacus_structured.schemes.base import Scheme

__all__ = ["DPCheckpoint"]

#: Format of the saved dictionary (2: the noise lineage tag).
VERSION = 2


class DPCheckpoint:
    """Saves and restores a ``DPCallback`` run (module docstring).

    Args:
        scheme: the scheme the callback prices (a checkpoint of another one is refused).
    """

    def __init__(self, scheme: Scheme):
        self.scheme = scheme
        #: State loaded before fit start, applied by :meth:`apply_pending`.
        self.pending: Optional[dict[str, Any]] = None

    def state_dict(self, *, accountant, noise_generator: torch.Generator, lineage,
                   own_lineage: bool = False, sampler=None, optimizer=None, journal=None) -> dict[str, Any]:
        """The checkpoint entry of the run (``sampler`` is the tracked batch sampler;
        ``lineage`` the run's noise lineage, saved here too when ``own_lineage``: the
        accountant keeps none)."""
        state: dict[str, Any] = {"accountant": accountant.state_dict(),
                                 "scheme": self.scheme.to_dict(),
                                 "noise_generator": noise_generator.get_state(),
                                 "noise_tag": lineage.tag(),
                                 "version": VERSION}
        if own_lineage:
            state["noise_lineage"] = lineage.state_dict()
        if sampler is not None:
            state["sampler"] = sampler.state_for_consumed()
            state["consumed"] = sampler.consumed
        noise_state = getattr(optimizer, "noise_state_dict", None)
        if callable(noise_state):
            state["optimizer_noise"] = noise_state()
        return state

    def is_new_phase(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` was saved under another scheme (the resume starts a new phase)."""
        return Scheme.from_dict(state["scheme"]) != self.scheme

    def defer(self, state: dict[str, Any], *, accountant, lineage=None,
              own_lineage: bool = False, journal=None) -> None:
        """Before fit start: restore the accountant now, the rest at :meth:`apply_pending`."""
        accountant.load_state_dict(state["accountant"])
        if own_lineage and lineage is not None:
            lineage.load_state_dict(state.get("noise_lineage"))
        self.pending = state

    def apply_pending(self, **parts) -> bool:
        """Apply a deferred state (``parts`` as for :meth:`apply`); nothing if none."""
        if self.pending is not None:
            state, self.pending = self.pending, None
            return self.apply(state, **parts)
        return False

    @staticmethod
    def apply(state: dict[str, Any], *, accountant, noise_generator: torch.Generator,
              lineage, own_lineage: bool = False, sampler=None, optimizer=None,
              journal=None) -> bool:
        """Restore every part of ``state`` into the live run; the noise generator only where
        the resume provably continues the run (module docstring). Returns whether the live run
        had gone on past the checkpoint (its accountant keeps the later steps): its sampler
        then goes on too (not restored), since its later draws were released."""
        tag = state.get("noise_tag")
        if noise_lineage.rewinds(tag) and "optimizer_noise" in state:
            raise noise_lineage.NoiseReplayError(
                f"the checkpoint's correlated noise is at noise draw {tag['position']} of a run "
                f"that has already drawn more in this process (an earlier checkpoint): the "
                f"noise of a step is correlated with the steps before it, so the later steps' "
                f"noise cannot be replaced. Resume from the run's latest checkpoint, or start a "
                f"new run (a new DPCallback and optimizer) from these weights")
        new_phase = Scheme.from_dict(state["scheme"]) != getattr(accountant, "scheme", None)
        accountant.load_state_dict(state["accountant"])
        if own_lineage and not _went_on(lineage, tag):
            lineage.load_state_dict(state.get("noise_lineage"))
        # the live run went on past the checkpoint (the accountant kept its later steps): its
        # sampler goes on too, drawing new batches (restoring it would release batches of the
        # later steps a second time)
        went_on = _went_on(lineage, tag)
        if not noise_lineage.restore_or_reseed(noise_generator, state["noise_generator"], tag,
                                               "DPCallback", journal):
            if tag and lineage.lineage == tag.get("lineage"):
                lineage.fork()  # a branch of the run, with noise of its own
        if "sampler" in state and sampler is not None and not (went_on or new_phase):
            sampler.restore(state["sampler"], int(state.get("consumed", 0)))
        if "optimizer_noise" in state:
            loader = getattr(optimizer, "load_noise_state_dict", None)
            if not callable(loader):
                raise ValueError("the checkpoint holds correlated-noise state but the optimizer "
                                 "has no load_noise_state_dict(); use the same optimizer_class")
            loader(state["optimizer_noise"], journal=journal)
        return went_on or new_phase


def _went_on(lineage, tag) -> bool:
    """Whether the live run's lineage is the checkpoint's and has drawn past its position."""
    return bool(tag) and lineage.lineage == tag.get("lineage") \
        and lineage.position > int(tag.get("position", 0))

