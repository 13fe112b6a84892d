"""Lightning callbacks for individual GDP: filter (Alg. 1) and per-sample ε tracker."""

import csv
import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_callbacks.gdp_filter import IndividualGDPFilter
from lightning_callbacks.per_sample_epsilon import PerSampleEpsilonTracker
from opacus_structured.accountants.individual_gdp import IndividualGDPAccountant, per_sample_norms
from opacus_structured.accounting.gaussian import gdp_epsilon
from opacus_structured.accounting.individual_gdp import (
    ApproximateIndividualPLDAccountant,
    IndividualGDPFilterState,
    budget_from_steps,
    individual_mu,
)
from opacus_structured.indexed_dataset import IndexedDataset, batch_indices

warnings.filterwarnings("ignore")

N, D, SIGMA, C = 8, 5, 1.0, 2.0


class _Net(pl.LightningModule):
    def __init__(self, lr=0.05, batch_size=N):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(D, 4), nn.ReLU(), nn.Linear(4, 2))
        self.lr, self.batch_size = lr, batch_size

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if not hasattr(self, "_gsm"):  # hooks live on self.net's layers; not a submodule
            object.__setattr__(self, "_gsm", GradSampleModule(self.net))
        return DPOptimizer(torch.optim.SGD(self.net.parameters(), lr=self.lr),
                           noise_multiplier=SIGMA, max_grad_norm=C,
                           expected_batch_size=self.batch_size)


class _Probe(pl.Callback):
    """Records per-sample grads before the filter and the optimizer's clipped sum after."""

    def __init__(self):
        self.norms, self.grads, self.summed = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(per_sample_norms(optimizer.params).clone())
        self.grads.append([p.grad_sample.clone() for p in optimizer.params])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.summed.append([p.summed_grad.clone() for p in opt.params])


def _data():
    g = torch.Generator().manual_seed(1)
    x = 0.05 * torch.randn(N, D, generator=g)
    x[3] = 100.0 * torch.randn(D, generator=g)  # the example with large gradients
    y = torch.randint(0, 2, (N,), generator=g)
    return IndexedDataset(TensorDataset(x, y))


def _trainer(callbacks, steps, tmp_path=None):
    return pl.Trainer(max_steps=steps, callbacks=callbacks, logger=False,
                      enable_checkpointing=tmp_path is not None, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu",
                      default_root_dir=tmp_path, gradient_clip_val=None)


def test_indexed_dataset():
    ds = _data()
    x, y, i = ds[5]
    assert int(i) == 5 and i.dtype == torch.int64
    batch = next(iter(DataLoader(ds, batch_size=4)))
    assert batch_indices(batch).tolist() == [0, 1, 2, 3]
    assert IndexedDataset([10, 11])[1][1].item() == 1
    with pytest.raises(ValueError, match="last batch element"):
        batch_indices((torch.ones(2), torch.ones(2)))
    with pytest.raises(ValueError, match="map-style"):
        IndexedDataset(iter([1]))


def test_filter_drops_exactly_at_budget_and_sum_matches_manual():
    t0, steps = 3, 6
    budget = budget_from_steps(t0, SIGMA)
    probe = _Probe()
    filt = IndividualGDPFilter(N, budget, permanent_drop=True)
    tracker = PerSampleEpsilonTracker(N)
    model = _Net()
    dl = DataLoader(_data(), batch_size=N, shuffle=False)
    _trainer([probe, filt, tracker], steps).fit(model, dl)

    norms = torch.stack(probe.norms).numpy()            # [steps, N], before masking
    assert norms[:, 3].min() > 5 * C                    # always clipped: mu = 1/sigma
    assert norms[:, [0, 1, 2, 4, 5, 6, 7]].max() < 0.8 * C
    # independent numpy reference of Algorithm 1 on the recorded norms
    ref = IndividualGDPFilterState(N, budget, permanent_drop=True)
    ref_active = np.array([ref.step(individual_mu(n, SIGMA, C)) for n in norms])
    assert ref_active[:t0, 3].all() and not ref_active[t0:, 3].any()   # dropped at step T0+1
    assert ref_active[:, [0, 1, 2, 4, 5, 6, 7]].all()
    assert filt.active_counts() == ref_active.sum(1).tolist()
    np.testing.assert_allclose(filt.accountant.observed_mu_sq.numpy(), ref.spent, rtol=1e-6)

    # optimizer's clipped sum == manual sum of the active examples' clipped gradients
    for j in range(steps):
        active = torch.as_tensor(ref_active[j])
        gs = probe.grads[j]
        flat = torch.cat([g.reshape(N, -1) for g in gs], 1)
        factor = (C / (flat.norm(dim=1) + 1e-6)).clamp(max=1.0) * active
        for g, s in zip(gs, probe.summed[j], strict=True):
            manual = torch.einsum("i,i...->...", factor, g)
            torch.testing.assert_close(s, manual, rtol=1e-5, atol=1e-6)

    # tracker after the filter sees zero norms for the dropped example
    mu2 = tracker.mu_squared().numpy()
    np.testing.assert_allclose(mu2, ref.spent, rtol=1e-6)
    assert mu2[3] == pytest.approx(t0 / SIGMA ** 2)
    assert filt.epsilon(1e-5) == pytest.approx(gdp_epsilon(1e-5, budget), abs=1e-9)
    assert tracker.epsilons(1e-5).max() <= filt.epsilon(1e-5)


def test_filter_requires_full_batch():
    filt = IndividualGDPFilter(N, 1.0)
    dl = DataLoader(_data(), batch_size=4)
    with pytest.raises(ValueError, match="full-batch"):
        _trainer([filt], 1).fit(_Net(batch_size=4), dl)


def test_tracker_subsampled_charges_worst_case_and_pld_counts(tmp_path):
    acc = ApproximateIndividualPLDAccountant(SIGMA, 0.5, num_sigmas=5, sigma_max=5.0,
                                             loss_range=3.0, grid_size=2 ** 12)
    tracker = PerSampleEpsilonTracker(N, approximate_pld=acc)
    probe = _Probe()
    model = _Net(batch_size=4)
    dl = DataLoader(_data(), batch_size=4, shuffle=False)   # steps alternate halves
    _trainer([probe, tracker], 4).fit(model, dl)
    norms = torch.stack(probe.norms).double().numpy()       # [4, 4]
    seen = {0: [0, 2], 1: [1, 3]}
    mu2 = tracker.mu_squared().numpy()
    for i in range(N):
        half, pos = divmod(i, 4)
        obs = [min(norms[s, pos], C) ** 2 / (SIGMA * C) ** 2 for s in seen[half]]
        assert mu2[i] == pytest.approx(sum(obs) + 2 / SIGMA ** 2, rel=1e-9)
    k = tracker.approximate_pld_counts().numpy()
    assert (k.sum(1) == 4).all()
    for i in range(N):
        half, pos = divmod(i, 4)
        want = np.zeros(5, int)
        want[0] += 2                                             # unseen: worst bucket
        for s in seen[half]:
            want[acc.bucket(norms[s, pos], C)] += 1
        assert k[i].tolist() == want.tolist()
    r = tracker.approximate_epsilons(1e-5, indices=[0, 3])
    assert r.is_certified is False and r.epsilon_rdp.shape == (2,)

    # exports
    path = tmp_path / "eps.csv"
    tracker.to_csv(path, 1e-5)
    rows = list(csv.reader(open(path)))
    assert len(rows) == N + 1 and float(rows[4][2]) == pytest.approx(tracker.epsilons(1e-5)[3])
    counts, edges = tracker.histogram(1e-5, bins=5)
    assert counts.sum() == N
    tracker.plot_histogram(tmp_path / "h.png", 1e-5)
    assert (tmp_path / "h.png").stat().st_size > 0

    # state round trip
    fresh = PerSampleEpsilonTracker(N, approximate_pld=acc)
    fresh.load_state_dict(tracker.state_dict())
    torch.testing.assert_close(fresh.mu_squared(), tracker.mu_squared())
    assert fresh.approximate_pld_counts().tolist() == k.tolist()


def test_checkpoint_resume_continues_state(tmp_path):
    budget = budget_from_steps(3, SIGMA)
    dl = DataLoader(_data(), batch_size=N)
    full_f, full_t = IndividualGDPFilter(N, budget), PerSampleEpsilonTracker(N)
    # lr = 0: gradients do not depend on the (unrestored) noise RNG, so runs are comparable
    _trainer([full_f, full_t], 5).fit(_Net(lr=0.0), dl)

    f1, t1 = IndividualGDPFilter(N, budget), PerSampleEpsilonTracker(N)
    tr = _trainer([f1, t1], 2, tmp_path)
    tr.fit(_Net(lr=0.0), dl)
    ckpt = tmp_path / "c.ckpt"
    tr.save_checkpoint(ckpt)
    f2, t2 = IndividualGDPFilter(N, budget), PerSampleEpsilonTracker(N)
    _trainer([f2, t2], 5, tmp_path).fit(_Net(lr=0.0), dl, ckpt_path=str(ckpt))
    assert t2.steps == 5 and f2.accountant.recorded_steps == 5
    torch.testing.assert_close(t2.mu_squared(), full_t.mu_squared(), rtol=1e-5, atol=1e-9)
    assert f2.active_counts() == full_f.active_counts()


def test_accountant_state_and_registry():
    from opacus.accountants.registry import create_accountant

    import opacus_structured.accountants  # noqa: F401 (registers)

    acc = create_accountant("individual-gdp")
    assert isinstance(acc, IndividualGDPAccountant)
    acc.step(noise_multiplier=2.0, sample_rate=1.0)
    acc.step(noise_multiplier=2.0, sample_rate=1.0)
    assert len(acc) == 2
    assert acc.get_epsilon(1e-5) == pytest.approx(gdp_epsilon(1e-5, math.sqrt(2) / 2))
    with pytest.raises(ValueError, match="allocate"):
        acc.record(torch.tensor([0]), torch.tensor([0.1]), 2.0)
    acc.allocate(3)
    acc.record_norms(torch.tensor([0, 2]), torch.tensor([0.5, 7.0]), 2.0, 1.0)
    acc.record_norms(torch.tensor([0, 1, 2]), torch.tensor([0.5, 0.0, 0.1]), 2.0, 1.0)
    torch.testing.assert_close(acc.individual_mu_squared(),
                               torch.tensor([0.125, 0.25, 0.2525], dtype=torch.float64))
    fresh = IndividualGDPAccountant()
    fresh.load_state_dict(acc.state_dict())
    torch.testing.assert_close(fresh.individual_mu_squared(), acc.individual_mu_squared())
    assert fresh.history == acc.history
    np.testing.assert_allclose(fresh.individual_epsilons(1e-5),
                               [gdp_epsilon(1e-5, math.sqrt(v)) for v in (0.125, 0.25, 0.2525)],
                               atol=1e-8)
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.record_norms(torch.tensor([0]), torch.tensor([1.0]), 0.0, 1.0)
    with pytest.raises(ValueError, match="budget"):
        IndividualGDPFilter(3, -1.0)


def test_individual_gdp_accountant_says_it_does_not_amplify():
    # Issue 22: under Poisson sampling (hook rate < 1) "individual-gdp" gives the full-batch
    # worst case; it warns once and records it in its state.
    acc = IndividualGDPAccountant()
    acc.step(noise_multiplier=2.0, sample_rate=1.0)
    assert acc.amplification is None and acc.state_dict()["amplification"] is None
    with pytest.warns(UserWarning, match=r"does not use subsampling amplification.*'poisson'"):
        acc.step(noise_multiplier=2.0, sample_rate=0.125)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.step(noise_multiplier=2.0, sample_rate=0.25)  # once per accountant
    assert acc.amplification == "not used (sample_rate=0.125 < 1)"
    assert acc.get_epsilon(1e-5) == pytest.approx(gdp_epsilon(1e-5, math.sqrt(3) / 2.0))
    fresh = IndividualGDPAccountant()
    fresh.load_state_dict(acc.state_dict())
    assert fresh.amplification == acc.amplification and fresh.history == acc.history


def test_individual_gdp_warns_through_a_stock_privacy_engine():
    from opacus import PrivacyEngine

    model = nn.Linear(3, 1)
    ds = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    engine = PrivacyEngine(accountant="individual-gdp")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=True, noise_generator=torch.Generator().manual_seed(0))
    x, y = ds.tensors
    with pytest.warns(UserWarning, match="individual-gdp does not use subsampling"):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert engine.accountant.amplification == "not used (sample_rate=0.25 < 1)"


@pytest.mark.cuda
def test_tracker_and_filter_on_cuda():
    dev = torch.device("cuda")
    n = 1_000_000
    tracker = PerSampleEpsilonTracker(n)
    filt = IndividualGDPFilter(n, budget_from_steps(2, 1.0), require_full_batch=False)
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randperm(n, device=dev, generator=g)[:4096]
    w = torch.zeros(10, device=dev)
    for _ in range(3):
        w.grad_sample = torch.randn(len(idx), 10, device=dev, generator=g)
        norms = per_sample_norms([w])
        active = filt.mask_and_record([w], idx, norms, 1.0, 1.0)
        assert active.device.type == "cuda"
        tracker.update(idx, per_sample_norms([w]), 1.0, 1.0)
    assert tracker.mu_squared().device.type == "cuda"
    sq = filt.accountant.observed_mu_sq[idx].cpu().numpy()
    assert (sq <= 2.0 * (1 + 1e-12)).all()
    np.testing.assert_allclose(tracker.mu_squared()[idx].cpu().numpy(), sq, rtol=1e-12)


@pytest.mark.parametrize("permanent_drop", [False, True])
def test_filter_in_ghost_mode_equals_hooks_mode(permanent_drop):
    # Ghost clipping never materialises per-sample gradients: the filter decides between the
    # two backward passes from the first pass's norms and masks the clipping coefficients.
    # Oracle: the hooks-mode filter (zeroed grad_sample rows) on the same data and noise.
    from opacus import PrivacyEngine

    g = torch.Generator().manual_seed(0)
    n = 16
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    x[3] *= 40.0  # large gradients: dropped early
    y = torch.randn(n, generator=g, dtype=torch.float64)  # 1-d: Opacus' ghost loss wrapper
    # broadcasts coef (B,) against a (B, 1) per-sample loss into (B, B), silently
    idx = torch.arange(n)
    sigma, clip, steps = 2.0, 1.0, 6

    def run(mode):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1), nn.Flatten(0)).double()
        loader = DataLoader(TensorDataset(x, y), batch_size=n)
        engine = PrivacyEngine()
        kw = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  data_loader=loader, noise_multiplier=sigma, max_grad_norm=clip,
                  poisson_sampling=False, grad_sample_mode=mode,
                  noise_generator=torch.Generator().manual_seed(7))
        filt = IndividualGDPFilter(n, budget=1.2, permanent_drop=permanent_drop)
        if mode == "ghost":
            model, opt, crit, _ = engine.make_private(criterion=nn.MSELoss(), **kw)
            filt.attach_ghost(model, opt)
        else:
            model, opt, _ = engine.make_private(**kw)
            crit = nn.MSELoss()
        for _ in range(steps):
            opt.zero_grad()
            filt.set_batch_indices(idx)
            crit(model(x), y).backward()
            if mode == "hooks":
                params = [p for p in model.parameters() if p.requires_grad]
                filt.mask_and_record(params, idx, per_sample_norms(params), sigma, clip)
            opt.step()
        return filt, [p.detach().clone() for p in model.parameters()], (model, crit)

    f_h, p_h, _ = run("hooks")
    f_g, p_g, (ghost_model, ghost_crit) = run("ghost")
    assert f_h.active_counts() == f_g.active_counts()
    assert min(f_h.active_counts()) < n  # the filter did drop someone
    torch.testing.assert_close(f_g.accountant.observed_mu_sq, f_h.accountant.observed_mu_sq,
                               rtol=1e-9, atol=1e-12)
    for a, b in zip(p_g, p_h, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="set_batch_indices"):  # indices are per backward
        ghost_crit(ghost_model(x), y).backward()


def test_index_fn_reads_indexed_dataset_batches_and_recorder_agrees():
    # IndexedDataset (indices as the last batch element) still works with
    # index_fn=batch_indices; without index_fn the recorded sampler indices are used. Shuffled
    # full batches: the row order differs from 0..N-1, so a wrong mapping would show.
    class IdxProbe(_Probe):
        def __init__(self):
            super().__init__()
            self.idx = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.idx.append(batch_indices(batch).clone())

    states = []
    for index_fn in (batch_indices, None):
        probe = IdxProbe()
        tracker = PerSampleEpsilonTracker(N, index_fn=index_fn)
        torch.manual_seed(3)
        dl = DataLoader(_data(), batch_size=N, shuffle=True)
        _trainer([probe, tracker], 3).fit(_Net(), dl)
        assert any(i.tolist() != list(range(N)) for i in probe.idx)
        want = np.zeros(N)
        for idx, n in zip(probe.idx, probe.norms, strict=True):
            want[idx.numpy()] += np.minimum(n.double().numpy(), C) ** 2 / (SIGMA * C) ** 2
        np.testing.assert_allclose(tracker.mu_squared().numpy(), want, rtol=1e-9)
        states.append(tracker.mu_squared())
    torch.testing.assert_close(states[0], states[1])
