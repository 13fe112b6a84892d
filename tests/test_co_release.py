"""Several private modules on one draw stream (issue 46, item 2; repro 05): an encoder and a
head made private apart (one engine with two ``make_private`` calls, or two engines) release two
noisy sums of each draw. The joint release of a draw is one Gaussian mechanism at
``σ_eff = (Σ σ_i⁻²)^{-1/2}`` on a Poisson(q) subsample; each engine must report at least its
price, checked against dp_accounting's PLD of that mechanism (optimistic: a lower bound)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from _training import step_modules, xy_dataset
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader

import opacus_structured
from opacus_structured.accountants import co_release
from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accountants.ledger import LedgerError
from opacus_structured.schemes.poisson import PoissonScheme

warnings.filterwarnings("ignore", message="Secure RNG turned off")

N, B, DELTA, D = 60, 10, 1e-5, 1e-3
Q = B / N


def _poisson(sigma, steps, pessimistic):
    pld = dp_pld.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=Q,
                                         pessimistic_estimate=pessimistic,
                                         value_discretization_interval=D).self_compose(steps)
    return float(pld.get_epsilon_for_delta(DELTA))


def _data():
    return xy_dataset(N, 4)


def _private(engine, module, sigma, loader, **kw):
    return opacus_structured.make_private(
        engine, module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.05),
        data_loader=loader, noise_multiplier=sigma, max_grad_norm=1.0, dataset_size=N,
        discretization=D, **kw)


def _train(loader, modules, optimizers, epochs=2, order=None):
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            step_modules(x, y, modules, optimizers, order)
            steps += 1
    return steps


@pytest.mark.parametrize("engines", [1, 2])
def test_encoder_and_head_are_priced_at_their_joint_noise(engines):
    torch.manual_seed(0)
    enc, head = nn.Linear(4, 8), nn.Linear(8, 2)
    e1 = PrivacyEngine(accountant="poisson")
    enc, opt_e, loader = _private(e1, enc, 1.0, DataLoader(_data(), batch_size=B),
                                  sampler_generator=torch.Generator().manual_seed(1))
    e2 = e1 if engines == 1 else PrivacyEngine(accountant="poisson")
    if engines == 1:  # the second module on the loader the first call returned
        head, opt_h, same = _private(e2, head, 2.0, loader)
        assert same is loader
    else:  # the head's engine gets a loader of its own, which the loop never iterates
        head, opt_h, _ = _private(e2, head, 2.0, DataLoader(_data(), batch_size=B),
                                  sampler_generator=torch.Generator().manual_seed(2))
    steps = _train(loader, [enc, head], [opt_e, opt_h])
    sigma_eff = 1.0 / math.sqrt(1.0 + 1.0 / 4.0)
    lower = _poisson(sigma_eff, steps, pessimistic=False)
    for engine in {id(e1): e1, id(e2): e2}.values():
        eps = float(engine.get_epsilon(DELTA))
        assert lower <= eps
        assert eps == pytest.approx(_poisson(sigma_eff, steps, pessimistic=True), rel=2e-3)
        assert len(engine.accountant) == steps  # each draw priced once


def test_the_head_stepping_first_is_priced_the_same():
    torch.manual_seed(0)
    enc, head = nn.Linear(4, 8), nn.Linear(8, 2)
    engine = PrivacyEngine(accountant="poisson")
    enc, opt_e, loader = _private(engine, enc, 1.0, DataLoader(_data(), batch_size=B),
                                  sampler_generator=torch.Generator().manual_seed(1))
    head, opt_h, _ = _private(engine, head, 1.0, loader)
    steps = _train(loader, [enc, head], [opt_e, opt_h], order=[opt_h, opt_e])
    assert float(engine.get_epsilon(DELTA)) >= _poisson(1 / math.sqrt(2), steps, False)


def test_one_optimizer_twice_on_one_batch_is_still_refused():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = PrivacyEngine(accountant="poisson")
    model, opt, loader = _private(engine, model, 1.0, DataLoader(_data(), batch_size=B),
                                  sampler_generator=torch.Generator().manual_seed(1))
    x, y = next(iter(loader))
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if _ == 0:
            opt.step()
    with pytest.raises(LedgerError):
        opt.step()


def test_reprice_step_splits_and_merges_the_history():
    acc = SchemeAccountant(PoissonScheme(sample_rate=Q), discretization=D)
    acc.step(noise_multiplier=1.0, sample_rate=Q, num_steps=3)
    acc.reprice_step(1, 0.5)
    assert acc.history == [(1.0, Q, 1), (0.5, Q, 1), (1.0, Q, 1)]
    acc.reprice_step(0, 0.5)
    acc.reprice_step(2, 0.5)
    assert acc.history == [(0.5, Q, 3)]
    with pytest.raises(IndexError):
        acc.reprice_step(3, 0.5)
    assert co_release.effective_sigma([1.0, 1.0]) == pytest.approx(1 / math.sqrt(2))
    assert co_release.effective_sigma([1.0, 0.0]) == 0.0


def test_a_co_release_re_prices_the_dataset_budget_charge_at_once(tmp_path):
    """The head's co-release re-prices the encoder's released steps at the joint noise: the
    encoder run's charge in the dataset budget covers its accountant's price after every step
    (before: only from its next reservation or settle, an under-charge in between)."""
    import numpy as np

    from opacus_structured import DatasetBudget
    from opacus_structured.accountants.budget_curves import accountant_rdp
    from opacus_structured.accountants.budget_guard import guards_of

    torch.manual_seed(0)
    enc, head = nn.Linear(4, 8), nn.Linear(8, 2)
    budget = DatasetBudget(tmp_path / "b.budget", epsilon=50.0, delta=DELTA)
    e1, e2 = PrivacyEngine(accountant="poisson"), PrivacyEngine(accountant="poisson")
    enc, opt_e, loader = _private(e1, enc, 1.0, DataLoader(_data(), batch_size=B),
                                  sampler_generator=torch.Generator().manual_seed(1),
                                  budget=budget)
    head, opt_h, _ = _private(e2, head, 2.0, DataLoader(_data(), batch_size=B),
                              sampler_generator=torch.Generator().manual_seed(2))
    run = guards_of(opt_e)[budget.path].run_id
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in loader:
            step_modules(x, y, [enc, head], [opt_e, opt_h])
            priced = accountant_rdp(e1.accountant, budget.orders)[0]
            assert np.all(budget.run_rdp(run)[0] >= priced * (1 - 1e-9))
    sigma_eff = 1.0 / math.sqrt(1.0 + 1.0 / 4.0)
    assert {round(float(s), 12) for s, _, _ in e1.accountant.history} == {round(sigma_eff, 12)}


@pytest.mark.parametrize("engines", [1, 2])
def test_budget_of_the_second_module_on_a_shared_loader_is_charged(tmp_path, engines):
    """make_private(budget=...) on the private loader an earlier make_private returned (the
    head next to the encoder) charges the head's releases; the argument was dropped before
    (nothing charged, spent() 0)."""
    from opacus_structured import DatasetBudget
    from opacus_structured.accountants.budget_curves import accountant_rdp
    from opacus_structured.accountants.budget_guard import guards_of

    torch.manual_seed(0)
    enc, head = nn.Linear(4, 8), nn.Linear(8, 2)
    budget = DatasetBudget(tmp_path / "b.budget", epsilon=50.0, delta=DELTA)
    e1 = PrivacyEngine(accountant="poisson")
    e2 = e1 if engines == 1 else PrivacyEngine(accountant="poisson")
    enc, opt_e, loader = _private(e1, enc, 1.0, DataLoader(_data(), batch_size=B),
                                  sampler_generator=torch.Generator().manual_seed(1))
    head, opt_h, _ = _private(e2, head, 2.0, loader, budget=budget)
    assert budget.path in guards_of(opt_h)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = _train(loader, [enc, head], [opt_e, opt_h], epochs=1)
    budget.settle()
    assert steps > 0 and len(e2.accountant) == steps
    np.testing.assert_allclose(budget.total_rdp(), accountant_rdp(e2.accountant,
                                                                  budget.orders)[0], rtol=1e-9)
