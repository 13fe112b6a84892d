"""One test suite run over every registered scheme (dp_accounting's PrivacyAccountantTest idea).

A new scheme gets these checks by adding one small instance to ``EXAMPLES`` — and the first
test fails until it does: state-dict round trip of its accountant, ε monotone in steps, never
below an independent lower bound where one exists, sampler ↔ accountant agreement through the
registry, and clear errors for bad input. Discretisation 1e-3 (pessimistic) keeps it fast.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from dp_accounting.pld import privacy_loss_distribution as dp_pld

import opacus_structured  # noqa: F401  (imports every layer: all registrations done)
from opacus_structured.accountants.base import SchemeAccountant, accountant_class_for
from opacus_structured.accounting.bounds import BoundKind
from opacus_structured.accounting.gaussian import gdp_epsilon
from opacus_structured.samplers.verification import scheme_of_batch_sampler
from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme
from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from opacus_structured.schemes.bminsep_mc import BMinSepMonteCarloScheme
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.poisson import PoissonScheme
from opacus_structured.schemes.random_allocation_mf import RandomAllocationMFScheme
from opacus_structured.schemes.registry import SCHEMES, sampler_factory_for
from opacus_structured.schemes.shuffle import ShuffleScheme
from opacus_structured.schemes.structured import StructuredScheme
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

D = 1e-3
DELTA = 1e-5
SIGMA = 1.0


def _poisson_optimistic(scheme, sigma, steps, delta):
    """dp_accounting's *optimistic* PLD of the same mechanism: a lower bound on the true ε."""
    pld = dp_pld.from_gaussian_mechanism(standard_deviation=sigma,
                                         sampling_prob=scheme.sample_rate,
                                         pessimistic_estimate=False,
                                         value_discretization_interval=D)
    return pld.self_compose(steps).get_epsilon_for_delta(delta)


def _gdp_exact(scheme, sigma, steps, delta):
    """Closed-form μ-GDP ε with μ = √T/σ (exact for full-batch DP-GD)."""
    return gdp_epsilon(delta, math.sqrt(steps) / sigma)


def _structured_lower(scheme, sigma, steps, delta):
    """The scheme's own optimistic lower-bound theorem for the same configuration."""
    return dataclasses.replace(scheme, bound="lower").epsilon(sigma, steps, delta,
                                                              discretization=D)


def _shuffle_lower(scheme, sigma, steps, delta):
    """Chua et al.'s lower bound for the same shuffled run (the scheme's ``bound="lower"``)."""
    return dataclasses.replace(scheme, bound="lower").epsilon(sigma, steps, delta,
                                                              discretization=D)


@dataclasses.dataclass(frozen=True)
class Example:
    scheme: object
    steps: tuple            # increasing step counts within the planned run
    sampler_data: object    # first argument of scheme.sampler(...), None if the scheme fixes it
    lower: object = None    # independent lower bound ε(σ, steps, δ), None if none is known
    delta: float = DELTA    # a δ the example resolves (Monte Carlo: one its samples reach)


EXAMPLES = {
    "poisson": Example(PoissonScheme(0.05), (1, 5, 20), 100, _poisson_optimistic),
    "balls-in-bins": Example(BallsInBinsScheme(num_bins=10, epochs=2), (5, 10, 20), 100),
    "bandmf-cyclic-poisson": Example(
        BandMFCyclicPoissonScheme(dataset_size=100, batch_size=10.0, bands=2), (2, 10, 20),
        None),
    "gdp": Example(GDPScheme(), (1, 5, 20), 100, _gdp_exact),
    "random-allocation-mf": Example(
        RandomAllocationMFScheme(strategy="identity", epochs=2, batches_per_epoch=10,
                                 method="renyi"), (5, 10, 20), 100),
    "structured": Example(
        StructuredScheme(num_series=100, series_length=20, context_length=1,
                         forecast_length=1, batch_size=10), (1, 5, 20), None,
        _structured_lower),
    "truncated-poisson": Example(TruncatedPoissonScheme(100, 0.1, 15), (1, 5, 20), None),
    "shuffle": Example(ShuffleScheme(dataset_size=100, batch_size=10), (1, 15, 20), 100,
                       _shuffle_lower),
    "bminsep-mc": Example(
        BMinSepMonteCarloScheme(bands=2, dataset_size=100, batch_size=10.0, min_sep=2),
        (2, 10), 100, delta=1e-2),
}

NAMES = sorted(SCHEMES)


def test_every_registered_scheme_has_an_example():
    assert sorted(EXAMPLES) == NAMES, "add a small instance of the new scheme to EXAMPLES"


def _eps(example: Example, steps: int) -> float:
    acc = SchemeAccountant(example.scheme, discretization=D)
    rate = example.scheme.expected_sample_rate() or 0.05
    acc.step(noise_multiplier=SIGMA, sample_rate=rate, num_steps=steps)
    return float(acc.get_epsilon(example.delta))


@pytest.mark.parametrize("name", NAMES)
def test_accountant_is_the_registered_one_and_round_trips(name):
    ex = EXAMPLES[name]
    acc = SchemeAccountant(ex.scheme, discretization=D)
    assert type(acc) is accountant_class_for(ex.scheme) and acc.scheme is ex.scheme
    rate = ex.scheme.expected_sample_rate() or 0.05
    acc.step(noise_multiplier=SIGMA, sample_rate=rate, num_steps=ex.steps[1])
    eps = float(acc.get_epsilon(ex.delta))
    clone = SchemeAccountant(ex.scheme, discretization=D)
    clone.load_state_dict(acc.state_dict())
    assert len(clone) == ex.steps[1] and float(clone.get_epsilon(ex.delta)) == eps
    # a resumed run goes on exactly: one more step on both gives the same ε
    for a in (acc, clone):
        a.step(noise_multiplier=SIGMA, sample_rate=rate, num_steps=ex.steps[2] - ex.steps[1]
               if len(ex.steps) > 2 else 0)
    assert float(clone.get_epsilon(ex.delta)) == float(acc.get_epsilon(ex.delta))


@pytest.mark.parametrize("name", NAMES)
def test_epsilon_is_monotone_in_steps(name):
    ex = EXAMPLES[name]
    eps = [_eps(ex, k) for k in ex.steps]
    assert all(e >= 0 and math.isfinite(e) for e in eps)
    assert eps == sorted(eps), f"{name}: ε not monotone in steps {ex.steps}: {eps}"


@pytest.mark.parametrize("name", [n for n in NAMES if EXAMPLES[n].lower is not None])
def test_never_below_an_independent_lower_bound(name):
    ex = EXAMPLES[name]
    assert ex.scheme.bound.is_guarantee
    for k in ex.steps:
        assert _eps(ex, k) >= ex.lower(ex.scheme, SIGMA, k, ex.delta) - 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_bound_kind_is_a_bound_kind(name):
    bound = EXAMPLES[name].scheme.bound
    assert isinstance(bound, BoundKind)
    assert bound.is_guarantee == (bound in (BoundKind.TIGHT, BoundKind.UPPER))


@pytest.mark.parametrize("name", NAMES)
def test_sampler_and_accountant_agree(name):
    ex = EXAMPLES[name]
    if sampler_factory_for(ex.scheme) is None:
        with pytest.raises(NotImplementedError, match="has no sampler"):
            ex.scheme.sampler(ex.sampler_data)
        return
    sampler = ex.scheme.sampler(ex.sampler_data, seed=0)
    assert scheme_of_batch_sampler(sampler) is ex.scheme  # the real scheme object
    assert ex.scheme.implemented_by(sampler.scheme)
    expected = ex.scheme.expected_sample_rate()
    if expected is not None:  # the rate Opacus' hook reports: 1/len(loader)
        assert 1.0 / len(sampler) == pytest.approx(expected, rel=1e-12)
    batches = list(zip(range(3), iter(sampler), strict=False))
    assert len(batches) == min(3, len(sampler)) and sampler.batches_drawn == len(batches)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad, argument", [
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(noise_multiplier=float("nan")), "noise_multiplier"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.5), "delta"),
    (dict(steps=-1), "steps"),
])
def test_bad_input_names_the_argument(name, bad, argument):
    ex = EXAMPLES[name]
    args = dict(noise_multiplier=SIGMA, steps=ex.steps[0], delta=ex.delta)
    args.update(bad)
    with pytest.raises(ValueError, match=argument):
        ex.scheme.epsilon(args["noise_multiplier"], args["steps"], args["delta"],
                          discretization=D)
