"""``SchemeAccountant(scheme)`` must price a scheme the way its own accountant does.

Regression: the generic adapter used to chunk the history of every multi-step scheme by
``steps_per_epoch``; for BandMF + cyclic Poisson (one PLD per cycle of ``b`` steps, fewer steps
than an epoch) that composed too few units and under-reported ε (3.46 instead of 5.74 for
60 steps, b = 8, |D| = 1500, B = 50, σ = 1). The oracle here is the direct composition of the
scheme's per-unit PLD over the number of units the theorem prescribes.
"""

from __future__ import annotations

import math

import pytest

from opacus_structured.accountants.bandmf import (BallsInBinsAccountant,
                                                  BandMFCyclicPoissonAccountant)
from opacus_structured.accountants.base import SchemeAccountant, accountant_class_for
from opacus_structured.accounting import pld as pld_lib
from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme
from opacus_structured.schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from opacus_structured.schemes.gdp import GDPScheme
from opacus_structured.schemes.poisson import PoissonScheme
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

DISC = 1e-3


def _run(accountant, steps, sigma=1.0):
    accountant.step(noise_multiplier=sigma, sample_rate=accountant.scheme.expected_sample_rate()
                    or 0.1, num_steps=steps)
    return accountant.get_epsilon(1e-5)


def _direct(scheme, units, sigma=1.0):
    pld = scheme.pld(sigma, discretization=DISC)
    return pld_lib.epsilon_for_delta(pld_lib.self_compose(pld, units), 1e-5)


def test_bandmf_cycles_not_epochs():
    scheme = BandMFCyclicPoissonScheme(dataset_size=1500, batch_size=50, bands=8)
    assert scheme.steps_per_epoch() == 30 and scheme.steps_per_unit() == 8
    acc = SchemeAccountant(scheme, discretization=DISC)
    assert type(acc) is BandMFCyclicPoissonAccountant
    eps = _run(acc, 60)
    assert eps == pytest.approx(_direct(scheme, math.ceil(60 / 8)), rel=1e-12)
    assert eps > 5.0  # the old generic chunking reported 3.46


def test_balls_in_bins_run_is_one_unit():
    scheme = BallsInBinsScheme(num_bins=20, epochs=3)
    acc = SchemeAccountant(scheme, discretization=DISC)
    assert type(acc) is BallsInBinsAccountant
    # one unit for the whole run; the scheme reports min(PLD, Rényi) — both upper bounds
    renyi = scheme.renyi_scheme().epsilon(1.0, 60, 1e-5, discretization=DISC)
    assert _run(acc, 60) == pytest.approx(min(_direct(scheme, 1), renyi), rel=1e-12)
    with pytest.raises(ValueError, match="steps must be <="):
        _run(SchemeAccountant(scheme, discretization=DISC), 61)


@pytest.mark.parametrize("scheme", [
    PoissonScheme(sample_rate=0.1),
    TruncatedPoissonScheme(dataset_size=100, sample_rate=0.1, max_batch_size=15),
    GDPScheme(),
])
def test_every_scheme_gets_its_accountant(scheme):
    acc = SchemeAccountant(scheme, discretization=DISC)
    assert isinstance(acc, accountant_class_for(scheme))
    assert acc.scheme is scheme
    steps = 7
    eps = _run(acc, steps)
    assert eps == pytest.approx(scheme.epsilon(1.0, steps, 1e-5, discretization=DISC,
                                               sample_rate=scheme.expected_sample_rate()
                                               or 0.1), rel=1e-9)


def test_get_privacy_spent_has_opacus_call_shape():
    """Issue 31 item 7: Opacus' RDPAccountant.get_privacy_spent(delta=, alphas=None) returns
    two values (ε, best Rényi order). Ours takes the same call and returns two values, ε and
    the bound kind (a PLD accountant has no Rényi order; docs: accountants.base)."""
    import inspect

    from opacus.accountants import RDPAccountant

    from opacus_structured.accountants.base import AccountantNotAttachedError

    ours = inspect.signature(SchemeAccountant.get_privacy_spent).parameters
    theirs = inspect.signature(RDPAccountant.get_privacy_spent).parameters
    assert list(ours) == list(theirs) == ["self", "delta", "alphas"]
    assert all(p.kind == p.KEYWORD_ONLY for n, p in ours.items() if n != "self")
    assert ours["alphas"].default is None is theirs["alphas"].default

    rdp = RDPAccountant()
    acc = SchemeAccountant(PoissonScheme(sample_rate=0.01), discretization=DISC)
    for a in (rdp, acc):
        a.step(noise_multiplier=1.0, sample_rate=0.01)
    eps_rdp, alpha = rdp.get_privacy_spent(delta=1e-5)
    eps, kind = acc.get_privacy_spent(delta=1e-5)
    assert isinstance(eps, float) and eps == acc.get_epsilon(1e-5)
    assert kind == acc.bound == "upper"
    assert 0 < eps <= eps_rdp  # the PLD bound is tighter than RDP's, both are upper bounds
    with pytest.raises(ValueError, match="alphas"):
        acc.get_privacy_spent(delta=1e-5, alphas=[2, 4, 8])
    with pytest.raises(AccountantNotAttachedError):  # Opacus would answer (0, 0)
        SchemeAccountant(PoissonScheme(sample_rate=0.01)).get_privacy_spent(delta=1e-5)
