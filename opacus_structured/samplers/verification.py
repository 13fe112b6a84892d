"""Is the DataLoader drawing the batches the accountant prices? Checks for every wiring path.

An accountant's ε is valid only for the sampler its scheme describes. Three things can make a
run print an ε that does not describe it, and each is checked here:

1. **The loader does not use the scheme's sampler** — Opacus replaced it with its
   ``DPDataLoader`` (``make_private(poisson_sampling=True)``, the default), it shuffles
   (``DataLoader(shuffle=True)``: no amplification guarantee, so the scheme's ε may be an
   under-report), or the sampler implements another scheme or another dataset size.
   :func:`check_data_loader` raises with the fix at ``make_private`` time.
2. **The loader that was checked is not the one being trained on.** Every sampler of this
   package counts the batches it yields (:class:`DrawLedger`); the accountant's optimizer hook
   checks at every step that the sampler has drawn at least one batch per priced step.
3. **Gradient accumulation** (several batches per noisy step) changes the sampling rate; it is
   caught by the rate Opacus reports (``sample_rate · accumulated_iterations``, see
   :meth:`~opacus_structured.schemes.base.Scheme.check_sample_rate`).

:func:`scheme_of_batch_sampler` answers "which scheme does this batch sampler implement" for
our samplers (their ``scheme`` attribute), wrappers (``inner``) and Opacus' Poisson samplers.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

from opacus.data_loader import DPDataLoader
from opacus.utils.uniform_sampler import (
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from ..schemes.base import Scheme
from ..schemes.poisson import PoissonScheme
from ..schemes.shuffle import ShuffleScheme

__all__ = ["DrawLedger", "scheme_of_batch_sampler", "stock_shuffle_scheme", "innermost_sampler", "check_data_loader",
           "describe_loader", "live_samplers_drawn_since", "draw_clock", "adopt_scheme"]

_CLOCK = itertools.count(1)
_LAST_TICK = 0
#: Samplers that have drawn at least one batch (weak: a sampler alive only here is dropped).
_DRAWN: "weakref.WeakSet[DrawLedger]" = weakref.WeakSet()


def draw_clock() -> int:
    """The tick of the most recent draw by any sampler (0 before the first)."""
    return _LAST_TICK


class DrawLedger:
    """Mixin counting the batches a sampler yields.

    ``batches_drawn`` is the number of batches this object has yielded in this process (a
    runtime counter, deliberately not part of ``state_dict``: it measures *this* run's draws,
    which the accountant compares with the steps it priced since it was attached).
    """

    batches_drawn: int = 0
    last_draw_tick: int = 0

    def _count_draw(self) -> None:
        global _LAST_TICK
        self.batches_drawn = self.batches_drawn + 1
        self.last_draw_tick = _LAST_TICK = next(_CLOCK)
        _DRAWN.add(self)


def adopt_scheme(given: Optional[Scheme], own: Scheme, owner: str) -> Scheme:
    """The scheme a sampler carries: ``given`` if it draws the batches ``own`` (the scheme the
    sampler's parameters describe) draws — same :meth:`~Scheme.batch_distribution` — else
    ``ValueError``; ``own`` when ``given`` is ``None``. This is how one sampler carries a
    scheme with pricing-only fields (a relation, an analysis, a noise strategy)."""
    if given is None:
        return own
    if not isinstance(given, Scheme):
        raise ValueError(f"scheme must be a Scheme, got {type(given).__name__}")
    if given.batch_distribution() != own.batch_distribution():
        raise ValueError(f"{owner} with these parameters draws the batches of {own!r}, not "
                         f"those of {given!r}; build it with scheme.sampler(...)")
    return given


def check_dataset_size(num_samples: Optional[int], dataset_size: int, scheme_name: str) -> None:
    """For schemes that fix the dataset size: ``num_samples`` (if given) must equal it."""
    if num_samples is not None and int(num_samples) != dataset_size:
        raise ValueError(f"scheme {scheme_name!r} is for dataset_size={dataset_size} but the "
                         f"dataset has {num_samples} examples")


def live_samplers_drawn_since(tick: int) -> list:
    """Samplers (still alive) whose last draw came after ``tick``, most recent first."""
    found = [s for s in list(_DRAWN) if s.last_draw_tick > tick]
    return sorted(found, key=lambda s: -s.last_draw_tick)


def innermost_sampler(batch_sampler):
    """Follow wrapper samplers (``inner``: the distributed shard wrapper, DPCallback's tracker)
    down to the sampler that actually draws."""
    seen = 0
    while getattr(batch_sampler, "inner", None) is not None and seen < 8:
        batch_sampler = batch_sampler.inner
        seen += 1
    return batch_sampler


def scheme_of_batch_sampler(batch_sampler) -> Optional[Any]:
    """The scheme a batch sampler implements, or ``None`` if it implements none.

    Our samplers carry a ``scheme`` attribute (a :class:`Scheme`, or for the b-min-sep samplers
    a parameter record that the Monte Carlo scheme matches); Opacus' ``UniformWithReplacementSampler``
    and ``DistributedUniformWithReplacementSampler`` (what ``DPDataLoader`` uses) are Poisson
    sampling at their ``sample_rate``. Anything else (``BatchSampler(RandomSampler)``: shuffling
    with a fixed batch size; ``SequentialSampler``) has no scheme of its own here — callbacks
    then install the scheme's sampler; the accountants' loader check
    (:func:`check_data_loader`) recognises it as the ``shuffle`` scheme
    (:func:`stock_shuffle_scheme`), which only the ``"shuffle"`` accountant accepts.
    """
    if batch_sampler is None:
        return None
    inner = innermost_sampler(batch_sampler)
    scheme = getattr(inner, "scheme", None)
    if scheme is not None:
        return scheme
    if type(inner) in (UniformWithReplacementSampler, DistributedUniformWithReplacementSampler):
        return PoissonScheme(sample_rate=inner.sample_rate)
    carried = getattr(getattr(inner, "sampler", None), "scheme", None)  # a counted stock loader
    return carried if isinstance(carried, ShuffleScheme) else None


def stock_shuffle_scheme(batch_sampler) -> Optional[ShuffleScheme]:
    """The :class:`~opacus_structured.schemes.shuffle.ShuffleScheme` that torch's
    ``BatchSampler`` draws over a ``RandomSampler`` without replacement covering the data once
    (``DataLoader(shuffle=True, batch_size=B)``) or over a ``SequentialSampler`` (a fixed
    order: the shuffle bound does not use the randomness); else ``None``. An index sampler
    already wrapped by the shuffle accountant's counter carries its scheme."""
    if type(batch_sampler) is not BatchSampler:
        return None
    inner = batch_sampler.sampler
    carried = getattr(inner, "scheme", None)
    if isinstance(carried, ShuffleScheme):
        return carried
    if type(inner) is RandomSampler:
        if inner.replacement or inner.num_samples != len(inner.data_source):
            return None
    elif type(inner) is not SequentialSampler:
        return None
    n = len(inner)
    if n < 1 or batch_sampler.batch_size is None or batch_sampler.batch_size > n:
        return None
    return ShuffleScheme(dataset_size=n, batch_size=batch_sampler.batch_size,
                         drop_last=bool(batch_sampler.drop_last))


def describe_loader(loader) -> str:
    """A short description of how ``loader`` draws batches, for error messages."""
    if isinstance(loader, DPDataLoader):
        return "Opacus' DPDataLoader (Poisson sampling)"
    bs = getattr(loader, "batch_sampler", None)
    if bs is None:
        return "no batch sampler (automatic batching disabled)"
    inner = getattr(bs, "sampler", None)
    if inner is not None and not hasattr(bs, "scheme"):
        kind = type(inner).__name__
        note = {"RandomSampler": " (shuffling)", "SequentialSampler": " (fixed order)"}
        return (f"{type(bs).__name__}({kind}){note.get(kind, '')} with batch_size="
                f"{getattr(bs, 'batch_size', '?')}")
    return type(bs).__name__


def scheme_accepts(scheme: Scheme, found) -> bool:
    """Whether batches drawn under ``found`` (a sampler's scheme) are priced by ``scheme``."""
    return bool(scheme.implemented_by(found))


def check_data_loader(scheme: Scheme, loader) -> Optional[DrawLedger]:
    """Raise ``ValueError`` unless ``loader`` draws batches with ``scheme``'s sampler.

    Checks the batch sampler's scheme (with its parameters, not only the rate), Opacus'
    ``DPDataLoader`` substitution, shuffled and sequential loaders, and that the sampler indexes
    a dataset of the loader's size. Returns the sampler that counts its draws (our samplers), or
    ``None`` when the sampler is Opacus' own (Poisson), whose draws are not counted.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = scheme_of_batch_sampler(batch_sampler)
    if found is None and batch_sampler is not None:  # a stock shuffled / sequential loader
        found = stock_shuffle_scheme(innermost_sampler(batch_sampler))
    fix = (f"pass batch_sampler=scheme.sampler(...) (the sampler of {scheme.name!r}) to the "
           f"DataLoader and make_private(..., poisson_sampling=False)")
    if isinstance(loader, DPDataLoader) and not isinstance(scheme, PoissonScheme):
        raise ValueError(
            f"the DataLoader is Opacus' DPDataLoader (Poisson sampling): make_private replaced "
            f"your DataLoader because poisson_sampling=True is its default, but the accountant "
            f"prices scheme {scheme.name!r} ({scheme!r}), whose epsilon is not valid for Poisson "
            f"batches; pass poisson_sampling=False to make_private and keep "
            f"batch_sampler=scheme.sampler(...) in the DataLoader")
    if found is None:
        desc = describe_loader(loader)
        why = (" Shuffling has no subsampling-amplification guarantee, so the scheme's epsilon "
               "could be an under-report." if "shuffling" in desc else "")
        raise ValueError(f"the DataLoader draws batches with {desc}, but the accountant prices "
                         f"scheme {scheme.name!r}, whose epsilon is only valid for that scheme's "
                         f"sampler.{why} Fix: {fix}")
    if isinstance(found, ShuffleScheme) and not isinstance(scheme, ShuffleScheme):
        desc = describe_loader(loader)
        other = ("let Opacus draw Poisson batches, which 'poisson' prices: "
                 "make_private(..., poisson_sampling=True)" if isinstance(scheme, PoissonScheme)
                 else fix)
        raise ValueError(
            f"the DataLoader draws batches with {desc}: fixed-size batches, every example once "
            f"per epoch, i.e. the 'shuffle' scheme ({found!r}), but the accountant prices scheme "
            f"{scheme.name!r} ({scheme!r}). Shuffling has no subsampling-amplification "
            f"guarantee, so the scheme's epsilon could be an under-report. Fix: price this "
            f"loader soundly with the 'shuffle' accountant (PrivacyEngine(accountant='shuffle'), "
            f"or opacus_structured.make_private(engine, scheme='shuffle', ...)), or {other}")
    if not scheme_accepts(scheme, found):
        raise ValueError(f"the DataLoader's batch sampler implements {found!r} but the "
                         f"accountant prices {scheme!r}: build the sampler and the accountant "
                         f"from the same scheme")
    inner = innermost_sampler(batch_sampler)
    size = getattr(inner, "num_samples", None)
    dataset = getattr(loader, "dataset", None)
    if size is not None and dataset is not None and hasattr(dataset, "__len__") \
            and len(dataset) != size:
        raise ValueError(f"the batch sampler draws from {size} examples but the DataLoader's "
                         f"dataset has {len(dataset)}: build the sampler with the dataset's "
                         f"size (scheme.sampler(len(dataset), ...))")
    if isinstance(inner, DrawLedger):
        return inner
    counter = getattr(inner, "sampler", None)  # a stock BatchSampler's counted index sampler
    return counter if isinstance(counter, DrawLedger) else None
