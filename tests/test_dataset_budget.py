"""One privacy budget per dataset (issue 46, item 3): the Rényi filter, the budget file, the
guards of make_private / DPCallback / PrivateSelection / train_forecaster, and bad input.

Independent computations: the exact integer-order Rényi divergence of the Poisson-subsampled
Gaussian mixture (a binomial sum, Mironov, Talwar & Zhang 2019, §3.3), dp_accounting's RDP
conversion and optimistic PLD, and a brute-force hockey-stick divergence of an adaptive
interaction under the filter.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

import opacus_structured
from opacus_structured.accounting import renyi_filter as rf
from opacus_structured.dataset_budget import (
    BudgetExhaustedError,
    BudgetFileError,
    DatasetBudget,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DELTA = 1e-5
# the loop: N = 120, batch 20 (q = 1/6), sigma = 1
N, BATCH, SIGMA = 120, 20, 1.0
Q = BATCH / N


# ---- the filter's math ------------------------------------------------------------------
def _mixture_rdp(q: float, sigma: float, alpha: int) -> float:
    """Exact D_α((1-q)N(0,σ²)+qN(1,σ²) ‖ N(0,σ²)) for an integer α: E_Q[(P/Q)^α] =
    Σ_k C(α,k) (1-q)^(α-k) q^k exp(k(k-1)/(2σ²)) (binomial expansion; Gaussian moments)."""
    terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
             + (alpha - k) * math.log1p(-q) + k * math.log(q) + k * (k - 1) / (2 * sigma ** 2)
             for k in range(alpha + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


@pytest.mark.parametrize("q,sigma", [(Q, SIGMA), (0.01, 0.8), (0.3, 2.0)])
def test_poisson_curve_matches_the_binomial_closed_form(q, sigma):
    orders = (2.0, 3.0, 4.0, 5.0, 8.0, 12.0)
    curve = rf.poisson_gaussian_rdp(q, sigma, orders)
    exact = [_mixture_rdp(q, sigma, int(a)) for a in orders]
    # the remove direction is the larger one for the sampled Gaussian (Mironov et al. 2019)
    np.testing.assert_allclose(curve, exact, rtol=1e-9)


def test_gaussian_curve_and_q_one():
    orders = rf.DEFAULT_ORDERS
    np.testing.assert_allclose(rf.poisson_gaussian_rdp(1.0, 2.0, orders),
                               np.asarray(orders) / 8.0, rtol=1e-15)
    np.testing.assert_allclose(rf.gaussian_rdp(0.5, orders), np.asarray(orders) * 2.0)


def test_one_order_without_tail_share_is_dp_accountings_conversion():
    for alpha, rho, delta in [(2.0, 0.7, 1e-5), (10.0, 1.3, 1e-6), (32.0, 0.05, 1e-3)]:
        filt = rf.RenyiFilter(10.0, delta, (alpha,), tail_share=0.0)
        eps, _ = dp_rdp.compute_epsilon([alpha], [rho], delta)
        assert filt.epsilon_of([rho]) == pytest.approx(eps, rel=1e-10)
        assert filt.epsilon_of([rho]) >= eps  # rounded up, never down


def test_union_over_orders_costs_log_orders_and_bounds_the_pld():
    steps = 24
    filt = rf.RenyiFilter(100.0, DELTA)
    curve = steps * rf.poisson_gaussian_rdp(Q, SIGMA, filt.orders)
    filtered = filt.epsilon_of(curve)
    eps_rdp, _ = dp_rdp.compute_epsilon(filt.orders, curve, DELTA)  # non-adaptive, full δ
    assert filtered > eps_rdp
    # exactly the conversion at δ' = (1 - share) δ / |Λ|
    shifted, _ = dp_rdp.compute_epsilon(filt.orders, curve, filt.rdp_delta / len(filt.orders))
    assert filtered == pytest.approx(shifted, rel=1e-10)
    optimistic = dp_pld.from_gaussian_mechanism(
        SIGMA, sampling_prob=Q, value_discretization_interval=1e-3,
        pessimistic_estimate=False, use_connect_dots=False).self_compose(steps)
    assert filtered >= optimistic.get_epsilon_for_delta(DELTA)


def test_nothing_charged_is_zero_and_inf_orders_are_skipped():
    filt = rf.RenyiFilter(1.0, DELTA)
    assert filt.epsilon_of(np.zeros(len(filt.orders))) == 0.0
    curve = np.full(len(filt.orders), np.inf)
    assert filt.epsilon_of(curve) == math.inf and not filt.admits(curve)
    curve[5] = 0.1
    assert math.isfinite(filt.epsilon_of(curve)) and filt.best_order(curve) == filt.orders[5]
    # a tail within B = 1 % of δ adds log(1/(1-B)) to ε; past B nothing is admitted
    base = filt.epsilon_of(curve)
    assert filt.epsilon_of(curve, 1e-12) == pytest.approx(base - math.log1p(-1e-7), rel=1e-12)
    assert filt.epsilon_of(curve, 1e-12) > base
    assert filt.epsilon_of(curve, 2e-7) == math.inf and not filt.admits(curve, 2e-7)


def test_rdp_at_orders_takes_the_next_order_up():
    out = rf.rdp_at_orders([2.0, 4.0, 8.0], [1.0, 3.0, 2.5], [1.5, 2.0, 3.0, 5.0, 16.0])
    # monotone in the order: 3.0 is bounded by min(ρ(4), ρ(8)) = 2.5
    np.testing.assert_array_equal(out, [1.0, 1.0, 2.5, 2.5, np.inf])


def _rr(eps: float):
    """Randomized response on one bit: P(1 | x) = e^ε/(1+e^ε), P(1 | x') = 1/(1+e^ε)."""
    p = math.exp(eps) / (1 + math.exp(eps))
    return p, 1 - p


def _rr_rdp(eps: float, orders) -> np.ndarray:
    p, q = _rr(eps)
    a = np.asarray(orders)
    fwd = np.log(p ** a * q ** (1 - a) + (1 - p) ** a * (1 - q) ** (1 - a)) / (a - 1)
    return fwd  # symmetric mechanism: both directions are equal


def test_brute_force_adaptive_interaction_stays_within_the_cap():
    """An analyst picks each next randomized response from the outputs so far (the more 1s,
    the larger its ε) until the filter refuses; the exact hockey-stick divergence of the whole
    transcript, enumerated, stays <= δ at the cap ε (both orders of the neighbours)."""
    cap, delta, depth = 1.5, 1e-3, 11
    filt = rf.RenyiFilter(cap, delta, (2.0, 4.0, 8.0, 16.0), tail_share=0.0)
    choices = (0.15, 0.3, 0.6)
    curves = {eps: _rr_rdp(eps, filt.orders) for eps in choices}

    def transcripts():
        out = {}
        for bits in itertools.product((0, 1), repeat=depth):
            total = np.zeros(len(filt.orders))
            px = qx = 1.0
            released = []
            for b in bits:
                eps = choices[min(sum(released), len(choices) - 1)]
                nxt = total + curves[eps]
                if not filt.admits(nxt):
                    break  # refused: nothing more is released (the rest of bits unused)
                total = nxt
                p, q = _rr(eps)
                px *= p if b else 1 - p
                qx *= q if b else 1 - q
                released.append(b)
            out[tuple(released)] = (px, qx)  # the same prefix is reached once per suffix
        return out

    probs = transcripts()
    assert max(len(t) for t in probs) >= 3  # the filter let several releases through
    assert min(len(t) for t in probs) < depth  # and refused some
    for first, second in ((0, 1), (1, 0)):
        hockey = sum(max(0.0, v[first] - math.exp(cap) * v[second]) for v in probs.values())
        assert hockey <= delta
    assert sum(v[0] for v in probs.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(epsilon=-1.0, delta=DELTA), "epsilon must be > 0"),
    (dict(epsilon=0.0, delta=DELTA), "epsilon must be > 0"),
    (dict(epsilon=math.inf, delta=DELTA), "epsilon must be finite"),
    (dict(epsilon=math.nan, delta=DELTA), "epsilon must be finite"),
    (dict(epsilon=1.0, delta=0.0), r"delta must be in \(0, 1\)"),
    (dict(epsilon=1.0, delta=1.0), r"delta must be in \(0, 1\)"),
    (dict(epsilon=1.0, delta=-1e-5), r"delta must be in \(0, 1\)"),
    (dict(epsilon=1.0, delta=DELTA, orders=(0.5, 2.0)), "orders must be > 1"),
    (dict(epsilon=1.0, delta=DELTA, orders=(4.0, 2.0)), "increasing"),
    (dict(epsilon=1.0, delta=DELTA, tail_share=1.0), r"tail_share must be in \[0, 1\)"),
])
def test_bad_caps_are_refused_naming_the_argument(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetBudget(tmp_path / "b.budget", **kwargs)
    assert not (tmp_path / "b.budget").exists()


# ---- the file -----------------------------------------------------------------------------
def test_file_format_records_and_journal_hooks(tmp_path):
    path = tmp_path / "data.budget"
    budget = DatasetBudget(path, epsilon=8.0, delta=DELTA)
    assert budget.spent() == 0.0 and budget.remaining() == 8.0
    assert budget.route.startswith("rdp-filter (Feldman & Zrnic 2021")
    curve = 10 * rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    after = budget.charge("run-a", rdp=curve, noise_stream={"stream": "abc", "first": 0})
    budget.record("run-a", kind="released", step=10, noise_stream={"stream": "abc", "last": 9})
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "opacus-structured/dataset-budget" and header["version"] == 1
    assert (header["epsilon"], header["delta"]) == (8.0, DELTA)
    assert header["route"] == budget.route and header["orders"] == list(budget.orders)
    charge, note = json.loads(lines[1]), json.loads(lines[2])
    assert (charge["seq"], charge["run"], charge["kind"]) == (1, "run-a", "charge")
    # null = no bound at that order (dp_accounting's series did not converge there)
    assert [math.inf if v is None else v for v in charge["run_rdp"]] == \
        pytest.approx(list(curve), rel=1e-15)
    assert None in charge["run_rdp"] and math.isfinite(charge["epsilon"])
    assert charge["noise_stream"] == {"stream": "abc", "first": 0}
    assert charge["epsilon"] == after and "time" in charge and charge["pid"] == os.getpid()
    assert note["kind"] == "released" and "run_rdp" not in note
    assert budget.last_record("run-a")["step"] == 10
    assert budget.last_record("run-a", kind="charge")["seq"] == 1
    assert budget.last_record("run-b") is None
    assert budget.spent() == pytest.approx(budget.filter.epsilon_of(curve), rel=1e-12)
    # a dp_accounting event is priced by its RdpAccountant on the budget's orders
    import dp_accounting

    budget.charge("run-b", event=dp_accounting.GaussianDpEvent(10.0))
    np.testing.assert_allclose(budget.run_rdp("run-b")[0],
                               np.asarray(budget.orders) / 200.0, rtol=1e-12)
    # reopening reads the same state; open() takes the cap from the file
    again = DatasetBudget.open(path)
    assert (again.epsilon, again.delta, again.spent()) == (8.0, DELTA, budget.spent())
    with pytest.raises(ValueError, match="set by the budget itself"):
        budget.record("run-a", seq=3)
    with pytest.raises(ValueError, match="kind must be"):
        budget.record("run-a", kind="charge")
    with pytest.raises(ValueError, match="exactly one of"):
        budget.charge("run-c")


def test_charge_past_the_cap_is_refused_and_records_nothing(tmp_path):
    budget = DatasetBudget(tmp_path / "b.budget", epsilon=8.0, delta=DELTA)
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    budget.charge("a", rdp=4 * step)
    before, records = budget.spent(), len(budget.records())
    with pytest.raises(BudgetExhaustedError) as info:
        budget.charge("b", rdp=400 * step)
    assert info.value.spent == before and info.value.cap == 8.0
    assert info.value.requested > 8.0
    assert budget.spent() == before and len(budget.records()) == records
    assert not budget.would_admit(rdp=400 * step) and budget.would_admit(rdp=step)


@pytest.mark.parametrize("content,match", [
    ("not json\n", "line 1 is not a dataset budget header"),
    ('{"format": "something else"}\n', "not a dataset budget file"),
    ('{"format": "opacus-structured/dataset-budget", "version": 99}\n', "version 99"),
    ("", "no complete header line"),
])
def test_unreadable_files_give_clear_errors(tmp_path, content, match):
    path = tmp_path / "b.budget"
    path.write_text(content)
    with pytest.raises(BudgetFileError, match=match):
        DatasetBudget(path, epsilon=1.0, delta=DELTA)


def test_corrupted_record_and_torn_tail(tmp_path):
    path = tmp_path / "b.budget"
    budget = DatasetBudget(path, epsilon=5.0, delta=DELTA)
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    budget.charge("a", rdp=step)
    budget.charge("a", rdp=step)
    spent = budget.spent()
    # a torn last line (a crash mid-write, before its release) is not a charge
    with open(path, "ab") as f:
        f.write(b'{"seq": 3, "run": "a", "kind": "cha')
    assert DatasetBudget(path, epsilon=5.0, delta=DELTA).spent() == spent
    with pytest.warns(RuntimeWarning, match="incomplete last line"):
        budget.charge("b", rdp=step)  # the next write cuts it
    assert [r["seq"] for r in budget.records()] == [1, 2, 3]
    assert all(line.strip() for line in path.read_text().splitlines())
    # a complete but malformed line is corruption: refused, naming the line
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace('"seq": 2', '"seq": 7')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BudgetFileError, match="line 3: record seq 7, expected 2"):
        DatasetBudget(path, epsilon=5.0, delta=DELTA)
    lines[2] = "{oops"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BudgetFileError, match="line 3: malformed record"):
        DatasetBudget(path, epsilon=5.0, delta=DELTA).spent()
    lines[2] = json.dumps({"seq": 2, "run": "a", "kind": "charge", "run_rdp": [-1.0] * 21})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BudgetFileError, match="line 3: .*>= 0"):
        DatasetBudget(path, epsilon=5.0, delta=DELTA)


def test_created_without_hard_links(tmp_path, monkeypatch):
    def no_link(*args, **kwargs):
        raise OSError("hard links not supported")

    monkeypatch.setattr(os, "link", no_link)
    budget = DatasetBudget(tmp_path / "b.budget", epsilon=2.0, delta=DELTA)
    budget.charge("a", rdp=rf.gaussian_rdp(10.0, budget.orders))
    assert DatasetBudget.open(tmp_path / "b.budget").spent() == budget.spent() > 0
    assert [p.name for p in tmp_path.iterdir()] == ["b.budget"]  # no temporary file left


def test_another_cap_is_refused(tmp_path):
    path = tmp_path / "b.budget"
    DatasetBudget(path, epsilon=2.0, delta=DELTA)
    with pytest.raises(BudgetFileError, match=r"delta=1e-05 \(asked 1e-06\)"):
        DatasetBudget(path, epsilon=2.0, delta=1e-6)
    with pytest.raises(BudgetFileError, match=r"epsilon=2.0 \(asked 3.0\)"):
        DatasetBudget(path, epsilon=3.0, delta=DELTA)
    with pytest.raises(BudgetFileError, match="orders"):
        DatasetBudget(path, epsilon=2.0, delta=DELTA, orders=(2.0, 4.0))
    with pytest.raises(BudgetFileError, match="no such budget file"):
        DatasetBudget.open(tmp_path / "missing.budget")
    with pytest.raises(BudgetFileError, match="does not exist"):
        DatasetBudget(tmp_path / "no" / "dir.budget", epsilon=2.0, delta=DELTA)


def _charge_many(path: str, run: str, count: int, barrier) -> None:
    budget = DatasetBudget(path, epsilon=50.0, delta=DELTA)
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    barrier.wait()
    for i in range(count):
        budget.charge(run, rdp=step, i=i)


def _reserve_until_refused(path: str, run: str, barrier, out) -> None:
    budget = DatasetBudget(path, epsilon=6.0, delta=DELTA)
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    barrier.wait()
    admitted = 0
    while True:
        try:
            budget.charge(run, rdp=step)
        except BudgetExhaustedError:
            break
        admitted += 1
    out.put((run, admitted))


def test_two_processes_charging_concurrently_lose_nothing(tmp_path):
    path = str(tmp_path / "b.budget")
    DatasetBudget(path, epsilon=50.0, delta=DELTA)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_charge_many, args=(path, f"p{i}", 40, barrier))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    budget = DatasetBudget(path, epsilon=50.0, delta=DELTA)
    records = budget.records()
    assert [r["seq"] for r in records] == list(range(1, 81))
    assert sorted(r["run"] for r in records) == ["p0"] * 40 + ["p1"] * 40
    assert len({r["pid"] for r in records}) == 2
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    np.testing.assert_allclose(budget.total_rdp(), 80 * step, rtol=1e-12)


def test_two_processes_near_the_cap_never_pass_it(tmp_path):
    path = str(tmp_path / "b.budget")
    budget = DatasetBudget(path, epsilon=6.0, delta=DELTA)
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_reserve_until_refused, args=(path, f"p{i}", barrier, out))
             for i in range(2)]
    for p in procs:
        p.start()
    admitted = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    total = admitted["p0"] + admitted["p1"]
    assert total >= 2 and budget.spent() <= 6.0
    assert budget.filter.epsilon_of(total * step) == pytest.approx(budget.spent(), rel=1e-12)
    assert not budget.filter.admits((total + 1) * step)  # the refusals were at the cap


# ---- make_private ---------------------------------------------------------------------------
def _poisson_run(budget, epochs=2, seed=0, raise_refusal=False):
    """The issue's loop (N = 120, batch 20, σ = 1) through make_private; returns
    (engine, optimizer, model, steps released, refusal)."""
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    x = torch.randn(N, 5)
    y = (x[:, 0] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    model = nn.Linear(5, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(accountant="poisson")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = opacus_structured.make_private(
            engine, module=model, optimizer=opt, data_loader=loader,
            noise_multiplier=SIGMA, max_grad_norm=1.0, budget=budget,
            sampler_generator=torch.Generator().manual_seed(seed))
        released, refusal = 0, None
        for _ in range(epochs):
            for xb, yb in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                weights = [p.detach().clone() for p in model.parameters()]
                try:
                    opt.step()
                except BudgetExhaustedError as err:
                    refusal = (err, weights, [p.detach().clone() for p in model.parameters()])
                    if raise_refusal:
                        raise
                    return engine, opt, model, released, refusal
                released += 1
    return engine, opt, model, released, refusal


def test_acceptance_two_runs_then_a_refused_third(tmp_path):
    path = tmp_path / "data.budget"
    budget = DatasetBudget(path, epsilon=12.0, delta=DELTA)
    e1, o1, _, n1, r1 = _poisson_run(budget)
    e2, o2, _, n2, r2 = _poisson_run(budget, seed=1)
    assert r1 is None and r2 is None and n1 == n2 == len(e1.accountant) == len(e2.accountant)
    assert budget.settle() or True
    spent_two = budget.spent()
    # >= the composed PLD lower bound (dp_accounting, optimistic) of their 2 x 12 steps
    optimistic = dp_pld.from_gaussian_mechanism(
        SIGMA, sampling_prob=Q, value_discretization_interval=1e-3,
        pessimistic_estimate=False, use_connect_dots=False).self_compose(n1 + n2)
    assert spent_two >= optimistic.get_epsilon_for_delta(DELTA)
    # what the two runs' accountants priced, through the filter: exactly what is charged
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    assert spent_two == pytest.approx(budget.filter.epsilon_of((n1 + n2) * step), rel=1e-12)
    # a third run is refused before the noisy step that would pass the cap
    e3, o3, _, n3, refusal = _poisson_run(budget, epochs=10, seed=2)
    assert refusal is not None
    err, weights_before, weights_after = refusal
    assert all(torch_equal(a, b) for a, b in zip(weights_before, weights_after, strict=True))
    assert len(e3.accountant) == n3 > 0  # the refused step was never priced: not released
    budget.settle()
    released = n1 + n2 + n3
    assert budget.spent() <= 12.0
    assert budget.spent() == pytest.approx(budget.filter.epsilon_of(released * step),
                                           rel=1e-12)
    assert budget.filter.epsilon_of((released + 1) * step) > 12.0  # the step refused
    assert err.cap == 12.0 and err.requested > 12.0
    # a new process sees the same spent()
    code = ("import sys; from opacus_structured import DatasetBudget; "
            "print(repr(DatasetBudget(sys.argv[1], epsilon=12.0, delta=1e-5).spent()))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT},
                         timeout=300)
    assert float(out.stdout.strip()) == pytest.approx(budget.spent(), rel=1e-12)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_reservations_are_blocks_and_settle_to_the_steps_released(tmp_path):
    from opacus_structured.accountants.budget_guard import FIRST_BLOCK, guards_of

    budget = DatasetBudget(tmp_path / "b.budget", epsilon=50.0, delta=DELTA)
    engine, opt, _, released, _ = _poisson_run(budget, epochs=3)
    guard = guards_of(opt)[budget.path]
    reserves = budget.records(guard.run_id, kind="reserve")
    assert [r["reserved"] for r in reserves] == [FIRST_BLOCK, 2 * FIRST_BLOCK,
                                                 4 * FIRST_BLOCK][:len(reserves)]
    assert len(reserves) < released  # one write per block, not per step
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    assert np.all(budget.run_rdp(guard.run_id)[0] >= released * step * (1 - 1e-12))
    budget.settle()
    np.testing.assert_allclose(budget.run_rdp(guard.run_id)[0], released * step, rtol=1e-12)
    assert budget.last_record(guard.run_id)["kind"] == "settle"
    assert budget.last_record(guard.run_id)["steps_priced"] == released == len(engine.accountant)


@pytest.mark.slow  # ~15 s of calibration (the run's own, not the budget's): CI runs it
def test_make_private_with_epsilon_charges_too(tmp_path):
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    budget = DatasetBudget(tmp_path / "b.budget", epsilon=20.0, delta=DELTA)
    torch.manual_seed(0)
    # q = 1/60: dp_accounting's RDP route (which calibration consults) is quick there
    loader = DataLoader(TensorDataset(torch.randn(N, 5), torch.randint(0, 2, (N,))),
                        batch_size=2)
    model = nn.Linear(5, 2)
    engine = PrivacyEngine(accountant="poisson")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = opacus_structured.make_private_with_epsilon(
            engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader, target_epsilon=4.0, target_delta=DELTA, epochs=1,
            max_grad_norm=1.0, budget=budget, discretization=1e-3)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    budget.settle()
    step = rf.poisson_gaussian_rdp(1 / 60, opt.noise_multiplier, budget.orders)
    assert budget.spent() == pytest.approx(
        budget.filter.epsilon_of(len(engine.accountant) * step), rel=1e-12)
    # the filter's (adaptive) value is above the run's own PLD epsilon
    assert budget.spent() >= engine.accountant.get_epsilon(DELTA)


def test_history_charged_continues_a_run_without_charging_its_record_twice(tmp_path):
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_structured.accountants.budget_curves import accountant_rdp
    from opacus_structured.accountants.budget_guard import guard_budget

    torch.manual_seed(0)
    x = torch.randn(N, 5)
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=BATCH)
    model = nn.Linear(5, 2)
    engine = PrivacyEngine(accountant="poisson")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = opacus_structured.make_private(
            engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=data, noise_multiplier=SIGMA, max_grad_norm=1.0)

        def epoch():
            for xb, yb in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()

        epoch()  # the record of an earlier part of the run, charged under "A" below
        acc = engine.accountant
        budget = DatasetBudget(tmp_path / "b.budget", epsilon=50.0, delta=DELTA)
        with pytest.raises(ValueError, match="has no charge"):
            guard_budget(budget, opt, acc, sample_rate=1 / 6, run_id="A",
                         history_charged=True)
        budget.charge("A", rdp=0.5 * accountant_rdp(acc, budget.orders)[0])
        with pytest.raises(ValueError, match="does not cover the accountant's record"):
            guard_budget(budget, opt, acc, sample_rate=1 / 6, run_id="A",
                         history_charged=True)
        budget.charge("A", rdp=0.5 * accountant_rdp(acc, budget.orders)[0])
        first = len(acc)
        guard_budget(budget, opt, acc, sample_rate=1 / 6, run_id="A", history_charged=True)
        epoch()
    budget.settle()
    step = rf.poisson_gaussian_rdp(Q, SIGMA, budget.orders)
    assert len(acc) > first
    np.testing.assert_allclose(budget.run_rdp("A")[0], len(acc) * step, rtol=1e-9)


def test_budget_argument_is_checked():
    from opacus_structured.accountants.budget_guard import guard_budget

    with pytest.raises(ValueError, match="budget must be an opacus_structured.DatasetBudget"):
        guard_budget("file.budget", object(), object(), sample_rate=0.1)


def test_monte_carlo_and_lower_bounds_are_not_charged():
    from opacus_structured.accountants.budget_curves import accountant_rdp

    class Fake:
        history = [(1.0, 0.1, 3)]

        class scheme:  # noqa: N801 - a stand-in scheme object
            name = "fake"
            bound = "monte-carlo"

    with pytest.raises(ValueError, match="not a guarantee"):
        accountant_rdp(Fake(), rf.DEFAULT_ORDERS)
    with pytest.raises(ValueError, match="scheme accountants"):
        accountant_rdp(object(), rf.DEFAULT_ORDERS)


def test_curves_of_other_schemes_bound_their_accountants(tmp_path):
    """Shuffle (μ-GDP: exact Gaussian curve) and truncated Poisson (pessimistic PLD: finite
    part and tail): the charged curve's ε at the budget's δ is >= the accountant's ε."""
    from opacus_structured.accountants.base import SchemeAccountant
    from opacus_structured.accountants.budget_curves import accountant_rdp
    from opacus_structured.schemes.shuffle import ShuffleScheme
    from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

    filt = rf.RenyiFilter(100.0, DELTA)
    shuffle = SchemeAccountant(ShuffleScheme(dataset_size=N, batch_size=BATCH),
                               discretization=1e-3)
    tp = SchemeAccountant(TruncatedPoissonScheme(dataset_size=N, sample_rate=Q,
                                                 max_batch_size=30), discretization=1e-3)
    for acc, rate in ((shuffle, 1 / 6), (tp, Q)):
        for _ in range(12):
            acc.step(noise_multiplier=SIGMA, sample_rate=rate)
        curve, tail = accountant_rdp(acc, filt.orders)
        assert filt.epsilon_of(curve, tail) >= acc.get_epsilon(DELTA)
    mu = shuffle.mu()
    np.testing.assert_allclose(accountant_rdp(shuffle, filt.orders)[0],
                               np.asarray(filt.orders) * mu * mu / 2, rtol=1e-12)


def test_earlier_phases_are_charged_too():
    """A run resumed under another batch size (accountants/phases.py): its earlier phases are
    priced by their own schemes and added to the run's curve (shuffle: μ-GDP, exact)."""
    from opacus_structured.accountants.base import SchemeAccountant
    from opacus_structured.accountants.budget_curves import accountant_rdp
    from opacus_structured.schemes.shuffle import ShuffleScheme

    orders = rf.DEFAULT_ORDERS
    first = SchemeAccountant(ShuffleScheme(dataset_size=N, batch_size=10), discretization=1e-3)
    first.step(noise_multiplier=2.0, sample_rate=1 / 12, num_steps=24)   # 2 epochs
    second = SchemeAccountant(ShuffleScheme(dataset_size=N, batch_size=20), discretization=1e-3)
    second.load_state_dict(first.state_dict())   # a new phase
    second.step(noise_multiplier=4.0, sample_rate=1 / 6, num_steps=6)   # 1 epoch
    assert len(second.phases) == 1
    curve, tail = accountant_rdp(second, orders)
    mus = first.mu() ** 2 + second.mu() ** 2
    np.testing.assert_allclose(curve, np.asarray(orders) * mus / 2, rtol=1e-12)
    assert tail == 0.0
    assert rf.RenyiFilter(100.0, DELTA).epsilon_of(curve) >= float(second.get_epsilon(DELTA))


# ---- PrivateSelection ---------------------------------------------------------------------
def test_private_selection_is_charged_once_as_one_mechanism(tmp_path):
    import dp_accounting

    from opacus_structured.accounting import private_selection as ps
    from opacus_structured.tuning import PrivateSelection

    trial = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(3.0)), 12)
    budget = DatasetBudget(tmp_path / "b.budget", epsilon=8.0, delta=DELTA)
    ran = []

    def train_and_score(config):
        ran.append(config)
        return float(config), trial

    search = PrivateSelection([1, 2, 3], train_and_score, mean_trials=3, eta=1.0, delta=DELTA,
                              expected_trial=trial, rng=np.random.default_rng(0),
                              budget=budget, checkpoint=tmp_path / "search.ckpt")
    search.run()
    charges = budget.records(kind="charge")
    assert len(charges) == 1 and len(ran) >= 1  # one record whatever K
    curve = ps.repeat_and_select_rdp(np.asarray(budget.orders),
                                     rf.event_rdp(trial, budget.orders), mean_trials=3,
                                     eta=1.0)
    np.testing.assert_allclose(budget.total_rdp(), curve, rtol=1e-12)
    # nothing in the record counts K (the secret number of trials)
    assert not {"trials_run", "num_trials", "trials"} & set(charges[0])
    # resuming the search does not charge it again
    again = PrivateSelection([1, 2, 3], train_and_score, mean_trials=3, eta=1.0, delta=DELTA,
                             expected_trial=trial, budget=budget,
                             checkpoint=tmp_path / "search.ckpt")
    again.run()
    assert len(budget.records(kind="charge")) == 1
    # a search that does not fit is refused before any trial runs
    ran.clear()
    small = DatasetBudget(tmp_path / "small.budget", epsilon=0.5, delta=DELTA)
    with pytest.raises(BudgetExhaustedError):
        PrivateSelection([1, 2, 3], train_and_score, mean_trials=3, eta=1.0, delta=DELTA,
                         expected_trial=trial, budget=small).run()
    assert ran == [] and small.records() == []


# ---- DPCallback ---------------------------------------------------------------------------
def test_dp_callback_stops_before_the_cap_and_settles(tmp_path):
    pytest.importorskip("lightning.pytorch")
    import torch
    from lightning_small import fit, small_module
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_callbacks import DPCallback
    from opacus_structured.schemes.poisson import PoissonScheme

    q = 1 / 8
    budget = DatasetBudget(tmp_path / "b.budget", epsilon=6.0, delta=DELTA)
    step = rf.poisson_gaussian_rdp(q, SIGMA, budget.orders)
    budget.charge("earlier-run", rdp=10 * step)
    fits = int(max(k for k in range(1, 400) if budget.filter.admits(k * step))) - 10
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g),
                                    torch.randint(0, 2, (64,), generator=g)), batch_size=8)
    cb = DPCallback(scheme=PoissonScheme(sample_rate=q), noise_multiplier=SIGMA,
                    max_grad_norm=1.0, delta=DELTA, discretization=1e-3, seed=1, budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(cb, small_module(4), data, fits + 20)
    assert cb.steps == fits  # stopped gracefully before the step that would pass the cap
    assert budget.spent() <= 6.0
    np.testing.assert_allclose(budget.run_rdp(cb.budget_guard.run_id)[0], fits * step,
                               rtol=1e-12)  # settled at fit end


# ---- the command line ---------------------------------------------------------------------
def _forecast_args(*argv):
    import argparse

    from opacus_structured.commands._forecast_args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv,match", [
    (("--budget-epsilon", "2"), "--budget-epsilon sets the cap of a --budget file"),
    (("--budget", "{tmp}/new.budget"), "--budget-epsilon E to create it"),
    (("--budget", "{tmp}/no/dir.budget", "--budget-epsilon", "2"), "does not exist"),
    (("--budget", "{tmp}", "--budget-epsilon", "2"), "is a directory"),
    (("--budget", "{tmp}/b.budget", "--budget-epsilon", "-1"), "--budget-epsilon must be"),
    (("--budget", "{tmp}/b.budget", "--budget-epsilon", "2", "--epsilon", "inf"),
     "trains without privacy"),
])
def test_forecast_budget_flags_are_checked_first(tmp_path, argv, match):
    from opacus_structured.commands._forecast_check import check_arguments

    args = _forecast_args(*(a.format(tmp=tmp_path) for a in argv))
    with pytest.raises(ValueError, match=match):
        check_arguments(args)


def test_forecast_budget_flags_accept_a_file_or_a_new_cap(tmp_path):
    from opacus_structured.commands._forecast_check import check_arguments
    from opacus_structured.commands._forecast_job import dataset_budget as _dataset_budget

    args = _forecast_args("--budget", str(tmp_path / "p.budget"), "--budget-epsilon", "3")
    check_arguments(args)
    created = _dataset_budget(args)
    assert (created.epsilon, created.delta) == (3.0, args.delta)
    reopened = _forecast_args("--budget", str(tmp_path / "p.budget"))
    check_arguments(reopened)
    assert _dataset_budget(reopened).id == created.id


# ---- train_forecaster and forecast --budget -------------------------------------------------
@pytest.mark.slow  # 10-25 s (gluonts, Lightning); the same wiring as DPCallback's test above
def test_train_forecaster_charges_the_panel_and_stops_at_its_cap(tmp_path):
    pytest.importorskip("gluonts")
    from opacus_structured.accountants.budget_curves import accountant_rdp
    from opacus_structured.forecasting.data import load_us_employment, train_test_split
    from opacus_structured.forecasting.training import train_forecaster

    train, _ = train_test_split(load_us_employment().subset(range(0, 148, 18)), 6)
    common = dict(prediction_length=6, context_length=8, batch_size=4, delta=DELTA,
                  noise_multiplier=2.0, discretization=1e-3,
                  estimator_kwargs=dict(hidden_dimension=2, kernel_size=5))
    budget = DatasetBudget(tmp_path / "panel.budget", epsilon=6.0, delta=DELTA)
    first = train_forecaster("dlinear", train, max_steps=2, budget=budget, **common)
    assert first.steps == 2
    charged = budget.spent()
    second = train_forecaster("dlinear", train, max_steps=500, budget=budget, **common)
    assert 0 < second.steps < 500  # stopped before the step that would pass the cap
    assert charged < budget.spent() <= 6.0
    # each run's charge is its accountant's structured-subsampling curve (PLD route, tail)
    runs = list(budget.runs())
    curves = [accountant_rdp(res.accountant, budget.orders) for res in (first, second)]
    total = sum(c for c, _ in curves)
    tail = sum(t for _, t in curves)
    assert len(runs) == 2 and tail > 0
    assert budget.spent() == pytest.approx(budget.filter.epsilon_of(total, tail), rel=1e-12)
    with pytest.raises(ValueError, match="non-private training"):
        train_forecaster("dlinear", train, max_steps=1, budget=budget,
                         **{**common, "noise_multiplier": None, "delta": None})


@pytest.mark.slow
@pytest.mark.long  # two forecast runs (~30-60 s): left out of CI's 30-minute budget (-m long)
def test_forecast_command_charges_its_runs_to_the_budget_file(tmp_path, capsys):
    pytest.importorskip("gluonts")
    from opacus_structured.cli import main

    path = tmp_path / "panel.budget"
    argv = ["forecast", "--model", "dlinear", "--epsilon", "2", "--delta", "1e-5",
            "--num-series", "10", "--max-steps", "2", "--batch-size", "4",
            "--prediction-length", "6", "--context-length", "8", "--num-samples", "10",
            "--init-from", "none", "--no-baselines", "--no-ets", "--json", "--no-progress",
            "--output", str(tmp_path / "rep"), "--budget", str(path)]
    # two steps of structured subsampling (substitution, rate 0.4): each run costs ~17 through
    # the RDP filter (its PLD epsilon is 2: RDP is loose for few large steps; see the guide)
    assert main([*argv, "--budget-epsilon", "60"]) == 0
    report = json.loads(capsys.readouterr().out)
    first = report["dataset_budget"]
    assert main(argv) == 0  # the file exists: its cap is read from it
    second = json.loads(capsys.readouterr().out)["dataset_budget"]
    assert report["steps"] == 2 and report["epsilon"] <= first["spent"]
    assert 0 < first["spent"] < second["spent"] <= 60.0
    assert second["epsilon"] == 60.0 and second["route"].startswith("rdp-filter")
    assert len(DatasetBudget.open(path).runs()) == 2
