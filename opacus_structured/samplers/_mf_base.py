"""Shared machinery of the matrix-factorization batch samplers (cyclic Poisson, balls-in-bins,
b-min-sep and variants): a dedicated seeded generator, a global step counter that runs across
epochs (the participation process is one stream over the whole run, not restarted per epoch),
and exact ``state_dict`` / ``load_state_dict`` resumption.

Protocol (as :meth:`opacus_structured.schemes.Scheme.sampler`): ``__iter__`` yields lists of
dataset indices, ``len(sampler)`` is the number of batches per epoch (``iter`` stops at the next
multiple of it, so a run resumed mid-epoch finishes that epoch), ``scheme`` describes what is
sampled. Batch indices are sensitive: do not log them.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import Sampler

from .._validation import check_int
from ._generator import fresh_seed as _fresh_seed  # noqa: F401
from ._generator import resolve_generator
from ._resumable import check_matching_params
from .verification import DrawLedger

__all__ = ["MFBatchSampler"]


class MFBatchSampler(DrawLedger, Sampler[list[int]]):
    """Base class: subclasses implement :meth:`_draw` (one batch at ``self.step``) and list
    their tensor state in ``_state_tensors`` and their constructor parameters in ``_params``.

    ``num_samples``, ``steps``, the ``_params`` and any further attribute a subclass lists in
    ``_LAW`` define the law and are fixed once built: subclasses call :meth:`_freeze_law` at
    the end of their constructor, and a draw after one was changed raises
    :class:`~.verification.SamplerParametersChangedError`."""

    _state_tensors: tuple[str, ...] = ()
    _params: tuple[str, ...] = ()

    def __init__(self, num_samples: int, *, steps: int, generator: Optional[torch.Generator],
                 seed: Optional[int]):
        self.num_samples = check_int("num_samples", num_samples, minimum=1)
        self.steps = check_int("steps", steps, minimum=1)
        self.generator = resolve_generator(generator, seed, type(self).__name__)
        self.step = 0  # global iteration index of the next batch (0-indexed)
        self._stamp_fingerprint(self.num_samples, self.steps)

    def __len__(self) -> int:
        return self.steps

    def _law_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(("num_samples", "steps", *self._params, *self._LAW)))

    def _draw(self) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        self._begin_draws()
        while True:
            self._check_law()
            batch = self._draw()
            self.step += 1
            self._count_draw(self.step - 1, len(batch))
            yield batch
            if self.step % self.steps == 0:
                return

    def state_dict(self) -> dict[str, Any]:
        """Generator state, global step and the participation state (between draws)."""
        state = {"generator_state": self.generator.get_state().clone(), "step": self.step,
                 "class": type(self).__name__, **self._ledger_state()}
        for name in self._params:
            state[name] = getattr(self, name)
        for name in self._state_tensors:
            value = getattr(self, name)
            state[name] = None if value is None else value.clone()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises if taken from a sampler with other parameters."""
        if state_dict.get("class") != type(self).__name__:
            raise ValueError(f"sampler state is for {state_dict.get('class')!r}, not "
                             f"{type(self).__name__!r}")
        check_matching_params(state_dict, self, self._params)
        self.generator.set_state(torch.as_tensor(state_dict["generator_state"],
                                                 dtype=torch.uint8).clone())
        self.step = check_int("step", state_dict["step"], minimum=0)
        self._load_ledger_state(state_dict)
        for name in self._state_tensors:
            value = state_dict[name]
            setattr(self, name, None if value is None else torch.as_tensor(value).clone())

    def _bernoulli(self, count: int, p: float) -> torch.Tensor:
        """``count`` independent Bernoulli(p) draws from the sampler's generator."""
        return torch.rand(count, generator=self.generator, dtype=torch.float64) < p

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._params)
        return f"{type(self).__name__}({args})"
