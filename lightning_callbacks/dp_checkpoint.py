"""``DPCallback``'s checkpoint part: what a resumed run needs to go on exactly.

:class:`DPCheckpoint` writes into and reads from the callback's entry of a Lightning checkpoint
(Lightning calls ``Callback.state_dict`` / ``load_state_dict``;
https://lightning.ai/docs/pytorch/stable/extensions/callbacks_state.html):

* ``accountant`` — the accountant's ``state_dict`` (every priced step: a resumed run neither
  loses nor double-counts one) and ``scheme`` — the scheme it priced (a checkpoint is refused
  by a callback of another scheme);
* ``noise_generator`` — the state of the generator the optimizer draws its noise from;
* ``sampler`` / ``consumed`` — the sampler state from which the untrained rest of the epoch is
  drawn and the number of batches of the epoch already trained on (see
  :class:`~lightning_callbacks.dp_loader.TrackedBatchSampler`: Lightning prefetches);
* ``optimizer_noise`` — an optimizer's extra noise state when it defines ``noise_state_dict`` /
  ``load_noise_state_dict`` (the ring buffers of correlated noise).

Lightning restores callback state before ``on_fit_start``, when the sampler and optimizer do
not exist yet: then the accountant is restored at once (so ``DPCallback.epsilon`` reports the
restored steps) and the rest is kept pending until the callback has built its objects.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from opacus_structured.schemes.base import Scheme

__all__ = ["DPCheckpoint"]

#: Format of the saved dictionary.
VERSION = 1


class DPCheckpoint:
    """Saves and restores a ``DPCallback`` run (module docstring).

    Args:
        scheme: the scheme the callback prices (a checkpoint of another one is refused).
    """

    def __init__(self, scheme: Scheme):
        self.scheme = scheme
        #: State loaded before fit start, applied by :meth:`apply_pending`.
        self.pending: Optional[dict[str, Any]] = None

    def state_dict(self, *, accountant, noise_generator: torch.Generator, sampler=None,
                   optimizer=None) -> dict[str, Any]:
        """The checkpoint entry of the run (``sampler`` is the tracked batch sampler)."""
        state: dict[str, Any] = {"accountant": accountant.state_dict(),
                                 "scheme": self.scheme.to_dict(),
                                 "noise_generator": noise_generator.get_state(),
                                 "version": VERSION}
        if sampler is not None:
            state["sampler"] = sampler.state_for_consumed()
            state["consumed"] = sampler.consumed
        noise_state = getattr(optimizer, "noise_state_dict", None)
        if callable(noise_state):
            state["optimizer_noise"] = noise_state()
        return state

    def check_scheme(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` was saved under another scheme."""
        saved = Scheme.from_dict(state["scheme"])
        if saved != self.scheme:
            raise ValueError(f"the checkpoint was trained under {saved!r} but this DPCallback "
                             f"prices {self.scheme!r}; resume with the same scheme")

    def defer(self, state: dict[str, Any], *, accountant) -> None:
        """Before fit start: restore the accountant now, the rest at :meth:`apply_pending`."""
        accountant.load_state_dict(state["accountant"])
        self.pending = state

    def apply_pending(self, **parts) -> None:
        """Apply a deferred state (``parts`` as for :meth:`apply`); nothing if none."""
        if self.pending is not None:
            state, self.pending = self.pending, None
            self.apply(state, **parts)

    @staticmethod
    def apply(state: dict[str, Any], *, accountant, noise_generator: torch.Generator,
              sampler=None, optimizer=None) -> None:
        """Restore every part of ``state`` into the live run."""
        accountant.load_state_dict(state["accountant"])
        noise_generator.set_state(state["noise_generator"])
        if "sampler" in state and sampler is not None:
            sampler.restore(state["sampler"], int(state.get("consumed", 0)))
        if "optimizer_noise" in state:
            loader = getattr(optimizer, "load_noise_state_dict", None)
            if not callable(loader):
                raise ValueError("the checkpoint holds correlated-noise state but the optimizer "
                                 "has no load_noise_state_dict(); use the same optimizer_class")
            loader(state["optimizer_noise"])
