"""A wrong set-up never prints an ε: the batches must be the scheme's, or training stops.

Each test below is a set-up that used to run to the end and print an ε that did not describe
the training (issue: "Never a silent wrong ε"), now refused with an error naming the fix; plus
a property test over random (scheme, loader) pairs: every mismatch raises, every match trains
and reports the ε of the same accountant fed by hand.
"""

from __future__ import annotations

import math

import re
from pathlib import Path

import pytest
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_structured  # noqa: F401  (registers accountants)
from opacus_structured.accountants.base import (
    AccountantNotAttachedError,
    SchemeAccountant,
    data_loader_of_make_private,
    register_scheme_accountant,
)
from opacus_structured.samplers.poisson import PoissonBatchSampler
from opacus_structured.samplers.verification import check_data_loader, scheme_of_batch_sampler
from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme
from opacus_structured.schemes.poisson import PoissonScheme

N = 120
D = 1e-3  # coarse pessimistic discretisation for unit tests
ROOT = Path(__file__).resolve().parents[1]


def _dataset(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


def _train(loader, *, accountant=None, assign_after=False, steps=3, loop_loader=None,
           accumulate=1, engine=None, **make_private):
    """A stock Opacus loop; returns the engine (its accountant is what it reports)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = engine or PrivacyEngine()
    if accountant is not None and not assign_after:
        engine.accountant = accountant
    model, opt, dl = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                         noise_multiplier=1.0, max_grad_norm=1.0, **make_private)
    if assign_after:
        engine.accountant = accountant
    taken = i = 0
    while taken < steps:  # as many epochs as it takes
        for x, y in loop_loader or dl:
            nn.functional.cross_entropy(model(x), y).backward() if len(x) else None
            i += 1
            if i % accumulate == 0:
                opt.step()
                opt.zero_grad()
                taken += 1
            if taken == steps:
                break
    return engine


BIB = BallsInBinsScheme(num_bins=10, epochs=1)


# ---- the wrong set-ups found by trying Opacus' own examples ---------------------------------
def test_balls_in_bins_with_poisson_sampling_forgotten_raises_at_make_private():
    loader = DataLoader(_dataset(), batch_sampler=BIB.sampler(N, seed=1))
    with pytest.raises(ValueError, match="DPDataLoader.*poisson_sampling=False"):
        _train(loader, accountant=SchemeAccountant(BIB))  # poisson_sampling=True by default


def test_balls_in_bins_accountant_with_a_shuffled_loader_raises():
    loader = DataLoader(_dataset(), batch_size=12, shuffle=True)
    with pytest.raises(ValueError, match="shuffling.*under-report"):
        _train(loader, accountant=SchemeAccountant(BIB), poisson_sampling=False)


def test_accountant_assigned_after_make_private_raises_instead_of_zero():
    loader = DataLoader(_dataset(), batch_sampler=BIB.sampler(N, seed=1))
    engine = _train(loader, accountant=SchemeAccountant(BIB), assign_after=True,
                    poisson_sampling=False)
    with pytest.raises(AccountantNotAttachedError, match="before make_private"):
        engine.get_epsilon(1e-5)


def test_sampler_for_another_dataset_size_raises():
    loader = DataLoader(_dataset(), batch_sampler=BIB.sampler(N - 20, seed=1))
    with pytest.raises(ValueError, match="100 examples but the DataLoader's dataset has 120"):
        _train(loader, accountant=SchemeAccountant(BIB), poisson_sampling=False)


def test_sampler_of_another_scheme_raises_naming_both():
    loader = DataLoader(_dataset(), batch_sampler=BallsInBinsScheme(5, 1).sampler(N, seed=1))
    with pytest.raises(ValueError, match="num_bins=5.*num_bins=10"):
        _train(loader, accountant=SchemeAccountant(BIB), poisson_sampling=False)


def test_training_on_another_loader_than_make_private_returned_raises():
    loader = DataLoader(_dataset(), batch_sampler=BIB.sampler(N, seed=1))
    other = DataLoader(_dataset(), batch_size=12, shuffle=True)
    with pytest.raises(RuntimeError, match="another DataLoader"):
        _train(loader, accountant=SchemeAccountant(BIB), poisson_sampling=False,
               loop_loader=other)


def test_gradient_accumulation_is_priced_from_the_rows_each_step_summed():
    """Issue 39: two bins summed into one noisy step (two backward passes, one step) are
    observed from the rows and priced by noise splitting (each bin at σ/√2), at least the
    exact mechanism's own pricing (balls-in-bins with 5 merged bins at σ)."""
    loader = DataLoader(_dataset(), batch_sampler=BIB.sampler(N, seed=1))
    engine = _train(loader, accountant=SchemeAccountant(BIB, discretization=D),
                    poisson_sampling=False, accumulate=2, steps=5)
    assert engine.accountant.history == [(1.0 / math.sqrt(2), 0.1, 10)]
    merged = BallsInBinsScheme(num_bins=5, epochs=1).epsilon(1.0, 5, 1e-5, discretization=D)
    assert engine.get_epsilon(1e-5) >= merged > BIB.epsilon(1.0, 10, 1e-5, discretization=D)


def test_whole_run_scheme_raises_beyond_the_planned_run():
    loader = DataLoader(_dataset(), batch_sampler=BIB.sampler(N, seed=1))
    with pytest.raises(RuntimeError, match="exhausted"):  # the sampler stops first ...
        _train(loader, accountant=SchemeAccountant(BIB), poisson_sampling=False, steps=11)
    acc = SchemeAccountant(BIB, discretization=D)  # ... and the accountant on its own too
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=10)
    with pytest.raises(ValueError, match="beyond the run"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)
    assert len(acc) == 10  # the refused step was not recorded
    # exactly the planned run is fine (10 bins, 1 epoch)
    engine = _train(DataLoader(_dataset(), batch_sampler=BIB.sampler(N, seed=1)),
                    accountant=SchemeAccountant(BIB, discretization=D), poisson_sampling=False,
                    steps=10)
    assert len(engine.accountant) == 10 and engine.get_epsilon(1e-5) > 0


def test_correlated_noise_engine_checks_the_loader_too():
    from opacus_structured.optim.privacy_engine import CorrelatedNoisePrivacyEngine
    from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme

    scheme = BandMFCyclicPoissonScheme(dataset_size=N, batch_size=12.0, bands=2)
    loader = DataLoader(_dataset(), batch_size=12, shuffle=True)
    with pytest.raises(ValueError, match="bandmf-cyclic-poisson"):
        _train(loader, engine=CorrelatedNoisePrivacyEngine(scheme=scheme),
               poisson_sampling=False)


# ---- no ε from an accountant that saw nothing -----------------------------------------------
def test_unattached_empty_accountant_raises_but_offline_use_works():
    acc = SchemeAccountant(BIB, discretization=D)
    with pytest.raises(AccountantNotAttachedError):
        acc.get_epsilon(1e-5)
    with pytest.raises(AccountantNotAttachedError):
        acc.get_delta(1.0)
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=10)  # offline pricing by hand
    assert acc.get_epsilon(1e-5) == pytest.approx(BIB.epsilon(1.0, 10, 1e-5, discretization=D))
    attached = SchemeAccountant(BIB, discretization=D)
    attached.attach()
    assert attached.get_epsilon(1e-5) == 0.0  # attached, no step yet: honest zero


@pytest.mark.slow
def test_opacus_calibration_builds_accountants_by_name_and_sets_history():
    from opacus.accountants.utils import get_noise_multiplier

    sigma = get_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01,
                                 steps=100, accountant="poisson", epsilon_tolerance=0.01)
    check = SchemeAccountant(PoissonScheme(0.01), discretization=1e-4)
    check.step(noise_multiplier=sigma, sample_rate=0.01, num_steps=100)
    assert 1.98 <= check.get_epsilon(1e-5) <= 2.0


def test_opacus_make_private_exposes_its_loader_to_the_hook_factory():
    """Pins the Opacus behaviour the stock-engine check relies on: the hook factory is called
    from ``make_private`` whose local ``data_loader`` is the loader it returns."""
    seen = {}

    class Spy(SchemeAccountant):
        def get_optimizer_hook_fn(self, sample_rate, *, data_loader=None):
            seen["loader"] = data_loader_of_make_private()
            return super().get_optimizer_hook_fn(sample_rate, data_loader=seen["loader"])

    loader = DataLoader(_dataset(), batch_sampler=BIB.sampler(N, seed=1))
    model, opt = nn.Linear(3, 2), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine()
    engine.accountant = Spy(BIB)
    _, _, returned = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                         noise_multiplier=1.0, max_grad_norm=1.0,
                                         poisson_sampling=False)
    assert seen["loader"] is returned


# ---- registry: every name we register is constructible ----------------------------------------
def test_every_registered_name_is_constructible_by_opacus():
    from opacus.accountants.registry import _ACCOUNTANTS, create_accountant

    from opacus_structured.accountants import ACCOUNTANTS, REGISTERED
    from opacus_structured.accountants.base import UnboundAccountantError

    ours = {n for n, c in _ACCOUNTANTS.items() if c.__module__.startswith("opacus_structured")}
    for name in ours:
        create_accountant(name)  # raises if not constructible without arguments
    assert set(REGISTERED) <= ours
    for name in set(ACCOUNTANTS) - set(REGISTERED):
        assert name not in _ACCOUNTANTS  # scheme-less names would only raise inside Opacus
    # every scheme accountant whose constructor takes no scheme is registered by bare name;
    # unbound ones never price (they name opacus_structured.make_private instead)
    for name in ("poisson", "truncated-poisson", "balls-in-bins", "bandmf-cyclic-poisson",
                 "random-allocation-mf", "gdp-full-batch", "structured"):
        assert name in REGISTERED and _ACCOUNTANTS[name] is REGISTERED[name]
        acc = create_accountant(name)
        if acc.scheme is None:
            acc.history = [(1.0, 0.1, 10)]  # what Opacus' get_noise_multiplier does
            with pytest.raises(UnboundAccountantError, match="opacus_structured.make_private"):
                acc.get_epsilon(1e-5)
    assert _ACCOUNTANTS["gdp"].__module__.startswith("opacus")  # Opacus' own "gdp" untouched
    assert not _ACCOUNTANTS["gdp"].__module__.startswith("opacus_structured")


# ---- README: the Opacus snippet runs exactly as printed ---------------------------------------
@pytest.mark.slow
def test_readme_opacus_snippets_run_as_printed():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    snippets = [b for b in blocks if "make_private_with_epsilon" in b]
    assert len(snippets) == 2  # the stock-Opacus swap and the scheme helper
    for snippet in snippets:
        namespace: dict = {}
        exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102
        eps = namespace["engine"].get_epsilon(delta=1e-5)
        assert 0 < eps <= 2.0 + 1e-9


# ---- property: random (scheme, loader) pairs ----------------------------------------------------
def _loader(kind: str, scheme_kind: str, seed: int):
    ds = _dataset()
    if kind == "own":
        sampler = (PoissonBatchSampler(N, 0.1, seed=seed) if scheme_kind == "poisson"
                   else BIB.sampler(N, seed=seed))
        return DataLoader(ds, batch_sampler=sampler, collate_fn=_collate), False
    if kind == "other-scheme":
        sampler = (BIB.sampler(N, seed=seed) if scheme_kind == "poisson"
                   else PoissonBatchSampler(N, 0.1, seed=seed))
        return DataLoader(ds, batch_sampler=sampler, collate_fn=_collate), False
    if kind == "other-size":
        sampler = (PoissonBatchSampler(N - 10, 0.1, seed=seed) if scheme_kind == "poisson"
                   else BIB.sampler(N - 10, seed=seed))
        return DataLoader(ds, batch_sampler=sampler, collate_fn=_collate), False
    if kind == "shuffled":
        return DataLoader(ds, batch_size=12, shuffle=True), False
    if kind == "sequential":
        return DataLoader(ds, batch_size=12), False
    assert kind == "opacus-poisson"  # Opacus replaces it with DPDataLoader at rate 12/120
    return DataLoader(ds, batch_size=12), True


def _collate(items):
    if not items:
        return torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)
    return tuple(torch.stack(t) for t in zip(*items, strict=True))


@settings(max_examples=24, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scheme_kind=st.sampled_from(["poisson", "balls-in-bins"]),
       loader_kind=st.sampled_from(["own", "other-scheme", "other-size", "shuffled",
                                    "sequential", "opacus-poisson"]),
       seed=st.integers(0, 2**16))
def test_every_mismatch_raises_and_every_match_trains(scheme_kind, loader_kind, seed):
    scheme = PoissonScheme(0.1) if scheme_kind == "poisson" else BIB
    loader, poisson_sampling = _loader(loader_kind, scheme_kind, seed)
    # Ground truth by construction: only the scheme's own sampler, or (for Poisson at rate
    # 0.1) Opacus' DPDataLoader at 1/len(loader) = 0.1, implement the scheme.
    matches = loader_kind == "own" or (loader_kind == "opacus-poisson" and
                                       scheme_kind == "poisson")
    accountant = SchemeAccountant(scheme, discretization=D)
    if not matches:
        with pytest.raises((ValueError, RuntimeError)):
            _train(loader, accountant=accountant, poisson_sampling=poisson_sampling)
        return
    engine = _train(loader, accountant=accountant, poisson_sampling=poisson_sampling)
    by_hand = SchemeAccountant(scheme, discretization=D)
    by_hand.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=3)
    assert len(engine.accountant) == 3
    assert engine.get_epsilon(1e-5) == pytest.approx(by_hand.get_epsilon(1e-5), rel=1e-12)


def test_scheme_of_opacus_dp_data_loader_is_poisson_at_its_rate():
    from opacus.data_loader import DPDataLoader

    dl = DPDataLoader.from_data_loader(DataLoader(_dataset(), batch_size=12))
    assert scheme_of_batch_sampler(dl.batch_sampler) == PoissonScheme(sample_rate=0.1)
    counted = check_data_loader(PoissonScheme(), dl)  # Opacus' sampler, now counting draws
    assert counted is dl.batch_sampler and isinstance(counted, UniformWithReplacementSampler)
    assert scheme_of_batch_sampler(counted) == PoissonScheme(sample_rate=0.1)
    with pytest.raises(ValueError, match="poisson_sampling=False"):
        check_data_loader(BIB, dl)


@pytest.mark.slow
def test_scheme_bound_name_trains_through_make_private_with_epsilon():
    scheme = BallsInBinsScheme(num_bins=10, epochs=1)
    register_scheme_accountant("wiring-test-bib", scheme, force=True)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = PrivacyEngine(accountant="wiring-test-bib")
    model, opt, dl = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_dataset(), batch_sampler=scheme.sampler(N, seed=3)),
        target_epsilon=2.0, target_delta=1e-5, epochs=1, max_grad_norm=1.0,
        poisson_sampling=False)
    for x, y in dl:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert len(engine.accountant) == 10
    assert 1.9 <= engine.get_epsilon(1e-5) <= 2.0
