"""Never a replayed noise (issue 46, item 1): no noise value is added to two releases.

Each test spies on Opacus' ``_generate_noise`` (every noise tensor any optimizer draws) and
checks the tensors themselves: a replay is two draws of identical tensors, whatever the
library's bookkeeping says. The Lightning shapes (an earlier checkpoint, a resume in the same
process) are in ``tests/test_dp_callback.py``; repro 17 in ``shared/repro/ecosystem``.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from _training import train, xy_dataset
from lightning_small import fit, small_module
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader

import opacus_structured
from opacus_structured.accountants import noise_lineage
from opacus_structured.accountants.noise_lineage import (
    FreshNoiseWarning,
    NoiseLineage,
    NoiseReplayError,
)
from opacus_structured.optim import CorrelatedNoisePrivacyEngine
from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
from opacus_structured.samplers._generator import fresh_seed

warnings.filterwarnings("ignore", message="Secure RNG turned off")

N, BATCH, SIGMA = 40, 8, 1.0


@pytest.fixture
def drawn(monkeypatch):
    """Every noise tensor drawn, in order."""
    import opacus.optimizers.optimizer as opacus_optimizer

    import opacus_structured.optim.correlated_noise as correlated

    tensors = []
    plain = opacus_optimizer._generate_noise

    def spy(std, reference, *args, **kwargs):
        z = plain(std, reference, *args, **kwargs)
        if std:
            tensors.append(z.detach().clone())
        return z

    monkeypatch.setattr(opacus_optimizer, "_generate_noise", spy)
    monkeypatch.setattr(correlated, "_generate_noise", spy)
    return tensors


def _replays(tensors):
    return [(i, j) for i in range(len(tensors)) for j in range(i)
            if tensors[i].shape == tensors[j].shape and torch.equal(tensors[i], tensors[j])]


def _data():
    return xy_dataset(N, 3)


def _run(*, seed=0, engine_cls=PrivacyEngine, accountant="poisson", **kw):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = engine_cls(accountant=accountant)
    model, optimizer, loader = opacus_structured.make_private(
        engine, module=model, optimizer=optimizer, data_loader=DataLoader(_data(), BATCH),
        noise_multiplier=SIGMA, max_grad_norm=1.0, dataset_size=N,
        noise_generator=torch.Generator().manual_seed(seed if seed is not None
                                                      else fresh_seed()),
        sampler_generator=torch.Generator().manual_seed(0 if seed is None else seed + 1), **kw)
    return engine, model, optimizer, loader


def _train(model, optimizer, loader, steps):
    train(model, optimizer, loader, steps=steps)


# ---- the lineage itself ---------------------------------------------------------------------
def test_lineage_state_is_json_and_round_trips():
    lineage = NoiseLineage()
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        lineage.record(noise_lineage.state_digest(g))
        torch.randn(4, generator=g)
    state = json.loads(json.dumps(lineage.state_dict()))
    back = NoiseLineage()
    back.load_state_dict(state)
    assert back.lineage == lineage.lineage and back.position == 3
    assert back.seen(noise_lineage.state_digest(torch.Generator().manual_seed(3)))
    assert not back.seen(noise_lineage.state_digest(g))
    with pytest.raises(ValueError, match="not a multiple"):
        NoiseLineage().load_state_dict({"lineage": "x", "position": 1, "digests": "AAAA"})
    with pytest.raises(ValueError, match="base64"):
        NoiseLineage().load_state_dict({"lineage": "x", "position": 1, "digests": "@@"})


def test_may_restore_only_the_last_position_of_a_lineage_drawn_here():
    lineage = NoiseLineage()
    assert not noise_lineage.may_restore(lineage.tag())  # never drawn here
    lineage.record(None)
    lineage.record(None)
    assert noise_lineage.may_restore(lineage.tag())
    assert noise_lineage.rewinds({"lineage": lineage.lineage, "position": 1})
    assert not noise_lineage.may_restore({"lineage": lineage.lineage, "position": 1})
    assert not noise_lineage.may_restore(None)


# ---- Opacus' make_private path --------------------------------------------------------------
def test_opacus_checkpoint_resumed_with_the_runs_seed_draws_fresh_noise(tmp_path, drawn):
    """A new script run (new engine, the same noise seed) loads the step-3 checkpoint: the
    seeded generator would replay the first run's noise from its start on other batches."""
    engine, model, optimizer, loader = _run(seed=0)
    _train(model, optimizer, loader, 3)
    path = os.path.join(tmp_path, "ckpt.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    first = len(drawn)
    engine2, model2, optimizer2, loader2 = _run(seed=0)
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    with pytest.warns(FreshNoiseWarning, match="already added"):
        _train(model2, optimizer2, loader2, 3)
    assert len(drawn) == 2 * first
    assert _replays(drawn) == []
    assert len(engine2.accountant) == 6


def test_a_generator_rewound_by_hand_is_reseeded(drawn):
    engine, model, optimizer, loader = _run(seed=0)
    saved = optimizer.generator.get_state()
    _train(model, optimizer, loader, 2)
    optimizer.generator.set_state(saved)  # e.g. a user checkpoint of the RNG, loaded back
    with pytest.warns(FreshNoiseWarning):
        _train(model, optimizer, loader, 2)
    assert _replays(drawn) == []


def test_torchs_global_rng_reseeded_in_a_new_run_is_not_replayed(tmp_path, drawn):
    """Stock Opacus draws from torch's global RNG when no noise generator is given; a resumed
    script seeds it again with the same constant."""
    def stock():
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        engine = PrivacyEngine(accountant="poisson")
        model, optimizer, loader = opacus_structured.make_private(
            engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(_data(), BATCH), noise_multiplier=SIGMA, max_grad_norm=1.0,
            dataset_size=N, sampler_generator=torch.Generator().manual_seed(1))
        assert optimizer.generator is None
        return engine, model, optimizer, loader

    engine, model, optimizer, loader = stock()
    _train(model, optimizer, loader, 3)
    path = os.path.join(tmp_path, "ckpt.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    engine2, model2, optimizer2, loader2 = stock()
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    with pytest.warns(FreshNoiseWarning):
        _train(model2, optimizer2, loader2, 3)
    assert isinstance(optimizer2.generator, torch.Generator)  # its own now; the global is left
    assert _replays(drawn) == []


def test_secure_mode_and_zero_noise_are_not_false_alarms(drawn):
    engine, model, optimizer, loader = _run(seed=0)
    optimizer.noise_multiplier = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", FreshNoiseWarning)
        warnings.simplefilter("ignore", UserWarning)
        _train(model, optimizer, loader, 3)  # the generator never moves: nothing recorded
        optimizer.noise_multiplier = SIGMA
        _train(model, optimizer, loader, 2)
    assert len(drawn) == 4 and _replays(drawn) == []


# ---- correlated noise -----------------------------------------------------------------------
def _correlated_run(seed=0):
    return _run(seed=seed, engine_cls=CorrelatedNoisePrivacyEngine,
                accountant="bandmf-cyclic-poisson", bands=2, epochs=3)


def test_correlated_state_of_an_earlier_step_is_refused(tmp_path):
    engine, model, optimizer, loader = _correlated_run()
    assert isinstance(optimizer, CorrelatedNoiseDPOptimizer)
    _train(model, optimizer, loader, 2)
    early = optimizer.state_dict()
    _train(model, optimizer, loader, 2)
    with pytest.raises(NoiseReplayError, match="correlated"):
        optimizer.load_state_dict(early)


def test_correlated_checkpoint_of_the_last_step_resumes_exactly(tmp_path, drawn):
    engine, model, optimizer, loader = _correlated_run()
    _train(model, optimizer, loader, 4)
    reference = [t.clone() for t in drawn[-4:]]  # steps 3 and 4, two tensors each
    engine, model, optimizer, loader = _correlated_run()
    _train(model, optimizer, loader, 2)
    path = os.path.join(tmp_path, "ckpt.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    engine2, model2, optimizer2, loader2 = _correlated_run(seed=5)
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    assert optimizer2.noise_step == 2
    del drawn[:]
    _train(model2, optimizer2, loader2, 2)
    assert all(torch.equal(a, b) for a, b in zip(reference, drawn[-4:], strict=True))


def test_correlated_checkpoint_in_a_new_process_keeps_buffers_and_draws_fresh_noise(tmp_path):
    engine, model, optimizer, loader = _correlated_run()
    _train(model, optimizer, loader, 2)
    path = os.path.join(tmp_path, "ckpt.pt")
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer)
    buffers = [b.clone() for b in optimizer.noise_state_dict()["buffers"]]
    generator_state = optimizer.generator.get_state()
    noise_lineage._DRAWN.clear()  # what a new process knows
    engine2, model2, optimizer2, loader2 = _correlated_run()
    engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2)
    assert optimizer2.noise_step == 2
    assert all(torch.equal(a, b) for a, b in zip(
        buffers, optimizer2.noise_state_dict()["buffers"], strict=True))
    assert not torch.equal(optimizer2.generator.get_state(), generator_state)
    _train(model2, optimizer2, loader2, 2)
    assert len(engine2.accountant) == 4


def test_a_stand_alone_correlated_optimizer_resumes_only_its_last_state():
    def make(seed):
        params = [nn.Parameter(torch.zeros(3))]
        return CorrelatedNoiseDPOptimizer(
            torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
            expected_batch_size=1, generator=torch.Generator().manual_seed(seed),
            noise_correlation=[1.0, 0.5])

    def step(opt):
        opt.zero_grad()
        for p in opt.params:
            p.grad_sample = torch.zeros(1, *p.shape)
        opt.step()

    opt = make(0)
    step(opt)
    state = opt.state_dict()
    resumed = make(1)
    resumed.load_state_dict(state)  # the last state of its stream: restored
    assert torch.equal(resumed.generator.get_state(), opt.generator.get_state())
    step(opt)  # the stream went on: its step-1 state is now behind it
    with pytest.raises(NoiseReplayError):
        make(2).load_state_dict(state)


# ---- Lightning: a new process, a later fit of the same callback ------------------------------
def _lightning_fit(cb, model, max_steps, tmp_path=None, ckpt_path=None, every=None):
    fit(cb, model, DataLoader(_data(), batch_size=BATCH), max_steps, dirpath=tmp_path,
        every=every, ckpt_path=ckpt_path)


def _module():
    return small_module()


def _callback(**kw):
    from lightning_callbacks import DPCallback
    from opacus_structured.schemes.poisson import PoissonScheme

    args = dict(delta=1e-5, noise_multiplier=SIGMA, max_grad_norm=1.0, discretization=1e-3,
                scheme=PoissonScheme(sample_rate=BATCH / N), dataset_size=N, seed=3)
    args.update(kw)
    return DPCallback(**args)


def test_lightning_resume_in_a_new_process_draws_fresh_noise_without_a_warning(tmp_path, drawn):
    cb = _callback()
    _lightning_fit(cb, _module(), 4, tmp_path, every=4)
    first = len(drawn)
    noise_lineage._DRAWN.clear()  # a new process: whether the run went on is unknown
    resumed = _callback()  # the same seed, as a re-run script would
    with warnings.catch_warnings():
        warnings.simplefilter("error", FreshNoiseWarning)
        _lightning_fit(resumed, _module(), 8, ckpt_path=os.path.join(tmp_path, "step=4.ckpt"))
    assert len(drawn) == 2 * first and _replays(drawn) == []
    assert resumed.steps == 8
    lineage = resumed.accountant._ledger.noise
    assert lineage.position == 8 and lineage.lineage != cb.accountant._ledger.noise.lineage


def test_a_later_fit_of_the_same_callback_continues_the_correlated_stream(monkeypatch):
    from opacus_structured.schemes.poisson import PoissonScheme

    # plumbing only (as in test_dp_callback): Poisson is made to claim it prices c = [1, .5]
    monkeypatch.setattr(PoissonScheme, "prices_correlated_noise", True)
    kw = dict(optimizer_class=CorrelatedNoiseDPOptimizer,
              optimizer_kwargs={"noise_correlation": [1.0, 0.5]})
    cb = _callback(**kw)
    model = _module()
    _lightning_fit(cb, model, 3)
    first = cb.optimizer
    _lightning_fit(cb, model, 3)  # a new fit: a new DP optimizer, the same run
    assert cb.optimizer is not first and cb.optimizer.noise_step == 6 == cb.steps


def test_private_selection_resumed_from_its_checkpoint_draws_no_noise_twice(tmp_path, drawn):
    from opacus_structured.tuning import PrivateSelection

    def train_and_score(lr):  # each trial a fresh run (noise from OS entropy)
        engine, model, optimizer, loader = _run(seed=None)
        _train(model, optimizer, loader, 2)
        return -lr, engine.accountant

    path = os.path.join(tmp_path, "search.pkl")

    def search():
        return PrivateSelection([0.1, 0.2], train_and_score, mean_trials=3, eta=1.0,
                                delta=1e-5, checkpoint=path, progress=False)

    first = search()
    first._k = max(first._k, 2)  # at least one trial before and one after the "crash"
    first._run_one()
    resumed = search()  # reads the checkpoint: K and the first trial's result
    assert resumed.trials_done == 1
    resumed.run()
    assert _replays(drawn) == []


def test_a_dataset_budget_journal_proves_a_resume_in_a_new_process(tmp_path, drawn):
    """With the run's DatasetBudget, a new process can prove that a checkpoint is where the
    run's draws ended (the journal's last lease / settle): that resume is bit-identical; an
    earlier checkpoint of the same run is not (fresh noise)."""
    from opacus_structured import DatasetBudget

    budget = DatasetBudget(os.path.join(tmp_path, "panel.budget"), epsilon=50.0, delta=1e-5)
    uninterrupted = _callback(budget=budget)
    _lightning_fit(uninterrupted, _module(), 8)
    reference = drawn[-8:]  # steps 5-8: two tensors each
    cb = _callback(budget=budget)
    _lightning_fit(cb, _module(), 4, tmp_path, every=2)
    noise_lineage._DRAWN.clear()  # a new process
    del drawn[:]
    resumed = _callback(budget=budget)
    _lightning_fit(resumed, _module(), 8, ckpt_path=os.path.join(tmp_path, "step=4.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(reference, drawn, strict=True))
    noise_lineage._DRAWN.clear()
    del drawn[:]
    early = _callback(budget=budget)
    _lightning_fit(early, _module(), 6, ckpt_path=os.path.join(tmp_path, "step=2.ckpt"))
    assert not any(torch.equal(a, b) for a in drawn for b in reference)


def test_the_state_digest_tells_every_draw_apart():
    """Every state a generator passes through while drawing noise (full twists and Box-Muller's
    cached second sample alike) has its own digest, and equal states share theirs."""
    g = torch.Generator().manual_seed(11)
    seen = set()
    for size in [1, 1, 1, 3, 700, 1, 2, 5000, 1] * 30:
        digest = noise_lineage.state_digest(g)
        assert digest not in seen
        seen.add(digest)
        torch.randn(size, generator=g)
    assert noise_lineage.state_digest(torch.Generator().manual_seed(11)) in seen
