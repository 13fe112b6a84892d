"""Issue 39: a sampler's parameters are frozen when it is built.

The accountant prices the parameters a sampler had when it was attached. Changing one afterwards
(``loader.batch_sampler.sample_rate = 3 * q`` after an epoch: a batch-size ramp-up) used to go
unnoticed and the printed ε under-reported (5.389 printed, true ε ≥ 11.87 in the issue's
reproduction). Every sampler of the package, the distributed wrapper and Opacus' own Poisson and
stock shuffle samplers (as instrumented by the accountant) now raise
:class:`SamplerParametersChangedError` before the next draw, naming the attribute, its old and
new value and the fix; unchanged loops, assignments of the same value and
``state_dict`` / ``load_state_dict`` resumes still work.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from opacus import PrivacyEngine
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import opacus_structured
from opacus_structured import samplers as samplers_pkg
from opacus_structured.samplers import SamplerParametersChangedError, draw_ledger
from opacus_structured.samplers import verification as ver
from opacus_structured.samplers._mf_base import MFBatchSampler
from opacus_structured.samplers._resumable import EpochResumableSampler
from opacus_structured.samplers.balls_in_bins import BallsInBinsBatchSampler
from opacus_structured.samplers.bminsep import BMinSepBatchSampler, WarmStartBMinSepBatchSampler
from opacus_structured.samplers.cyclic_poisson import CyclicPoissonBatchSampler
from opacus_structured.samplers.distributed import DistributedBatchSampler
from opacus_structured.samplers.full_batch import FullBatchSampler
from opacus_structured.samplers.multi_attribution import MultiAttributionBMinSepBatchSampler
from opacus_structured.samplers.poisson import PoissonBatchSampler
from opacus_structured.samplers.shuffle import PermutationCounter, ShuffleBatchSampler
from opacus_structured.samplers.structured import StructuredWindowSampler
from opacus_structured.samplers.truncated_poisson import TruncatedPoissonSampler
from opacus_structured.schemes.shuffle import ShuffleScheme
from opacus_structured.schemes.structured import StructuredScheme

warnings.filterwarnings("ignore", message="Secure RNG turned off")


def _structured(**kw):
    base = dict(num_series=12, series_length=30, context_length=4, forecast_length=3,
                batch_size=4)
    base.update(kw)
    return StructuredScheme(**base)


def _stock_counter():
    batch_sampler = BatchSampler(RandomSampler(range(50)), batch_size=10, drop_last=False)
    ver.instrument_batch_sampler(batch_sampler)
    return batch_sampler


# (id, factory, owner in the message, attribute, how to change it, old value, new value);
# ``change`` mutates the object the user holds (the batch sampler of the loader).
def _set(name, value):
    return lambda s: setattr(s, name, value)


CASES = [
    ("poisson-rate", lambda: PoissonBatchSampler(60, 0.1, seed=0), "PoissonBatchSampler",
     "sample_rate", _set("sample_rate", 0.3), 0.1, 0.3),
    ("poisson-n", lambda: PoissonBatchSampler(60, 0.1, seed=0), "PoissonBatchSampler",
     "num_samples", _set("num_samples", 70), 60, 70),
    ("poisson-steps", lambda: PoissonBatchSampler(60, 0.1, seed=0), "PoissonBatchSampler",
     "steps", _set("steps", 20), 10, 20),
    ("shuffle-batch", lambda: ShuffleBatchSampler(60, 10, seed=0), "ShuffleBatchSampler",
     "batch_size", _set("batch_size", 30), 10, 30),
    ("shuffle-drop-last", lambda: ShuffleBatchSampler(65, 10, seed=0), "ShuffleBatchSampler",
     "drop_last", _set("drop_last", True), False, True),
    ("shuffle-steps", lambda: ShuffleBatchSampler(60, 10, seed=0), "ShuffleBatchSampler",
     "steps", _set("steps", 2), 6, 2),
    ("truncated-rate", lambda: TruncatedPoissonSampler(60, 0.1, 8, seed=0),
     "TruncatedPoissonSampler", "sample_rate", _set("sample_rate", 0.3), 0.1, 0.3),
    ("truncated-max", lambda: TruncatedPoissonSampler(60, 0.1, 8, seed=0),
     "TruncatedPoissonSampler", "max_batch_size", _set("max_batch_size", 24), 8, 24),
    ("truncated-pad", lambda: TruncatedPoissonSampler(60, 0.1, 8, seed=0),
     "TruncatedPoissonSampler", "pad", _set("pad", False), True, False),
    ("structured-scheme", lambda: _structured().sampler(seed=0), "StructuredWindowSampler",
     "scheme", _set("scheme", _structured(batch_size=8)), _structured(),
     _structured(batch_size=8)),
    ("structured-steps", lambda: _structured().sampler(seed=0), "StructuredWindowSampler",
     "steps", _set("steps", 9), 3, 9),
    ("structured-series", lambda: _structured().sampler(seed=0), "StructuredWindowSampler",
     "series_per_step", _set("series_per_step", 8), 4, 8),
    ("full-batch", lambda: FullBatchSampler(40), "FullBatchSampler", "num_samples",
     _set("num_samples", 20), 40, 20),
    ("balls-in-bins", lambda: BallsInBinsBatchSampler(60, 6, epochs=3, seed=0),
     "BallsInBinsBatchSampler", "num_bins", _set("num_bins", 3), 6, 3),
    ("balls-in-bins-epochs", lambda: BallsInBinsBatchSampler(60, 6, epochs=3, seed=0),
     "BallsInBinsBatchSampler", "epochs", _set("epochs", 9), 3, 9),
    ("cyclic-rate", lambda: CyclicPoissonBatchSampler(120, 6, 2, seed=0),
     "CyclicPoissonBatchSampler", "sample_rate", _set("sample_rate", 0.5), 0.1, 0.5),
    ("cyclic-bands", lambda: CyclicPoissonBatchSampler(120, 6, 2, seed=0),
     "CyclicPoissonBatchSampler", "cycle_length", _set("cycle_length", 4), 2, 4),
    ("bminsep-p", lambda: BMinSepBatchSampler(100, 0.1, 3, steps=5, seed=0),
     "BMinSepBatchSampler", "p", _set("p", 0.4), 0.1, 0.4),
    ("bminsep-sep", lambda: BMinSepBatchSampler(100, 0.1, 3, steps=5, seed=0),
     "BMinSepBatchSampler", "min_sep", _set("min_sep", 1), 3, 1),
    ("bminsep-truncate", lambda: BMinSepBatchSampler(100, 0.1, 3, steps=5,
                                                     truncated_batch_size=8, seed=0),
     "BMinSepBatchSampler", "truncated_batch_size", _set("truncated_batch_size", 30), 8, 30),
    ("bminsep-warm", lambda: WarmStartBMinSepBatchSampler(100, 0.1, 3, steps=5, seed=0),
     "WarmStartBMinSepBatchSampler", "p", _set("p", 0.4), 0.1, 0.4),
    ("multi-attribution", lambda: MultiAttributionBMinSepBatchSampler(
        [[i % 20] for i in range(100)], 0.1, 3, max_user_examples=5, steps=5, seed=0),
     "MultiAttributionBMinSepBatchSampler", "p", _set("p", 0.4), 0.1, 0.4),
    ("distributed-inner", lambda: DistributedBatchSampler(PoissonBatchSampler(60, 0.1, seed=0),
                                                          num_replicas=2, rank=0),
     "PoissonBatchSampler", "sample_rate", lambda s: setattr(s.inner, "sample_rate", 0.3),
     0.1, 0.3),
    ("distributed-shadow", lambda: DistributedBatchSampler(PoissonBatchSampler(60, 0.1, seed=0),
                                                           num_replicas=2, rank=0),
     "DistributedBatchSampler", "sample_rate", _set("sample_rate", 0.3), 0.1, 0.3),
    ("distributed-replicas", lambda: DistributedBatchSampler(
        PoissonBatchSampler(60, 0.1, seed=0), num_replicas=2, rank=0),
     "DistributedBatchSampler", "num_replicas", _set("num_replicas", 3), 2, 3),
    ("opacus-rate", lambda: ver._counting(UniformWithReplacementSampler(
        num_samples=60, sample_rate=0.1, generator=torch.Generator().manual_seed(0))),
     "UniformWithReplacementSampler", "sample_rate", _set("sample_rate", 0.3), 0.1, 0.3),
    ("opacus-steps", lambda: ver._counting(UniformWithReplacementSampler(
        num_samples=60, sample_rate=0.1, generator=torch.Generator().manual_seed(0))),
     "UniformWithReplacementSampler", "steps", _set("steps", 3), 10, 3),
    ("stock-shuffle-batch", _stock_counter, "BatchSampler", "batch_size",
     _set("batch_size", 25), 10, 25),
    ("stock-shuffle-drop-last", _stock_counter, "BatchSampler", "drop_last",
     _set("drop_last", True), False, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_changed_parameter_raises_before_the_next_draw(case):
    _, make, owner, attribute, change, old, new = case
    sampler = make()
    first = next(iter(sampler))  # a draw before the change is fine
    assert isinstance(first, list)
    change(sampler)
    with pytest.raises(SamplerParametersChangedError) as info:
        next(iter(sampler))
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.owner, err.attribute, err.old, err.new) == (owner, attribute, old, new)
    message = str(err)
    old_text, new_text = draw_ledger._short_repr(old), draw_ledger._short_repr(new)
    assert message.startswith(f"{owner}.{attribute} was changed from {old_text} to {new_text} "
                              f"after the sampler was built.")
    assert (f"prices the parameters the sampler had when it was attached "
            f"({attribute}={old_text})") in message
    assert "under-report" in message and "a new make_private run" in message
    assert f"set {attribute} back to {old_text}" in message
    if attribute == "scheme":  # a scheme names the fields that differ
        assert "after the sampler was built. Fields changed: batch_size 4 -> 8. " in message


def test_every_sampler_class_of_the_package_is_covered():
    """Every concrete draw-counting sampler defined by the package has a case above."""
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    abstract = {EpochResumableSampler, MFBatchSampler, ver._CountingPoissonSampler}
    defined = {c for c in subclasses(ver.DrawLedger)
               if c.__module__.startswith("opacus_structured.samplers")
               and c not in abstract and not issubclass(c, ver._CountingPoissonSampler)}
    covered = {type(case[1]()) for case in CASES}
    covered |= {type(s.inner) for s in map(lambda c: c[1](), CASES)
                if isinstance(s, DistributedBatchSampler)}
    covered |= {PermutationCounter}  # the stock-shuffle cases' index sampler
    assert defined <= covered, defined - covered
    assert DistributedBatchSampler in covered and StructuredWindowSampler in covered


def test_the_change_is_refused_before_the_generator_moves_and_reverting_it_continues():
    """The refused draw consumes nothing: setting the value back continues the very stream an
    untouched twin sampler draws."""
    sampler, twin = PoissonBatchSampler(60, 0.1, seed=3), PoissonBatchSampler(60, 0.1, seed=3)
    assert list(itertools.islice(iter(sampler), 4)) == list(itertools.islice(iter(twin), 4))
    state = sampler.generator.get_state().clone()
    sampler.sample_rate = 0.5
    with pytest.raises(SamplerParametersChangedError, match="sample_rate"):
        list(sampler)
    assert torch.equal(sampler.generator.get_state(), state)
    sampler.sample_rate = 0.1
    # the interrupted epoch ends (as after a break) on both samplers; the next draws agree
    assert list(sampler) == list(twin)


def test_a_change_mid_epoch_raises_at_the_next_batch():
    sampler = ShuffleBatchSampler(60, 10, seed=0)
    it = iter(sampler)
    assert len(next(it)) == 10
    sampler.batch_size = 20
    with pytest.raises(SamplerParametersChangedError,
                       match=r"ShuffleBatchSampler\.batch_size was changed from 10 to 20"):
        next(it)


def test_an_in_place_edit_of_an_array_parameter_is_caught():
    sampler = _structured().sampler([30] * 11 + [40], seed=0)
    list(sampler)
    sampler.lengths[0] = 31
    with pytest.raises(SamplerParametersChangedError,
                       match=r"StructuredWindowSampler\.lengths was changed from array"):
        list(sampler)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_unchanged_loops_and_same_value_assignments_run(case):
    _, make, _, attribute, _, old, _ = case
    sampler = make()
    for _ in range(2):
        assert len(list(sampler)) == len(sampler)
    target = sampler.inner if case[0] == "distributed-inner" else sampler
    setattr(target, attribute, old)  # the same value: the law is unchanged
    assert len(list(sampler)) == len(sampler)


@pytest.mark.parametrize("make", [
    lambda: PoissonBatchSampler(60, 0.1, seed=1),
    lambda: ShuffleBatchSampler(60, 10, seed=1),
    lambda: TruncatedPoissonSampler(60, 0.1, 8, seed=1),
    lambda: _structured(top_level="shuffle").sampler(seed=1),
    lambda: CyclicPoissonBatchSampler(120, 6, 2, seed=1),
    lambda: BallsInBinsBatchSampler(60, 6, epochs=3, seed=1),
    lambda: BMinSepBatchSampler(100, 0.1, 3, steps=5, seed=1),
    lambda: MultiAttributionBMinSepBatchSampler([[i % 20] for i in range(100)], 0.1, 3,
                                                max_user_examples=5, steps=5, seed=1),
    lambda: DistributedBatchSampler(PoissonBatchSampler(60, 0.1, seed=1), num_replicas=2,
                                    rank=1),
], ids=["poisson", "shuffle", "truncated", "structured", "cyclic", "balls-in-bins", "bminsep",
        "multi-attribution", "distributed"])
def test_resume_through_state_dict_still_works(make):
    """A state saved mid-epoch and loaded into a fresh sampler of the same parameters (and into
    the same sampler) continues the uninterrupted stream; nothing is refused."""
    reference = make()
    it = iter(reference)
    next(it)
    state = reference.state_dict()
    expected = list(it)
    fresh = make()
    fresh.load_state_dict(state)
    assert list(fresh) == expected
    reference.load_state_dict(state)
    assert list(reference) == expected


def test_full_batch_resume_still_works():
    sampler = FullBatchSampler(40)
    list(sampler)
    fresh = FullBatchSampler(40)
    fresh.load_state_dict(sampler.state_dict())
    assert list(fresh) == [list(range(40))] and fresh.last_draw_index == 1


def test_load_state_dict_of_other_parameters_is_still_refused_by_its_own_check():
    saved = PoissonBatchSampler(60, 0.2, seed=0).state_dict()
    with pytest.raises(ValueError, match="sampler state has sample_rate=0.2"):
        PoissonBatchSampler(60, 0.1, seed=0).load_state_dict(saved)


# ---- the reproduction shape and the engine paths ------------------------------------
def _data(n=60):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 2, (n,), generator=g))


def _model():
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _epoch(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_repro_rate_ramp_after_epoch_one_raises_at_the_next_draw(num_workers):
    """make_private(scheme "poisson"), one epoch at q = 1/6, then ``sample_rate = 3q``: the next
    epoch's first draw raises; the accountant priced only the epoch drawn at q."""
    model, optimizer = _model()
    engine = PrivacyEngine(accountant="poisson")
    model, optimizer, loader = opacus_structured.make_private(
        engine, module=model, optimizer=optimizer,
        data_loader=DataLoader(_data(), batch_size=10, num_workers=num_workers),
        noise_multiplier=1.0, max_grad_norm=1.0, dataset_size=60,
        sampler_generator=torch.Generator().manual_seed(0))
    assert type(loader.batch_sampler) is PoissonBatchSampler and len(loader) == 6
    _epoch(model, optimizer, loader)
    q = 1.0 / len(loader)
    loader.batch_sampler.sample_rate = 3 * q
    with pytest.raises(SamplerParametersChangedError) as info:
        _epoch(model, optimizer, loader)
    assert info.value.attribute == "sample_rate"
    assert info.value.old == pytest.approx(q) and info.value.new == pytest.approx(3 * q)
    assert f"PoissonBatchSampler.sample_rate was changed from {q!r} to {3 * q!r}" \
        in str(info.value)
    assert len(engine.accountant) == 6  # only the steps drawn at q were priced
    loader.batch_sampler.sample_rate = q  # reverted: the run continues at the priced rate
    _epoch(model, optimizer, loader)
    assert len(engine.accountant) == 12


def test_opacus_stock_poisson_path_refuses_a_rate_change():
    model, optimizer = _model()
    engine = PrivacyEngine(accountant="poisson")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=DataLoader(_data(), batch_size=10),
        noise_multiplier=1.0, max_grad_norm=1.0)
    assert isinstance(loader.batch_sampler, UniformWithReplacementSampler)
    _epoch(model, optimizer, loader)
    loader.batch_sampler.sample_rate = 0.5
    with pytest.raises(SamplerParametersChangedError,
                       match=r"UniformWithReplacementSampler\.sample_rate was changed from "
                             r"0\.1666\d* to 0\.5"):
        _epoch(model, optimizer, loader)
    assert len(engine.accountant) == 6


def test_opacus_stock_shuffle_path_refuses_a_batch_size_change():
    model, optimizer = _model()
    engine = PrivacyEngine(accountant="shuffle")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer,
        data_loader=DataLoader(_data(), batch_size=10, shuffle=True), noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=False)
    assert isinstance(loader.batch_sampler.sampler, PermutationCounter)
    assert engine.accountant.scheme == ShuffleScheme(dataset_size=60, batch_size=10)
    _epoch(model, optimizer, loader)
    loader.batch_sampler.batch_size = 30
    with pytest.raises(SamplerParametersChangedError,
                       match=r"BatchSampler\.batch_size was changed from 10 to 30"):
        _epoch(model, optimizer, loader)
    assert len(engine.accountant) == 6


def test_the_error_is_exported():
    assert samplers_pkg.SamplerParametersChangedError is ver.SamplerParametersChangedError
    assert "SamplerParametersChangedError" in ver.__all__
    assert issubclass(SamplerParametersChangedError, ValueError)
    assert np.array_equal(_structured().sampler(seed=0)._law["lengths"], [30] * 12)
