"""Issue 40: private selection (Papernot & Steinke 2022; Liu & Talwar 2019).

Independent checks of the selection's ε: dp_accounting's ``RepeatAndSelectDpEvent`` on
Poisson-subsampled Gaussian trials, the pure-DP closed forms, the Rényi divergence of a PLD
against numerical integration of the true pair, and ε of a structured / truncated-Poisson
selection against the single run. Then the search API on a tiny Opacus loop: fields, the
whole procedure's ε, checkpoint resume, and errors.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from dp_accounting import dp_event as E
from dp_accounting.rdp import rdp_privacy_accountant as R
from opacus import PrivacyEngine
from scipy import stats
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_structured.accountants import PoissonAccountant
from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accounting import private_selection as ps
from opacus_structured.schemes import PoissonScheme
from opacus_structured.schemes.structured import StructuredScheme
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme
from opacus_structured.tuning import (
    PrivateSelection,
    PureDpTrial,
    TrialCost,
    calibrate_selection,
    draw_num_trials,
    liu_talwar_epsilon,
    private_score,
    pure_selection_epsilon,
    selection_epsilon,
)

ORDERS = ps.DEFAULT_ORDERS
DELTA = 1e-5
FEW = ORDERS[::6]  # a coarser order grid where a test prices many times


def _dpsgd_event(q=0.01, sigma=1.0, steps=300):
    return E.SelfComposedDpEvent(E.PoissonSampledDpEvent(q, E.GaussianDpEvent(sigma)), steps)


def _dp_accounting_selection(event, mean, shape):
    acc = R.RdpAccountant(list(ORDERS))
    acc.compose(E.RepeatAndSelectDpEvent(event, mean, shape))
    return acc.get_epsilon(DELTA)


# ---- the math against dp_accounting ------------------------------------------------------
@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, None])
def test_our_formula_matches_dp_accounting_repeat_and_select(eta):
    """Our repeat_and_select_rdp (own γ solver, own formula) on the base RDP curve gives
    dp_accounting's RepeatAndSelectDpEvent ε to 1e-6; selection_epsilon too."""
    event = _dpsgd_event()
    base = R.RdpAccountant(list(ORDERS)).compose(event)._rdp
    ours = ps.rdp_epsilon(ORDERS, ps.repeat_and_select_rdp(ORDERS, base, mean_trials=10,
                                                           eta=eta), DELTA)
    shape = math.inf if eta is None else eta
    expect = _dp_accounting_selection(event, 10, shape)
    assert ours == pytest.approx(expect, rel=1e-6)
    assert selection_epsilon(event, mean_trials=10, eta=eta, delta=DELTA) == pytest.approx(
        expect, rel=1e-6)


def test_gamma_solver_matches_dp_accounting():
    for eta in (0.0, 0.5, 1.0, 3.0):
        for mean in (1.5, 10.0, 100.0):
            g = ps.tnb_gamma(mean, eta)
            assert g == pytest.approx(R._gamma_truncated_negative_binomial(eta, mean), rel=1e-8)
            assert ps.tnb_mean(g, eta) == pytest.approx(mean, rel=1e-8)


def test_negative_eta_between_logarithmic_and_poisson_free():
    """η in (-1, 0): the theorem holds there (dp_accounting refuses); smaller η, smaller ε."""
    event = _dpsgd_event()
    values = [selection_epsilon(event, mean_trials=10, eta=eta, delta=DELTA)
              for eta in (-0.5, 0.0, 1.0)]
    assert values[0] < values[1] < values[2]


def test_selection_costs_more_than_one_run_and_less_than_mean_composition():
    event = _dpsgd_event()
    single = R.RdpAccountant(list(ORDERS)).compose(event).get_epsilon(DELTA)
    composed = R.RdpAccountant(list(ORDERS)).compose(event, 10).get_epsilon(DELTA)
    for eta in (0.0, 1.0, None):
        eps = selection_epsilon(event, mean_trials=10, eta=eta, delta=DELTA)
        assert single < eps < composed


# ---- pure DP closed forms -----------------------------------------------------------------
def test_pure_dp_closed_forms():
    """Papernot-Steinke (2+η)ε when ε <= log(1/γ), Liu-Talwar 3ε (geometric)."""
    for eta in (0.0, 0.5, 1.0, 2.0):
        assert pure_selection_epsilon(0.5, mean_trials=10, eta=eta) == pytest.approx(
            (2 + eta) * 0.5, rel=1e-12)
    assert pure_selection_epsilon(0.5, mean_trials=10, eta=1) == pytest.approx(
        liu_talwar_epsilon(0.5, 0.1), rel=1e-12) == pytest.approx(1.5)
    # ε > log(1/γ): the bound ε + (1+η) log(1/γ) is the smaller; mean 2, geometric: γ = 1/2
    assert pure_selection_epsilon(3.0, mean_trials=2, eta=1) == pytest.approx(
        3.0 + 2 * math.log(2), rel=1e-12)
    assert selection_epsilon(PureDpTrial(0.5), mean_trials=10, eta=1, delta=DELTA) == 1.5


def test_pure_dp_is_the_rdp_formula_at_infinite_order():
    """The closed form is the RDP bound with ρ ≡ ε as λ, λ̂ → ∞ (independent route)."""
    orders = np.geomspace(1.01, 1e9, 4000)
    rdp = ps.repeat_and_select_rdp(orders, np.full_like(orders, 0.5), mean_trials=10, eta=1)
    assert rdp[-1] == pytest.approx(1.5, rel=1e-6)


# ---- Rényi divergence of a PLD ---------------------------------------------------------------
def _exact_subsampled_gaussian_renyi(q, sigma, lam):
    x = np.linspace(-30, 30, 600001)
    loss = np.log1p(q * np.expm1((2 * x - 1) / (2 * sigma ** 2)))  # log P/Q, Q = N(0, σ²)
    logq = stats.norm.logpdf(x, scale=sigma)
    return math.log(np.trapezoid(np.exp(logq + lam * loss), x)) / (lam - 1)


def test_pld_renyi_upper_bounds_the_exact_pair():
    """The pessimistic PLD's finite-part divergence is >= the true Rényi divergence of the
    Poisson-subsampled Gaussian (numerical integration) and within 1 % of it."""
    pld = PoissonScheme(sample_rate=0.01).pld(1.0, discretization=1e-3)
    orders = np.array([1.5, 2.0, 4.0])
    (rdp, tail), _ = ps.pld_renyi(pld, orders)
    assert 0 < tail < 1e-17
    for lam, value in zip(orders, rdp, strict=True):
        exact = _exact_subsampled_gaussian_renyi(0.01, 1.0, lam)
        assert exact <= value <= 1.01 * exact


def test_tail_mass_too_large_raises():
    with pytest.raises(ValueError, match="tail mass"):
        ps.epsilon_with_tail(ORDERS, np.full_like(ORDERS, 1.0), 1e-10, tail_mass=1e-9,
                             mean_trials=10)


# ---- our accountants ---------------------------------------------------------------------
def test_poisson_accountant_agrees_with_the_event_path():
    acc = PoissonAccountant(PoissonScheme(0.01), discretization=1e-3)
    acc.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=300)
    event = E.ComposedDpEvent([_dpsgd_event(), E.GaussianDpEvent(4.0)])
    for eta in (1.0, None):
        assert selection_epsilon(TrialCost(acc, (4.0,)), mean_trials=10, eta=eta,
                                 delta=DELTA) == pytest.approx(
            selection_epsilon(event, mean_trials=10, eta=eta, delta=DELTA), rel=1e-12)


def _truncated_poisson_accountant():
    scheme = TruncatedPoissonScheme(dataset_size=1000, sample_rate=0.01, max_batch_size=20)
    acc = SchemeAccountant(scheme, discretization=1e-3)
    acc.step(noise_multiplier=1.0, sample_rate=scheme.expected_sample_rate(), num_steps=100)
    return acc


def test_truncated_poisson_selection_bounds():
    """ε(selection) >= ε(one run) (the accountant's PLD) >= the Poisson run's ε at the same
    σ, q, steps (a different route, dp_accounting RDP, lower since truncation only adds)."""
    acc = _truncated_poisson_accountant()
    single = float(acc.get_epsilon(DELTA))
    eps = selection_epsilon(acc, mean_trials=10, eta=1, delta=DELTA)
    poisson_selection = selection_epsilon(_dpsgd_event(steps=100), mean_trials=10, eta=1,
                                          delta=DELTA)
    assert eps >= single
    assert eps >= poisson_selection * 0.999
    assert eps == pytest.approx(6.66, abs=0.05)  # pinned (d = 1e-3)


@pytest.mark.slow
def test_structured_selection_bounds():
    scheme = StructuredScheme(num_series=100, series_length=50, context_length=10,
                              forecast_length=5, batch_size=5)
    acc = SchemeAccountant(scheme, discretization=1e-3)
    acc.step(noise_multiplier=2.0, sample_rate=scheme.expected_sample_rate(), num_steps=100)
    single = float(acc.get_epsilon(DELTA))
    eps = selection_epsilon(acc, mean_trials=10, eta=1, delta=DELTA)
    assert eps >= single
    # lower bound: the RDP of the mean number of runs is not below that of one run
    assert eps >= ps.rdp_epsilon(ORDERS, ps.repeat_and_select_rdp(
        ORDERS, np.zeros_like(ORDERS) + 1e-12, mean_trials=10, eta=1), DELTA)


def test_monte_carlo_and_baseline_schemes_are_refused():
    scheme = TruncatedPoissonScheme(dataset_size=1000, sample_rate=0.01, max_batch_size=20,
                                    analysis="baseline")
    acc = SchemeAccountant(scheme, discretization=1e-3)
    acc.step(noise_multiplier=1.0, sample_rate=scheme.expected_sample_rate(), num_steps=5)
    with pytest.raises(ValueError, match="truncated-poisson.*no dominating pair"):
        selection_epsilon(acc, mean_trials=10, eta=1, delta=DELTA)
    with pytest.raises(ValueError, match="a trial must be"):
        selection_epsilon(object(), mean_trials=10, eta=1, delta=DELTA)


# ---- argument errors ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"mean_trials": 0.5}, r"mean_trials .* must be >= 1"),
    ({"mean_trials": float("nan")}, "mean_trials must be finite"),
    ({"eta": -1.0}, r"eta .* must be in \(-1, inf\)"),
    ({"eta": float("inf")}, "eta must be finite"),
    ({"delta": 0.0}, r"delta must be in \(0, 1\)"),
    ({"delta": 1.0}, r"delta must be in \(0, 1\)"),
])
def test_bad_arguments_name_the_argument_and_range(kwargs, match):
    args = {"mean_trials": 10, "eta": 1.0, "delta": DELTA, **kwargs}
    with pytest.raises(ValueError, match=match):
        selection_epsilon(_dpsgd_event(), **args)


# ---- the law of K ------------------------------------------------------------------------
@pytest.mark.parametrize("eta", [-0.5, 0.0, 0.5, 1.0, None])
def test_draws_have_the_requested_mean(eta):
    rng = np.random.default_rng(0)
    draws = np.array([draw_num_trials(5.0, eta, rng) for _ in range(6000)])
    assert (draws >= (0 if eta is None else 1)).all()
    assert abs(draws.mean() - 5.0) < 4 * draws.std() / math.sqrt(len(draws))


def test_calibration_returns_the_sound_sigma():
    def trial(sigma):
        return _dpsgd_event(sigma=sigma, steps=100)

    sigma = calibrate_selection(3.0, delta=DELTA, mean_trials=10, eta=1, trial_for_sigma=trial,
                                sigma_range=(0.5, 5.0), rtol=1e-3, orders=FEW)
    assert selection_epsilon(trial(sigma), mean_trials=10, eta=1, delta=DELTA,
                             orders=FEW) <= 3.0
    assert selection_epsilon(trial(sigma * 0.998), mean_trials=10, eta=1, delta=DELTA,
                             orders=FEW) > 3.0


# ---- private score -----------------------------------------------------------------------
def test_private_score_value_and_cost():
    losses = np.array([0.5, 3.0, -1.0, 1.0])  # clipped to [0, 2]: 0.5 + 2 + 0 + 1 = 3.5
    noise = np.random.default_rng(7).normal(0.0, 3.0 * 2.0)
    score, trial = private_score(losses, clip=2.0, noise_multiplier=3.0, num_examples=4,
                                 rng=np.random.default_rng(7), run=_dpsgd_event())
    assert score == pytest.approx((3.5 + noise) / 4, rel=1e-12)
    assert trial == E.ComposedDpEvent([_dpsgd_event(), E.GaussianDpEvent(3.0)])
    with pytest.raises(ValueError, match="clip must be > 0"):
        private_score(losses, clip=0.0, noise_multiplier=1.0)


# ---- the search on a tiny Opacus loop ----------------------------------------------------
SCORE_SIGMA = 5.0


def _train_and_score(config, sigma=1.0):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    xv, yv = torch.randn(32, 4), torch.randint(0, 2, (32,))
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    engine = PrivacyEngine(accountant="poisson")
    model, opt, dl = engine.make_private(module=model, optimizer=opt,
                                         data_loader=DataLoader(TensorDataset(x, y),
                                                                batch_size=16),
                                         noise_multiplier=sigma, max_grad_norm=1.0)
    for step, (xb, yb) in enumerate(dl):
        if step == 2:
            break
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    with torch.no_grad():
        losses = nn.functional.cross_entropy(model(xv), yv, reduction="none")
    return private_score(losses, clip=3.0, noise_multiplier=SCORE_SIGMA, num_examples=32,
                         run=engine.accountant)


def test_search_returns_the_winner_and_the_whole_procedures_epsilon():
    grid = {"lr": [0.01, 0.1, 1.0]}
    search = PrivateSelection(grid, _train_and_score, mean_trials=3, eta=1, delta=DELTA,
                              rng=np.random.default_rng(3), progress=False)
    result = search.run()
    assert search.state_dict()["num_trials"] == search.trials_done >= 1
    assert result.config in [{"lr": v} for v in grid["lr"]]
    assert math.isfinite(result.score)
    event = E.ComposedDpEvent([_dpsgd_event(q=0.25, steps=2), E.GaussianDpEvent(SCORE_SIGMA)])
    whole = selection_epsilon(event, mean_trials=3, eta=1, delta=DELTA)
    assert result.epsilon == pytest.approx(whole, rel=1e-12)
    one_run = R.RdpAccountant(list(ORDERS)).compose(event).get_epsilon(DELTA)
    assert result.epsilon > one_run
    # K appears nowhere but in the search's own state (issue 47): not in the result, not in a
    # repr (a repr of the trials done after the search is K), not in str()
    assert not hasattr(result, "trials_run") and "trials_done" not in repr(search)
    assert "trials_run" not in repr(result) and "num_trials" not in repr(result)


def test_checkpoint_resume_keeps_k_and_results(tmp_path):
    path = tmp_path / "search.pkl"
    calls = []

    def flaky(config):
        calls.append(config)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the job is stopped during trial 2
        return _train_and_score(config)

    first = PrivateSelection([{"lr": 0.1}, {"lr": 0.5}], flaky, mean_trials=20, eta=1,
                             delta=DELTA, checkpoint=path, rng=np.random.default_rng(11),
                             progress=False)
    k = first.state_dict()["num_trials"]
    assert k >= 2  # seed chosen so the stop happens mid-search
    with pytest.raises(KeyboardInterrupt):
        first.run()
    saved = first.state_dict()
    assert len(saved["results"]) == 1
    resumed = PrivateSelection([{"lr": 0.1}, {"lr": 0.5}], _train_and_score, mean_trials=20,
                               eta=1, delta=DELTA, checkpoint=path,
                               rng=np.random.default_rng(999), progress=False)
    assert resumed.state_dict()["num_trials"] == k
    assert resumed.state_dict()["results"] == saved["results"]
    resumed.run()
    assert resumed.trials_done == k == resumed.state_dict()["num_trials"]
    with pytest.raises(ValueError, match="mean_trials=20.0"):
        PrivateSelection([{"lr": 0.1}, {"lr": 0.5}], _train_and_score, mean_trials=5, eta=1,
                         delta=DELTA, checkpoint=path, progress=False)


def test_unequal_trials_are_refused():
    def varying(config):
        return _train_and_score(config, sigma=config["sigma"])

    search = PrivateSelection([{"lr": 0.1, "sigma": 1.0}, {"lr": 0.1, "sigma": 2.0}], varying,
                              mean_trials=30, eta=1, delta=DELTA,
                              rng=np.random.default_rng(5), progress=False)
    with pytest.raises(ValueError, match="other privacy parameters"):
        search.run()


def test_search_argument_errors():
    with pytest.raises(ValueError, match="expected_trial"):
        PrivateSelection([1, 2], _train_and_score, mean_trials=3, eta=None, delta=DELTA)
    with pytest.raises(ValueError, match="candidates must not be empty"):
        PrivateSelection([], _train_and_score, mean_trials=3, eta=1, delta=DELTA)
    with pytest.raises(ValueError, match=r"eta .* must be in \(-1, inf\)"):
        PrivateSelection([1], _train_and_score, mean_trials=3, eta=-2, delta=DELTA)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        PrivateSelection([1], _train_and_score, mean_trials=3, eta=1, delta=2.0)


def test_poisson_accountant_trial_is_the_same_mechanism_as_its_event():
    """expected_trial as an event and trials from PoissonAccountant runs compare equal."""
    from opacus_structured.tuning import trial_signature

    acc = PoissonAccountant(PoissonScheme(None), discretization=1e-3)
    acc.step(noise_multiplier=1.0, sample_rate=0.25, num_steps=2)
    event = E.ComposedDpEvent([_dpsgd_event(q=0.25, steps=2), E.GaussianDpEvent(SCORE_SIGMA)])
    assert trial_signature(TrialCost(acc, (SCORE_SIGMA,))) == trial_signature(event)
    assert trial_signature(TrialCost(acc, (SCORE_SIGMA + 1,))) != trial_signature(event)


def test_plain_progress_lines_are_throttled(capsys):
    """Off a terminal: one plain line after the first trial, then at most one per ~10 s; the
    line names the elapsed time and the search's budget, never a count of trials (the count at
    the end is K; issue 47)."""
    event = E.ComposedDpEvent([_dpsgd_event(steps=10), E.GaussianDpEvent(SCORE_SIGMA)])
    search = PrivateSelection([1, 2, 3], lambda c: (float(c), event), mean_trials=30, eta=1,
                              delta=DELTA, rng=np.random.default_rng(1), progress=None)
    result = search.run()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "private selection" in ln]
    assert search.trials_done > 3 and len(lines) == 1
    assert lines[0].startswith("private selection: running, ") and "epsilon=" in lines[0]
    assert "trial" not in err.replace("mean", "") and str(search.trials_done) not in err
    assert result.config == 1 and result.score == 1.0  # lowest score wins by default


def test_the_progress_bar_never_counts_trials(monkeypatch, capsys):
    """On a terminal the bar shows the elapsed time and the budget; a tqdm bar of trials ended
    at K (issue 47)."""
    from opacus_structured import _progress

    monkeypatch.setattr(_progress, "enabled", lambda no_progress=False: not no_progress)
    shown = []
    real_elapsed = _progress.elapsed

    def spy(desc, *, show, interval=0.5):
        shown.append(show)
        return real_elapsed(desc, show=show, interval=interval)

    monkeypatch.setattr(_progress, "elapsed", spy)
    event = E.ComposedDpEvent([_dpsgd_event(steps=10), E.GaussianDpEvent(SCORE_SIGMA)])
    search = PrivateSelection([1, 2, 3], lambda c: (float(c), event), mean_trials=30, eta=1,
                              delta=DELTA, rng=np.random.default_rng(1), progress=True)
    search.run()
    err = capsys.readouterr().err
    assert shown == [True] and "private selection" in err and "elapsed" in err
    assert f"{search.trials_done}trial" not in err and f"/{search.trials_done}" not in err
    assert "trial" not in err.replace("mean", "")


def test_full_batch_gdp_accountant_is_its_gaussian_event():
    """μ-GDP accountants price by λμ²/2: T full-batch steps at σ are one Gaussian mechanism
    at σ/√T, which dp_accounting prices through its own RepeatAndSelectDpEvent."""
    from opacus_structured.accountants.gdp import GDPFullBatchAccountant

    acc = GDPFullBatchAccountant()
    acc.step(noise_multiplier=4.0, sample_rate=1.0, num_steps=16)
    for eta in (0.0, 1.0, None):
        assert selection_epsilon(acc, mean_trials=5, eta=eta, delta=DELTA) == pytest.approx(
            selection_epsilon(E.GaussianDpEvent(1.0), mean_trials=5, eta=eta, delta=DELTA),
            rel=1e-9)


def test_poisson_law_with_zero_trials_releases_nothing_but_reports_the_price():
    event = E.ComposedDpEvent([_dpsgd_event(steps=10), E.GaussianDpEvent(SCORE_SIGMA)])
    for seed in range(50):
        search = PrivateSelection([1, 2], lambda c: (float(c), event), mean_trials=1.0, eta=None,
                                  delta=DELTA, expected_trial=event,
                                  rng=np.random.default_rng(seed), progress=False)
        if search.state_dict()["num_trials"] == 0:
            break
    result = search.run()
    assert search.trials_done == 0 and result.config is None and result.score is None
    assert result.epsilon == selection_epsilon(event, mean_trials=1.0, eta=None, delta=DELTA)


@pytest.mark.slow
def test_balls_in_bins_is_priced_by_its_renyi_accountant():
    """The pld-accounting PLD of balls-in-bins is not a pair's PLD (its lower tail is cut), so
    the Rényi accountant of the whole run carries the price: >= one run, < 10 runs composed."""
    from opacus_structured.schemes.balls_in_bins import BallsInBinsScheme

    scheme = BallsInBinsScheme(num_bins=20, epochs=3)
    acc = SchemeAccountant(scheme, discretization=1e-3)
    acc.step(noise_multiplier=1.0, sample_rate=scheme.expected_sample_rate(), num_steps=60)
    bound = scheme.renyi_scheme().renyi(1.0)
    single = float(acc.get_epsilon(DELTA))
    composed = ps.rdp_epsilon(bound.orders, 10 * bound.rdp, DELTA)
    eps = selection_epsilon(acc, mean_trials=10, eta=1, delta=DELTA)
    assert single <= eps < composed
    assert eps == pytest.approx(10.60, abs=0.02)  # pinned


@pytest.mark.slow
def test_random_allocation_mf_is_priced_by_its_renyi_route():
    """Random allocation's PLD refuses with a ValueError (no pair's PLD); the Rényi route of
    the whole run still prices the selection (review of issue 40: it raised instead)."""
    from opacus_structured.schemes.random_allocation_mf import RandomAllocationMFScheme

    scheme = RandomAllocationMFScheme(strategy="identity", epochs=2, batches_per_epoch=10,
                                      method="renyi")
    acc = SchemeAccountant(scheme, discretization=1e-3)
    acc.step(noise_multiplier=1.0, sample_rate=scheme.expected_sample_rate(), num_steps=20)
    single = float(acc.get_epsilon(DELTA))
    eps = selection_epsilon(acc, mean_trials=5, eta=1, delta=DELTA)
    assert single < eps < 5 * single
    assert eps == pytest.approx(8.03, abs=0.02)  # pinned (2026-11-28)


def test_grid_and_sampler_candidate_spaces():
    from opacus_structured.tuning import candidate_list

    assert candidate_list({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
    with pytest.raises(ValueError, match=r"candidates\['a'\] must be a list"):
        candidate_list({"a": 3})
    event = E.GaussianDpEvent(2.0)
    search = PrivateSelection(lambda rng: float(rng.uniform()), lambda c: (c, event),
                              mean_trials=5, eta=0, delta=DELTA, maximize=True,
                              rng=np.random.default_rng(2), progress=False)
    result = search.run()
    assert 0 <= result.config <= 1 and result.candidate_index is None
    assert result.score == max(r[2] for r in search.state_dict()["results"])
