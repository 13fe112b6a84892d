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
4. **The sampler's parameters are changed after it was built** (``loader.batch_sampler.
   sample_rate = 3 * q`` after an epoch, a batch-size ramp-up): the accountant prices the
   parameters the sampler had when it was attached. Every sampler records the parameters that
   define its law at construction (:class:`FrozenParameters`) and raises
   :class:`SamplerParametersChangedError` before its next draw when one of them changed.

:func:`scheme_of_batch_sampler` answers "which scheme does this batch sampler implement" for
our samplers (their ``scheme`` attribute), wrappers (``inner``) and Opacus' Poisson samplers.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from opacus.data_loader import DPDataLoader
from opacus.utils.uniform_sampler import (
    DistributedUniformWithReplacementSampler,
    UniformWithReplacementSampler,
)
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from ..schemes.base import Scheme
from ..schemes.poisson import PoissonScheme
from ..schemes.shuffle import ShuffleScheme
from .draw_ledger import (  # noqa: F401  (their historical home: re-exported)
    DrawLedger,
    FrozenParameters,
    SamplerParametersChangedError,
    _same,
    draw_clock,
    live_samplers_drawn_since,
    parameters_changed_error,
    register_delivery_tracker,
    track_deliveries,
)

__all__ = ["DrawLedger", "FrozenParameters", "SamplerParametersChangedError",
           "scheme_of_batch_sampler", "stock_shuffle_scheme", "innermost_sampler",
           "check_data_loader", "describe_loader", "live_samplers_drawn_since", "draw_clock",
           "adopt_scheme", "check_replaceable_sampler", "PermutationCounter",
           "instrument_batch_sampler"]

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
    if isinstance(inner, (UniformWithReplacementSampler,
                          DistributedUniformWithReplacementSampler)):
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


def _partial_or_weighted(sampler, dataset_size: Optional[int]) -> Optional[str]:
    """Why ``sampler`` (a DataLoader's index sampler) is not a uniform pass over the whole
    dataset, or ``None`` when it is (sequential, or a permutation of all rows)."""
    from torch.utils.data import (
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
    )

    name = type(sampler).__name__
    if isinstance(sampler, WeightedRandomSampler):
        how = "with" if sampler.replacement else "without"
        return (f"{name}(num_samples={sampler.num_samples}) draws {sampler.num_samples} "
                f"examples per epoch by weight ({how} replacement), not uniformly")
    if isinstance(sampler, SubsetRandomSampler):
        return f"{name} draws only {len(sampler.indices)} of the {dataset_size} examples"
    if isinstance(sampler, RandomSampler):
        if sampler.replacement:
            return (f"RandomSampler(replacement=True, num_samples={sampler.num_samples}) draws "
                    f"with replacement")
        if dataset_size is not None and sampler.num_samples != dataset_size:
            return (f"RandomSampler(num_samples={sampler.num_samples}) draws "
                    f"{sampler.num_samples} of the {dataset_size} examples per epoch")
        return None
    if isinstance(sampler, SequentialSampler):
        return None
    try:
        n = len(sampler)
    except TypeError:
        return None
    if dataset_size is not None and n != dataset_size:
        return f"{name} draws {n} of the {dataset_size} examples per epoch"
    return None


def check_replaceable_sampler(loader, owner: str) -> None:
    """Raise ``ValueError`` when replacing ``loader``'s batches by a scheme's sampler over the
    whole dataset would silently change the run the user wrote: a weighted or partial index
    sampler (``WeightedRandomSampler``, ``SubsetRandomSampler``, ``RandomSampler`` with
    ``replacement=True`` or ``num_samples`` other than the dataset size, any sampler whose
    length is not the dataset's). Such a loader is not uniform subsampling of the dataset, so
    the scheme's sampler (e.g. uniform Poisson at q = 1/len(loader) over every row: Opacus'
    issue #813, 128 weighted draws of 100,000 rows become batches of ~12,500) would train a
    different mechanism from the one the user built. Plain, shuffled and sequential loaders
    pass, as do loaders already drawing with a scheme's sampler."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None or scheme_of_batch_sampler(batch_sampler) is not None:
        return
    sampler = getattr(batch_sampler, "sampler", None)
    if sampler is None:
        return
    dataset = getattr(loader, "dataset", None)
    try:
        size = len(dataset)
    except TypeError:
        size = None
    why = _partial_or_weighted(sampler, size)
    if why is None:
        return
    steps = len(loader)
    q = 1.0 / steps
    expected = f"{size * q:.6g}" if size is not None else "len(dataset)/len(loader)"
    raise ValueError(
        f"{owner}: the DataLoader's {why}. DP sampling would replace it by the scheme's sampler "
        f"over all {size} rows of the dataset at rate q = 1/len(data_loader) = 1/{steps}: "
        f"batches of about {expected} examples drawn uniformly, not the run you built, and "
        f"the epsilon would price that run. DP-SGD's amplification needs uniform sampling "
        f"from a fixed dataset: pass the rows to train on as the dataset "
        f"(torch.utils.data.Subset(dataset, indices)) with batch_size = the expected batch "
        f"you want and no sampler (or shuffle=True), and express example weights in the loss, "
        f"not in the sampling")


def scheme_accepts(scheme: Scheme, found) -> bool:
    """Whether batches drawn under ``found`` (a sampler's scheme) are priced by ``scheme``."""
    return bool(scheme.implemented_by(found))


class _CountingPoissonSampler(DrawLedger):
    """Opacus' own Poisson batch sampler (``UniformWithReplacementSampler`` or its distributed
    variant, what ``DPDataLoader`` uses) with its yielded batches counted: installed in a
    ``DPDataLoader`` when our accountant is attached to it, so the stock path checks at every
    step that the loader trained on is the one ``make_private`` returned. It is an instance of
    the Opacus class (``isinstance`` checks in Opacus, e.g. ``BatchMemoryManager``, still hold)
    and draws exactly what that class draws. Its parameters (``sample_rate``, ``num_samples``,
    ``steps``; for the distributed variant also the sharding) are frozen at that point: a
    change raises :class:`SamplerParametersChangedError` before the next draw."""

    _opacus_class: type = UniformWithReplacementSampler

    def _law_owner(self) -> str:
        return self._opacus_class.__name__

    def __iter__(self):
        self._begin_draws()
        batches = self._opacus_class.__iter__(self)
        while True:
            self._check_law()  # Opacus' loop reads sample_rate afresh at every draw
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._count_draw(size=len(batch))
            yield batch


#: The attributes that define the law of Opacus' Poisson samplers.
_OPACUS_LAW = {
    UniformWithReplacementSampler: ("num_samples", "sample_rate", "steps"),
    DistributedUniformWithReplacementSampler: ("total_size", "sample_rate", "num_batches",
                                               "num_samples", "num_replicas", "rank",
                                               "shuffle", "shuffle_seed"),
}


def _counting(sampler) -> DrawLedger:
    """A copy of ``sampler`` (an Opacus Poisson sampler, same attributes and generator) that
    counts its draws, with its law-defining parameters frozen."""
    if isinstance(sampler, DrawLedger):
        return sampler
    base = type(sampler)
    law = next((names for cls, names in _OPACUS_LAW.items() if isinstance(sampler, cls)), ())
    counting = type(f"Counting{base.__name__}", (_CountingPoissonSampler, base),
                    {"_opacus_class": base, "_LAW": law})
    counted = counting.__new__(counting)
    counted.__dict__.update(sampler.__dict__)
    counted._freeze_law()
    return counted


def sees_trained_batch(loader, source: Optional[DrawLedger]) -> bool:
    """Whether the draw the sampler reports as current is the batch a step trains on: a
    synchronous loader (``num_workers=0``), a
    :class:`~opacus_structured.samplers.ledger_loader.LedgerDataLoader`, or a sampler whose
    ``cursor`` someone who knows (``DPCallback``) installed."""
    if source is None or getattr(source, "cursor", None) is not None:
        return True
    if getattr(type(loader), "reports_deliveries", False):
        return True
    return int(getattr(loader, "num_workers", 0) or 0) == 0


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
    if inner is batch_sampler and type(inner) in (UniformWithReplacementSampler,
                                                  DistributedUniformWithReplacementSampler):
        # the stock DPDataLoader path: count Opacus' own draws (the loader refuses a plain
        # attribute assignment of batch_sampler after construction)
        inner = _counting(inner)
        object.__setattr__(loader, "batch_sampler", inner)
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


class PermutationCounter(DrawLedger, Sampler[int]):
    """Wraps the index sampler of a stock ``BatchSampler``: yields its indices unchanged,
    counts passes begun (``permutations_drawn``: one per ``iter()`` of the batch sampler) and
    batches completed (``batches_drawn``: every ``batch_size`` indices, plus the last partial
    batch unless ``drop_last``).

    The shuffle scheme it carries is the batch sampler's at construction: ``batch_size``,
    ``drop_last`` (its own and, given ``owner``, the ``BatchSampler``'s) and the number of
    indices per pass (``len(sampler)``) are frozen, and a pass started after one of them
    changed raises :class:`SamplerParametersChangedError` before its first index."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, scheme: ShuffleScheme,
                 owner: Optional[BatchSampler] = None):
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.scheme = scheme
        self.permutations_drawn = 0
        self._owner = owner  # the BatchSampler whose index sampler this is (a plain reference)
        self._freeze_law()

    def _law_owner(self) -> str:
        return type(self._owner if self._owner is not None else self).__name__

    def _law_values(self) -> dict[str, Any]:
        owner = self._owner
        source = owner if owner is not None else self
        values = {"batch_size": source.batch_size, "drop_last": bool(source.drop_last),
                  "sampler.num_samples": len(self.sampler)}
        if owner is not None:  # the counter's own copies must not drift either
            values["counter.batch_size"] = self.batch_size
            values["counter.drop_last"] = bool(self.drop_last)
        if isinstance(self.sampler, RandomSampler):
            values["sampler.replacement"] = bool(self.sampler.replacement)
        return values

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[int]:
        self._begin_draws()
        self._check_law()
        self.permutations_drawn += 1
        pulled = 0
        for index in self.sampler:
            pulled += 1
            if pulled % self.batch_size == 0:
                self._count_draw(size=self.batch_size)
            yield index
        if pulled % self.batch_size and not self.drop_last:
            self._count_draw(size=pulled % self.batch_size)

    def __repr__(self) -> str:
        return f"PermutationCounter({self.sampler!r})"


def instrument_batch_sampler(batch_sampler) -> Optional[PermutationCounter]:
    """Install (once) a :class:`PermutationCounter` in a stock ``BatchSampler`` whose index
    sampler is shuffling or sequential; returns it (``None`` for any other batch sampler)."""
    scheme = stock_shuffle_scheme(batch_sampler)
    if scheme is None:
        return None
    if not isinstance(batch_sampler.sampler, PermutationCounter):
        batch_sampler.sampler = PermutationCounter(batch_sampler.sampler,
                                                   batch_sampler.batch_size,
                                                   bool(batch_sampler.drop_last), scheme,
                                                   owner=batch_sampler)
    return batch_sampler.sampler
