"""Exact resume for epoch-based batch samplers (one implementation for all of them).

A sampler's state *between* draws is its generator state, its position in the epoch and the
number of completed epochs (plus, per sampler, the public parameters a state must match and any
extra per-epoch state). ``load_state_dict`` stages that state; the next ``iter()`` continues from
it, so a resumed run draws exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from .._validation import check_int
from .verification import DrawLedger

__all__ = ["EpochResumableSampler", "check_matching_params"]


def check_matching_params(state_dict: dict[str, Any], sampler, keys: Iterable[str]) -> None:
    """Raise ``ValueError`` unless ``state_dict`` holds every key with ``sampler``'s value."""
    for key in keys:
        if key not in state_dict:
            raise ValueError(f"sampler state lacks {key!r}")
        if state_dict[key] != getattr(sampler, key):
            raise ValueError(f"sampler state has {key}={state_dict[key]!r} but this sampler "
                             f"has {key}={getattr(sampler, key)!r}; build it with the same "
                             f"parameters")


class EpochResumableSampler(DrawLedger):
    """Mixin: ``__iter__`` calls :meth:`_resume` once and :meth:`_advance` after each draw.

    Subclasses set ``generator``, ``steps`` (draws per epoch), ``epoch`` and
    ``_pending = None``, list the parameters a state must match in ``_KEYS`` and the parameters
    that define their law in ``_LAW`` (frozen at the end of construction by
    :meth:`~.verification.FrozenParameters._freeze_law`, checked by :meth:`_resume` and by the
    subclass before every draw), and may override :meth:`_restore_extra` / :meth:`_end_epoch`
    for per-epoch state (e.g. a permutation).
    """

    _KEYS: tuple[str, ...] = ()
    _pending: Optional[dict[str, Any]] = None

    def _resume(self) -> None:
        """Start an epoch: from the staged state if any, else at position 0. Raises
        :class:`~.verification.SamplerParametersChangedError` first if a parameter of the law
        changed since construction."""
        self._check_law()
        self._begin_draws()
        if self.fingerprint is None and self._pending is None:
            self._stamp_fingerprint(*(getattr(self, k) for k in self._KEYS))
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.generator.set_state(state["generator_state"])
            self._position = int(state["position"])
            self.epoch = int(state["epoch"])
            self._restore_extra(state)
        else:
            if 0 < getattr(self, "_position", 0) < self.steps:
                # the last epoch was abandoned (a break): it ends here, so the next draw gets a
                # new global index and the stream never reuses one
                self.epoch += 1
                self._end_epoch()
            self._position = 0
            self._restore_extra(None)

    def _advance(self, size: Optional[int] = None) -> None:
        """Count one draw (global index ``epoch · steps + position``); at the end of the epoch
        bump ``epoch``. The draw is recorded once the state is the state after it."""
        index = self.epoch * self.steps + self._position
        self._position += 1
        if self._position == self.steps:
            self.epoch += 1
            self._end_epoch()
        self._count_draw(index, size)

    def _restore_extra(self, state: Optional[dict[str, Any]]) -> None:
        """Restore per-epoch state from a staged ``state`` (``None``: a fresh epoch)."""

    def _end_epoch(self) -> None:
        """Drop per-epoch state at the end of an epoch."""

    def _epoch_state(self) -> dict[str, Any]:
        """Generator state, position (0 after the last batch of an epoch), epoch, ``_KEYS``."""
        if self._pending is not None:
            return dict(self._pending)
        position = self._position if self._position < self.steps else 0
        state = {"generator_state": self.generator.get_state().clone(), "position": position,
                 "epoch": self.epoch, **self._ledger_state()}
        state.update({k: getattr(self, k) for k in self._KEYS})
        return state

    def _stage(self, state_dict: dict[str, Any]) -> None:
        """Validate ``state_dict`` and stage it for the next ``iter()``."""
        check_matching_params(state_dict, self, self._KEYS)
        state = dict(state_dict)
        self._load_ledger_state(state_dict)
        state["position"] = check_int("position", state_dict["position"], minimum=0,
                                      maximum=self.steps - 1)
        state["epoch"] = check_int("epoch", state_dict["epoch"], minimum=0)
        state["generator_state"] = torch.as_tensor(state_dict["generator_state"],
                                                   dtype=torch.uint8).clone()
        self._pending = state
