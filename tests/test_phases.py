"""Phase schedules across a resume (issue 46, item 2; repro 08): a run resumed under another
batch size or rate is a new phase, composed with the earlier ones, never refused.

The independent price is dp_accounting's composition of the Poisson-subsampled Gaussian steps
that actually ran: its optimistic PLD is a lower bound of the true ε, its pessimistic PLD at the
same grid an upper bound that our (pessimistic) composition should match closely.
"""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from _training import private_linear, train, xy_dataset
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from lightning_small import fit as small_fit
from lightning_small import small_module
from torch.utils.data import DataLoader

from opacus_structured.accountants.base import SchemeAccountant
from opacus_structured.accountants.phases import PhaseNotComposableError
from opacus_structured.accounting.gaussian import gdp_epsilon
from opacus_structured.schemes.poisson import PoissonScheme
from opacus_structured.schemes.shuffle import ShuffleScheme
from opacus_structured.schemes.truncated_poisson import TruncatedPoissonScheme

warnings.filterwarnings("ignore", message="Secure RNG turned off")

N, SIGMA, DELTA, D = 60, 1.0, 1e-5, 1e-3


def _dp_accounting(parts, pessimistic):
    total = None
    for sigma, q, n in parts:
        p = dp_pld.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q,
                                           pessimistic_estimate=pessimistic,
                                           value_discretization_interval=D).self_compose(n)
        total = p if total is None else total.compose(p)
    return float(total.get_epsilon_for_delta(DELTA))


def _data():
    return xy_dataset(N, 3)


def _phase(batch, seed):
    return private_linear(_data(), batch, seed=seed, noise_multiplier=SIGMA, max_grad_norm=1.0,
                          dataset_size=N, discretization=D)


def _epochs(model, optimizer, loader, epochs):
    return train(model, optimizer, loader, epochs=epochs)


def test_resume_with_another_batch_size_is_a_new_phase(tmp_path):
    engine, model, optimizer, loader = _phase(10, seed=1)   # q = 1/6
    s1 = _epochs(model, optimizer, loader, 2)
    path = os.path.join(tmp_path, "phase1.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    engine2, model2, optimizer2, loader2 = _phase(20, seed=2)   # q = 1/3
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    acc = engine2.accountant
    assert len(acc.phases) == 1 and len(acc) == 0 and acc.total_steps == s1
    s2 = _epochs(model2, optimizer2, loader2, 1)
    parts = [(SIGMA, 1 / 6, s1), (SIGMA, 1 / 3, s2)]
    eps = float(engine2.get_epsilon(DELTA))
    assert _dp_accounting(parts, pessimistic=False) <= eps
    assert eps == pytest.approx(_dp_accounting(parts, pessimistic=True), rel=1e-3)
    # the phases round-trip through the state (JSON-ready), and a third phase composes on
    state = acc.state_dict()
    state["phases"] = json.loads(json.dumps(state["phases"]))  # the phases are JSON-ready
    back = SchemeAccountant(PoissonScheme(sample_rate=1 / 3), discretization=D)
    back.load_state_dict(state)
    assert float(back.get_epsilon(DELTA)) == pytest.approx(eps, rel=1e-12)
    third = SchemeAccountant(PoissonScheme(sample_rate=1 / 2), discretization=D)
    third.load_state_dict(state)
    third.step(noise_multiplier=2.0, sample_rate=0.5, num_steps=3)
    assert len(third.phases) == 2 and third.total_steps == s1 + s2 + 3
    assert float(third.get_epsilon(DELTA)) >= _dp_accounting(parts + [(2.0, 0.5, 3)], False)


def test_a_mu_gdp_phase_composes_as_its_gaussian():
    """Shuffled batches are priced as μ-GDP (no amplification: each example once per epoch,
    μ = Δ√E/σ); a resume with another batch size composes the two phases' Gaussians."""
    first = SchemeAccountant(ShuffleScheme(dataset_size=N, batch_size=10), discretization=D)
    first.step(noise_multiplier=2.0, sample_rate=1 / 6, num_steps=12)   # 2 epochs
    second = SchemeAccountant(ShuffleScheme(dataset_size=N, batch_size=20), discretization=D)
    second.load_state_dict(first.state_dict())
    second.step(noise_multiplier=4.0, sample_rate=1 / 3, num_steps=3)   # 1 epoch
    mu = math.sqrt(first.mu() ** 2 + (1 / 4.0) ** 2)   # epochs compose as Gaussians
    exact = gdp_epsilon(DELTA, mu)
    eps = float(second.get_epsilon(DELTA))
    assert exact <= eps <= exact * 1.01
    with pytest.raises(ValueError, match="another sampling scheme"):
        SchemeAccountant(PoissonScheme(sample_rate=0.1)).load_state_dict(first.state_dict())


def test_a_phase_without_a_pld_is_refused_naming_the_cause():
    tight = SchemeAccountant(TruncatedPoissonScheme(N, 0.1, 12), discretization=D)
    tight.step(noise_multiplier=SIGMA, sample_rate=0.1, num_steps=5)
    baseline = SchemeAccountant(TruncatedPoissonScheme(N, 0.1, 14, analysis="baseline"),
                                discretization=D)
    with pytest.raises(PhaseNotComposableError, match="baseline.*DatasetBudget"):
        baseline.load_state_dict(tight.state_dict())
    assert baseline.phases == [] and len(baseline) == 0


def test_lightning_resume_with_another_rate_is_a_new_phase(tmp_path):
    from lightning_callbacks import DPCallback

    def fit(cb, steps, **kw):
        torch.manual_seed(0)
        small_fit(cb, small_module(), DataLoader(_data(), batch_size=10), steps, **kw)

    def callback(q):
        return DPCallback(delta=DELTA, noise_multiplier=SIGMA, max_grad_norm=1.0,
                          scheme=PoissonScheme(sample_rate=q), dataset_size=N,
                          discretization=D)

    fit(callback(1 / 6), 4, dirpath=tmp_path, every=4)
    cb = callback(1 / 3)
    fit(cb, 7, ckpt_path=os.path.join(tmp_path, "step=4.ckpt"))
    assert len(cb.accountant.phases) == 1 and len(cb.accountant) == 3
    parts = [(SIGMA, 1 / 6, 4), (SIGMA, 1 / 3, 3)]
    assert float(cb.epsilon()) >= _dp_accounting(parts, pessimistic=False)
    sizes = [len(b) for b in cb.sampler.batch_indices[-3:]] if hasattr(
        cb.sampler, "batch_indices") else None
    assert sizes is None or all(s <= N for s in sizes)
