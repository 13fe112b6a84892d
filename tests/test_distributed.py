"""Multi-process (DDP) sampling, correlated noise and callbacks (issue 9).

Cheap checks simulate the ranks in one process (``num_replicas``/``rank`` given explicitly);
one test spawns 2 gloo CPU processes with ``torch.multiprocessing`` and checks, against a
single-process reference computed here: (a) the union of the rank shards is the single-process
batch for every sampler type, even when the ranks were seeded differently (state broadcast from
rank 0); (b) final parameters of a tiny model trained with DPDDP + ``DistributedDPOptimizer``
(plain and correlated noise) equal the single-process ``DPOptimizer`` run to 1e-6; (c) the
per-sample ε tracker's gathered state equals the single-process tracker's, the GDP filter's
decisions equal the single-process filter's, and sampler / noise state round-trips.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from opacus.data_loader import wrap_collate_with_empty
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from opacus_structured.samplers.balls_in_bins import BallsInBinsBatchSampler
from opacus_structured.samplers.bminsep import BMinSepBatchSampler, WarmStartBMinSepBatchSampler
from opacus_structured.samplers.cyclic_poisson import CyclicPoissonBatchSampler
from opacus_structured.samplers.distributed import DistributedBatchSampler, shard
from opacus_structured.samplers.multi_attribution import MultiAttributionBMinSepBatchSampler
from opacus_structured.samplers.poisson import PoissonBatchSampler
from opacus_structured.samplers.truncated_poisson import TruncatedPoissonSampler
from opacus_structured.schemes.structured import StructuredScheme

WORLD = 2

# ---- sampler zoo (tiny, so empty shards happen) ------------------------------------------
SAMPLERS = {
    "poisson": lambda seed: PoissonBatchSampler(20, 0.1, steps=12, seed=seed),
    "truncated_poisson": lambda seed: TruncatedPoissonSampler(20, 0.2, 3, steps=8, seed=seed),
    "truncated_poisson_unpadded": lambda seed: TruncatedPoissonSampler(
        20, 0.2, 3, steps=8, seed=seed, pad=False),
    "structured": lambda seed: StructuredScheme(
        num_series=8, series_length=10, context_length=2, forecast_length=1, batch_size=4,
        top_level="shuffle", bottom_level="poisson").sampler(seed=seed),
    "cyclic_poisson": lambda seed: CyclicPoissonBatchSampler(20, 2.0, 3, steps=9, seed=seed),
    "balls_in_bins": lambda seed: BallsInBinsBatchSampler(20, 5, epochs=2, seed=seed),
    "bminsep": lambda seed: BMinSepBatchSampler(20, 0.15, 2, steps=8, seed=seed),
    "bminsep_warm": lambda seed: WarmStartBMinSepBatchSampler.from_expected_batch_size(
        20, 2.0, 3, steps=8, seed=seed),
    "multi_attribution": lambda seed: MultiAttributionBMinSepBatchSampler(
        [[i % 7] for i in range(20)], 0.2, 2, max_user_examples=3, burn_in=2, steps=8,
        seed=seed),
}
EPOCHS = 2


def _global_batches(sampler, epochs=EPOCHS):
    return [list(b) for _ in range(epochs) for b in sampler]


def _sorted(batch):
    return sorted(batch, key=repr)


# ---- single-process simulation of the ranks ------------------------------------------------
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_union_of_shards_is_the_global_batch(name):
    reference = _global_batches(SAMPLERS[name](7))
    ranks = [DistributedBatchSampler(SAMPLERS[name](7), num_replicas=3, rank=r)
             for r in range(3)]
    assert all(len(r) == len(SAMPLERS[name](7)) for r in ranks)
    per_rank = [_global_batches(r) for r in ranks]
    for step, batch in enumerate(reference):
        shards = [per_rank[r][step] for r in range(3)]
        assert _sorted(sum(shards, [])) == _sorted(batch)
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1
    assert any(len(per_rank[2][s]) == 0 for s in range(len(reference))) or name in (
        "truncated_poisson", "structured", "balls_in_bins", "multi_attribution")


def test_shard_rule_and_fixed_shape_padding():
    assert shard([5, 6, 7, 8, 9], 2, 0) == [5, 7, 9] and shard([5, 6, 7, 8, 9], 2, 1) == [6, 8]
    assert shard([], 2, 1) == [] and shard([3], 2, 1) == []
    s = DistributedBatchSampler(TruncatedPoissonSampler(20, 0.2, 3, seed=1), num_replicas=2,
                                rank=1)
    assert all(len(b) == 1 for b in s)  # slots 1 of 3: fixed shape per rank
    assert s.padding_index == 20 and s.scheme == s.inner.scheme


def test_delegation_and_local_expected_batch_size():
    inner = PoissonBatchSampler(40, 0.1, seed=0)
    s = DistributedBatchSampler(inner, num_replicas=4, rank=3)
    assert s.scheme is inner.scheme and s.sample_rate == 0.1 and len(s) == len(inner)
    assert s.expected_batch_size == pytest.approx(4.0)
    assert s.local_expected_batch_size == pytest.approx(1.0)
    assert s.scheme.expected_sample_rate() == inner.scheme.expected_sample_rate()
    cyclic = DistributedBatchSampler(CyclicPoissonBatchSampler(20, 4.0, 2, seed=0),
                                     num_replicas=2, rank=0)
    assert cyclic.local_expected_batch_size == pytest.approx(2.0)
    with pytest.raises(ValueError, match="expected_batch_size"):
        _ = DistributedBatchSampler(BallsInBinsBatchSampler(20, 5, seed=0), num_replicas=2,
                                rank=0).local_expected_batch_size


def test_bad_arguments():
    inner = PoissonBatchSampler(10, 0.5, seed=0)
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedBatchSampler(inner, rank=0)
    with pytest.raises(ValueError, match="rank"):
        DistributedBatchSampler(inner, num_replicas=2)
    with pytest.raises(ValueError, match="rank"):
        DistributedBatchSampler(inner, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedBatchSampler(inner, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match="already"):
        DistributedBatchSampler(DistributedBatchSampler(inner, num_replicas=2, rank=0),
                                num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="batch_sampler"):
        DistributedBatchSampler(3, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="state_dict"):
        DistributedBatchSampler([[0], [1]], num_replicas=2, rank=0, sync_state=True)


@pytest.mark.parametrize("name", ["poisson", "structured", "cyclic_poisson", "bminsep"])
def test_state_dict_round_trip_mid_epoch_and_across_world_sizes(name):
    full = _global_batches(SAMPLERS[name](3), epochs=1)
    k = len(full) // 2
    s = DistributedBatchSampler(SAMPLERS[name](3), num_replicas=2, rank=1)
    it = iter(s)
    for _ in range(k):
        next(it)
    state = s.state_dict()
    # the checkpoint is the global stream's: resume with another world size or one process
    resumed = DistributedBatchSampler(SAMPLERS[name](99), num_replicas=3, rank=0)
    resumed.load_state_dict(state)
    assert list(resumed) == [shard(b, 3, 0) for b in full[k:]]
    single = SAMPLERS[name](98)
    single.load_state_dict(state)
    assert [list(b) for b in single] == full[k:]


def test_empty_shard_collates_with_primed_empty_wrapper():
    from opacus_structured.samplers.distributed import distributed_data_loader

    ds = TensorDataset(torch.arange(20.0).view(10, 2), torch.arange(10))
    s = DistributedBatchSampler(PoissonBatchSampler(10, 0.1, steps=30, seed=2), num_replicas=2,
                                rank=1)
    loader = distributed_data_loader(ds, s)
    shapes = [tuple(x.shape) for x, _ in loader]
    assert (0, 2) in shapes and len(shapes) == 30   # first batch may be empty: still typed
    plain = DataLoader(ds, batch_sampler=s, collate_fn=wrap_collate_with_empty(
        collate_fn=default_collate))
    assert len(list(plain)) == 30


# ---- two real processes --------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


N, D, STEPS, Q, SIGMA, CLIP, LR = 12, 3, 6, 0.25, 0.7, 1.0, 0.5
COEFS = [1.0, 0.5, 0.25]


def _data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(N, D, generator=g), torch.randn(N, 1, generator=g)


def _model():
    torch.manual_seed(5)
    return torch.nn.Linear(D, 1)


def _train(rank, world, noise_correlation, *, distributed, device="cpu", ghost=False):
    """A few DP-SGD steps; returns final parameters, noise state, sampler state. ``ghost``:
    book-keeping hooks and the fast-gradient-clipping optimizers instead of per-sample
    gradients."""
    from opacus import GradSampleModule
    from opacus.optimizers import DistributedDPOptimizer, DPOptimizer

    from opacus_structured.optim.correlated_noise import CorrelatedNoiseDPOptimizer
    from opacus_structured.optim.distributed import DistributedCorrelatedNoiseDPOptimizer

    X, Y = (t.to(device) for t in _data())
    model = _model().to(device)
    if distributed:
        from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
        model = DPDDP(model)
    if ghost:
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.optimizers.ddpoptimizer_fast_gradient_clipping import (
            DistributedDPOptimizerFastGradientClipping,
        )

        from opacus_structured.optim.bookkeeping import (
            BookKeepingHooks,
            bookkeeping_optimizer_class,
        )
        from opacus_structured.optim.distributed import (
            DistributedCorrelatedNoiseDPOptimizerFastGradientClipping,
        )
        from opacus_structured.optim.ghost_clipping import (
            CorrelatedNoiseDPOptimizerFastGradientClipping,
        )

        gsm = model
        hooks = BookKeepingHooks(model, max_grad_norm=CLIP)
    else:
        gsm = GradSampleModule(model, loss_reduction="mean")
    base = torch.optim.SGD(gsm.parameters(), lr=LR)
    global_sampler = PoissonBatchSampler(N, Q, steps=STEPS, seed=123 + 1000 * rank)
    expected = N * Q
    kwargs = dict(noise_multiplier=SIGMA, max_grad_norm=CLIP, loss_reduction="mean",
                  generator=torch.Generator(device=device).manual_seed(77 + 1000 * rank))
    if distributed:
        sampler = DistributedBatchSampler(global_sampler)  # broadcasts rank 0's state
        kwargs["expected_batch_size"] = sampler.local_expected_batch_size
        if noise_correlation is None:
            opt = DistributedDPOptimizer(base, **kwargs)
        else:
            opt = DistributedCorrelatedNoiseDPOptimizer(base, noise_correlation=noise_correlation,
                                                        **kwargs)
    else:
        sampler = global_sampler
        kwargs["expected_batch_size"] = expected
        opt = (DPOptimizer(base, **kwargs) if noise_correlation is None else
               CorrelatedNoiseDPOptimizer(base, noise_correlation=noise_correlation, **kwargs))
    if ghost:
        cls = {(False, False): DPOptimizerFastGradientClipping,
               (False, True): CorrelatedNoiseDPOptimizerFastGradientClipping,
               (True, False): DistributedDPOptimizerFastGradientClipping,
               (True, True): DistributedCorrelatedNoiseDPOptimizerFastGradientClipping}[
            (distributed, noise_correlation is not None)]
        extra = {} if noise_correlation is None else {"noise_correlation": noise_correlation}
        opt = bookkeeping_optimizer_class(cls)(base, **kwargs, **extra)
        opt.attach_bookkeeper(hooks)
    sizes = []
    for batch in sampler:
        idx = torch.as_tensor(batch, dtype=torch.int64)
        sizes.append(len(batch))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(gsm(X[idx]), Y[idx])
        loss.backward()
        opt.step()
    params = [p.detach().cpu().clone() for p in _model_params(gsm)]
    noise = opt.noise_state_dict() if hasattr(opt, "noise_state_dict") else None
    return {"params": params, "noise": noise, "sampler": sampler.state_dict(), "sizes": sizes}


def _model_params(gsm):
    return list(gsm.parameters())


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        # (a) samplers seeded differently per rank: rank 0's state is broadcast
        result["batches"] = {name: _global_batches(DistributedBatchSampler(make(7 + rank)))
                             for name, make in SAMPLERS.items()}
        # (b) training, plain and correlated noise
        result["plain"] = _train(rank, world, None, distributed=True)
        result["correlated"] = _train(rank, world, COEFS, distributed=True)
        result["correlated_ghost"] = _train(rank, world, COEFS, distributed=True, ghost=True)
        # (c) callbacks' distributed state
        result["callbacks"] = _callback_states(rank, world)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _callback_states(rank, world):
    """Tracker and filter fed with each rank's shard of the same global batches."""
    from lightning_callbacks.gdp_filter import IndividualGDPFilter
    from lightning_callbacks.per_sample_epsilon import PerSampleEpsilonTracker

    tracker = PerSampleEpsilonTracker(N)
    filt = IndividualGDPFilter(N, budget=1.6, require_full_batch=False)
    g = torch.Generator().manual_seed(4)
    masks = []
    for step in range(5):
        batch = torch.randperm(N, generator=g)[: 7 + step]   # global batch of this step
        norms_all = torch.rand(N, generator=g, dtype=torch.float64) * 2.0
        idx = torch.as_tensor(shard(batch.tolist(), world, rank), dtype=torch.int64)
        norms = norms_all[idx]
        tracker.update(idx, norms, SIGMA, CLIP)
        gs = torch.ones(len(idx), 2)
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad_sample = gs
        active = filt.mask_and_record([p], idx, norms, SIGMA, CLIP)
        masks.append((idx, active.clone(), gs.clone()))
    gathered = tracker.gather()
    return {"gathered_mu_sq": gathered, "local_mu_sq": tracker.mu_squared().clone(),
            "filter_state": filt.state_dict(), "active_counts": filt.active_counts(),
            "masks": masks}


def _reference_callback_states():
    from lightning_callbacks.gdp_filter import IndividualGDPFilter
    from lightning_callbacks.per_sample_epsilon import PerSampleEpsilonTracker

    tracker = PerSampleEpsilonTracker(N)
    filt = IndividualGDPFilter(N, budget=1.6, require_full_batch=False)
    g = torch.Generator().manual_seed(4)
    decisions = []
    for step in range(5):
        batch = torch.randperm(N, generator=g)[: 7 + step]
        norms = (torch.rand(N, generator=g, dtype=torch.float64) * 2.0)[batch]
        tracker.update(batch, norms, SIGMA, CLIP)
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad_sample = torch.ones(len(batch), 2)
        active = filt.mask_and_record([p], batch, norms, SIGMA, CLIP)
        decisions.append(dict(zip(batch.tolist(), active.tolist(), strict=True)))
    return tracker, filt, decisions


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.slow
def test_two_processes_union_equals_single_process_batch(two_ranks, name):
    reference = _global_batches(SAMPLERS[name](7))  # rank 0's seed
    ranks = [two_ranks[r]["batches"][name] for r in range(WORLD)]
    assert [len(r) for r in ranks] == [len(reference)] * WORLD
    for step, batch in enumerate(reference):
        assert ranks[0][step] + ranks[1][step] == shard(batch, 2, 0) + shard(batch, 2, 1)
        assert _sorted(ranks[0][step] + ranks[1][step]) == _sorted(batch)


@pytest.mark.parametrize("kind,coefs", [("plain", None), ("correlated", COEFS),
                                        ("correlated_ghost", COEFS)])
@pytest.mark.slow
def test_two_processes_final_parameters_equal_single_process(two_ranks, kind, coefs):
    ref = _train(0, 1, coefs, distributed=False)
    sizes = [a + b for a, b in zip(two_ranks[0][kind]["sizes"], two_ranks[1][kind]["sizes"], strict=True)]
    assert sizes == ref["sizes"]
    assert 0 in two_ranks[1][kind]["sizes"]  # an empty shard was trained through
    for r in range(WORLD):
        for p, q in zip(two_ranks[r][kind]["params"], ref["params"], strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    # a wrong run (noise on every rank) would differ by far more than the tolerance
    moved = max(float((p - q.detach()).abs().max())
                for p, q in zip(ref["params"], _model().parameters(), strict=True))
    assert moved > 1e-2
    for r in range(WORLD):  # every rank ends in the single-process sampler state
        state = two_ranks[r][kind]["sampler"]
        assert torch.equal(state["generator_state"], ref["sampler"]["generator_state"])
        assert (state["position"], state["epoch"]) == (ref["sampler"]["position"],
                                                       ref["sampler"]["epoch"])


@pytest.mark.slow
def test_two_processes_correlated_noise_state(two_ranks):
    ref = _train(0, 1, COEFS, distributed=False)["noise"]
    r0, r1 = two_ranks[0]["correlated"]["noise"], two_ranks[1]["correlated"]["noise"]
    assert r0["noise_step"] == r1["noise_step"] == ref["noise_step"] == STEPS
    for a, b in zip(r0["buffers"], ref["buffers"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert all(b is None for b in r1["buffers"])  # only rank 0 keeps past noise


@pytest.mark.slow
def test_two_processes_callback_state_gathered(two_ranks):
    tracker, filt, decisions = _reference_callback_states()
    for r in range(WORLD):
        cb = two_ranks[r]["callbacks"]
        torch.testing.assert_close(cb["gathered_mu_sq"], tracker.mu_squared(), atol=1e-12,
                                   rtol=1e-12)
        # local view charges the worst case for steps seen elsewhere: an upper bound
        assert torch.all(cb["local_mu_sq"] >= tracker.mu_squared() - 1e-12)
        assert cb["active_counts"] == filt.active_counts()
        for step, (idx, active, gs) in enumerate(cb["masks"]):
            assert active.tolist() == [decisions[step][i] for i in idx.tolist()]
            assert torch.equal(gs[:, 0], active.to(gs.dtype))
        torch.testing.assert_close(cb["filter_state"]["accountant"]["observed_mu_sq"],
                                   filt.accountant.observed_mu_sq, atol=1e-12, rtol=1e-12)


def test_correlated_optimizer_single_rank_matches_distributed_semantics():
    """Without a process group the class needs torch.distributed: clear error."""
    from opacus_structured.optim.distributed import DistributedCorrelatedNoiseDPOptimizer

    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises((ValueError, RuntimeError)):
        DistributedCorrelatedNoiseDPOptimizer(opt, noise_multiplier=1.0, max_grad_norm=1.0,
                                              expected_batch_size=2, noise_correlation=COEFS)


def _nccl_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        from opacus_structured.distributed import all_gather_cat

        batches = _global_batches(DistributedBatchSampler(SAMPLERS["poisson"](7 + rank)))
        cat = all_gather_cat(torch.arange(rank + 1, device="cuda"))
        torch.save({"batches": batches, "cat": cat.cpu()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_nccl_two_gpus_union_of_shards(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl with 2 processes needs 2 CUDA devices")
    mp.spawn(_nccl_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    reference = _global_batches(SAMPLERS["poisson"](7))
    for step, batch in enumerate(reference):
        assert res[0]["batches"][step] + res[1]["batches"][step] == (
            shard(batch, 2, 0) + shard(batch, 2, 1))
    assert res[0]["cat"].tolist() == res[1]["cat"].tolist() == [0, 0, 1]


def _cuda_gloo_worker(rank, world, port, out_dir):
    """Both ranks on CUDA device 0 (gloo handles CUDA tensors; NCCL needs one GPU per rank)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = _train(rank, world, COEFS, distributed=True, device="cuda")
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_two_processes_on_one_gpu_correlated_noise_equals_single_process(tmp_path):
    """DDP training on CUDA (two ranks sharing one GPU, the lent machine's shape): correlated
    noise once (rank 0), final parameters equal the single-process CUDA run."""
    mp.spawn(_cuda_gloo_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    ref = _train(0, 1, COEFS, distributed=False, device="cuda")
    assert [a + b for a, b in zip(res[0]["sizes"], res[1]["sizes"], strict=True)] == ref["sizes"]
    for r in range(2):
        for p, q in zip(res[r]["params"], ref["params"], strict=True):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=0)
    assert res[0]["noise"]["noise_step"] == STEPS
    assert all(b is None for b in res[1]["noise"]["buffers"])


# ---- Lightning Trainer(strategy="ddp") with DPCallback (slow: ~45 s for the imports) -------
def _lightning_fit(devices, out, mode="hooks", accumulate=1):
    import lightning.pytorch as pl

    from lightning_callbacks.dp_callback import DPCallback
    from opacus_structured.schemes.poisson import PoissonScheme

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = _model()

        def forward(self, x):
            return self.lin(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    X, Y = _data()
    cb = DPCallback(delta=1e-5, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                    scheme=PoissonScheme(sample_rate=Q), seed=3, discretization=1e-2,
                    grad_sample_mode=mode)
    module = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=devices,
                         strategy="ddp" if devices > 1 else "auto", use_distributed_sampler=False,
                         max_epochs=2, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(TensorDataset(X, Y), batch_size=4))
    torch.save({"params": [p.detach().clone() for p in module.parameters()],
                "epsilon": cb.epsilon(), "steps": cb.steps,
                "optimizer": type(cb.optimizer).__name__}, out)


def _lightning_worker(rank, world, port, out_dir, mode, accumulate=1):
    # as torchrun would: Lightning sees LOCAL_RANK and does not launch processes itself
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    _lightning_fit(world, os.path.join(out_dir, f"lightning{rank}.pt"), mode, accumulate)


@pytest.mark.slow
@pytest.mark.parametrize("mode,accumulate", [("hooks", 1), ("ghost", 1), ("hooks", 2),
                                             ("ghost", 3)])
def test_lightning_ddp_dp_callback_equals_single_process(tmp_path, mode, accumulate):
    """DDP (2 gloo ranks) equals one process; in ghost mode (book-keeping) too, against the
    single-process hooks run; with accumulate_grad_batches too (issue 46)."""
    mp.spawn(_lightning_worker, args=(WORLD, _free_port(), str(tmp_path), mode, accumulate),
             nprocs=WORLD, join=True)
    _lightning_fit(1, str(tmp_path / "single.pt"), accumulate=accumulate)
    ref = torch.load(tmp_path / "single.pt", weights_only=False)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"lightning{r}.pt", weights_only=False)
        assert got["optimizer"] == {
            "hooks": "DistributedDPOptimizer",
            "ghost": "BookKeepingDistributedDPOptimizerFastGradientClipping"}[mode]
        assert got["steps"] == ref["steps"] and got["epsilon"] == ref["epsilon"]
        for p, q in zip(got["params"], ref["params"], strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
