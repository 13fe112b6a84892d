r"""Shuffle batch sampler: the sampler that :class:`~opacus_structured.schemes.shuffle.ShuffleScheme`
prices, and the instrument that lets the ``"shuffle"`` accountant price a stock torch loader.

Exact semantics of :class:`ShuffleBatchSampler` (n = ``num_samples``, B = ``batch_size``):

* at the start of every epoch (every ``iter()`` that starts at position 0) it draws a fresh
  uniformly random permutation π of ``0..n-1`` (``torch.randperm(n, generator=...)``);
* batch ``j`` of the epoch is ``π[jB : (j+1)B]``: every example is in **exactly one** batch of
  the epoch (at most one with ``drop_last``), batches have exactly B examples except the last,
  which has ``n mod B`` — or is **dropped** with ``drop_last=True`` (its examples are in no
  batch that epoch). ``len(sampler)`` is ``ceil(n/B)``, or ``floor(n/B)`` with ``drop_last``:
  torch's ``BatchSampler(RandomSampler(data), B, drop_last)`` draws the same law;
* Opacus' hook reports ``sample_rate = 1/len(loader)``, the rate the scheme expects, and
  ``expected_batch_size = B`` is the public normaliser;
* a loop that leaves the epoch early and calls ``iter()`` again starts a new permutation: the
  sampler counts permutations begun (``permutations_drawn``) and batches yielded
  (:class:`~opacus_structured.samplers.verification.DrawLedger`), and the ``"shuffle"``
  accountant prices every permutation a step drew from as a full epoch;
* ``state_dict()`` holds the generator state at the start of the current epoch, the position in
  it and the completed epochs: ``load_state_dict`` then ``iter()`` redraws the same permutation
  and continues at the same batch (exact resume).

Valid accountant: :class:`~opacus_structured.accountants.shuffle.ShuffleAccountant`
(``PrivacyEngine(accountant="shuffle")``): no amplification, μ = Δ√E/σ.

:class:`PermutationCounter` wraps the index sampler (``RandomSampler`` or ``SequentialSampler``)
inside a stock ``BatchSampler`` so that the same counts exist for a plain
``DataLoader(shuffle=True, batch_size=B)`` (:func:`instrument_batch_sampler`, called by the
accountant when it is attached to such a loader). It yields exactly the wrapped sampler's
indices.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import Sampler

from .._validation import check_int
from ..schemes.registry import register_sampler
from ..schemes.shuffle import ShuffleScheme
from ._generator import resolve_generator
from ._resumable import EpochResumableSampler
from .verification import (  # noqa: F401  (re-exported)
    PermutationCounter,
    adopt_scheme,
    instrument_batch_sampler,
)

__all__ = ["ShuffleBatchSampler", "PermutationCounter", "instrument_batch_sampler"]


class ShuffleBatchSampler(EpochResumableSampler, Sampler[list[int]]):
    """A fresh random permutation per epoch, cut into batches of ``batch_size`` (module doc).

    Args:
        num_samples: n >= 1.
        batch_size: B in [1, n].
        drop_last: drop the last partial batch.
        generator / seed: a dedicated ``torch.Generator`` or a seed (default OS entropy).
        scheme: the scheme carried (default ``ShuffleScheme(n, B, drop_last)``); any scheme
            given must draw the same batches (its relation / bound are pricing choices).

    ``num_samples``, ``batch_size``, ``drop_last`` and ``steps`` are fixed once built: a draw
    after one was changed raises :class:`~.verification.SamplerParametersChangedError`.
    """

    _KEYS = ("num_samples", "batch_size", "drop_last")
    _LAW = (*_KEYS, "steps")  # frozen at construction, checked before every draw

    def __init__(self, num_samples: int, batch_size: int, *, drop_last: bool = False,
                 generator: Optional[torch.Generator] = None, seed: Optional[int] = None,
                 scheme: Optional[ShuffleScheme] = None):
        own = ShuffleScheme(dataset_size=num_samples, batch_size=batch_size,
                            drop_last=drop_last)
        self.num_samples = own.dataset_size
        self.batch_size = own.batch_size
        self.drop_last = own.drop_last
        self.steps = own.steps_per_epoch()
        if self.steps < 1:
            raise ValueError(f"batch_size={batch_size} > num_samples={num_samples} with "
                             f"drop_last=True: an epoch would have no batch")
        self.expected_batch_size = self.batch_size
        self.generator = resolve_generator(generator, seed, "ShuffleBatchSampler")
        self.scheme = adopt_scheme(scheme, own, "ShuffleBatchSampler")
        self.epoch = 0
        self.permutations_drawn = 0
        self._position = 0
        self._pending: Optional[dict] = None
        self._perm: Optional[torch.Tensor] = None
        self._perm_state: Optional[torch.Tensor] = None
        self._freeze_law()

    def __len__(self) -> int:
        return self.steps

    def _draw_permutation(self) -> None:
        self._perm_state = self.generator.get_state().clone()
        self._perm = torch.randperm(self.num_samples, generator=self.generator)

    def __iter__(self) -> Iterator[list[int]]:
        self._resume()
        while self._position < self.steps:
            self._check_law()
            if self._perm is None:
                self._draw_permutation()
                self.permutations_drawn += 1
            start = self._position * self.batch_size
            batch = self._perm[start:start + self.batch_size].tolist()
            self._advance(len(batch))
            yield batch

    def _restore_extra(self, state: Optional[dict[str, Any]]) -> None:
        self._perm = None
        if state is not None and self._position > 0:
            # mid-epoch: redraw the epoch's permutation from its starting generator state
            self.generator.set_state(torch.as_tensor(state["permutation_generator_state"],
                                                     dtype=torch.uint8).clone())
            self._draw_permutation()
            self.permutations_drawn += 1

    def _end_epoch(self) -> None:
        self._perm = None

    def state_dict(self) -> dict[str, Any]:
        """Generator state, position, completed epochs (+ the epoch's starting generator state
        when taken mid-epoch)."""
        state = self._epoch_state()
        if self._pending is None and 0 < self._position < self.steps:
            state["permutation_generator_state"] = self._perm_state.clone()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` continues where it left off."""
        if int(state_dict.get("position", 0)) > 0 and \
                "permutation_generator_state" not in state_dict:
            raise ValueError("sampler state taken mid-epoch lacks 'permutation_generator_state'")
        self._stage(state_dict)

    def __repr__(self) -> str:
        return (f"ShuffleBatchSampler(num_samples={self.num_samples}, "
                f"batch_size={self.batch_size}, drop_last={self.drop_last})")


@register_sampler(ShuffleScheme)
def shuffle_batch_sampler(scheme: ShuffleScheme, num_samples: Optional[int] = None, *,
                          generator: Optional[torch.Generator] = None,
                          seed: Optional[int] = None) -> ShuffleBatchSampler:
    """``scheme.sampler(n)``: the scheme's batch size and ``drop_last``; ``n`` defaults to (and
    must equal) ``scheme.dataset_size``."""
    if scheme.is_template():
        raise ValueError("a ShuffleScheme template has no batch size: give dataset_size and "
                         "batch_size (ShuffleScheme(dataset_size=n, batch_size=B))")
    if num_samples is not None and check_int("num_samples", num_samples, minimum=1) != \
            scheme.dataset_size:
        raise ValueError(f"scheme 'shuffle' is for dataset_size={scheme.dataset_size} but the "
                         f"dataset has {num_samples} examples")
    return ShuffleBatchSampler(scheme.dataset_size, scheme.batch_size,
                               drop_last=scheme.drop_last, generator=generator, seed=seed,
                               scheme=scheme)


# ---- stock torch loaders: PermutationCounter / instrument_batch_sampler live in verification.py
# (the accountants import them while the samplers package may still be importing).
