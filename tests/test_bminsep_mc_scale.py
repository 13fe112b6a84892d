"""Issue 18: the streamed b-min-sep sampler (exact against the log-space dynamic program),
shard-directory versions, shards on any ``concurrent.futures.Executor`` and on a Dask cluster
with a killed worker, and the jax_privacy benchmark's table."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from opacus_structured._optional import MissingOptionalDependency
from opacus_structured.accounting.bminsep_fused import fused_available, numba_module
from opacus_structured.accounting.bminsep_mc import (
    DIRECTIONS,
    BandedStrategy,
    BandMFMonteCarlo,
    bminsep_log_ratio,
    streamed_bminsep_losses,
)
from opacus_structured.accounting.monte_carlo import MonteCarloSettings
from opacus_structured.runners.monte_carlo import (
    collect_privacy_losses,
    dask_executor,
)


def _sqrt_coefficients(L: int) -> np.ndarray:
    c = np.cumprod([1.0] + [(2 * j - 1) / (2 * j) for j in range(1, L)])
    return c / np.linalg.norm(c)


@pytest.mark.parametrize("b,n,L,warm,block,toeplitz", [
    (4, 300, 4, True, 128, True),    # several blocks, Toeplitz, elementwise window products
    (1, 200, 1, False, 64, True),    # b = 1: Poisson-like, the recursion is a product
    (20, 150, 20, True, 32, True),   # blocked / BLAS matrix-product window dots, bands > block/2
    (64, 150, 64, True, 16, True),   # bands > block: the tail copy overlaps
    (5, 37, 3, True, 8, False),      # general columns, L < b, partial last block
    (20, 90, 20, True, 32, False),   # general columns, four-row window products (L >= 8)
    (3, 10, 3, False, 128, True),    # n < block
])
@pytest.mark.parametrize("sigma", [1.0, 0.25])
@pytest.mark.parametrize("accelerator", ["numpy", "fused"])
def test_streamed_sampler_equals_log_space_program(b, n, L, warm, block, toeplitz, sigma,
                                                   accelerator):
    """Both streams' losses are the log-space dynamic program's on the same outputs (float64,
    to 1e-9): linear recursion, renormalisation and the log-space fallback blocks (σ = 0.25
    makes ℓ large) included; 300 samples = two full fused tiles and a partial one."""
    if accelerator == "fused" and not fused_available():
        pytest.skip("the fused sampler needs numba")
    if toeplitz:
        st = BandedStrategy.toeplitz(_sqrt_coefficients(L), n)
    else:
        cols = np.random.default_rng(4).uniform(0.1, 1.0, size=(n, L))
        for k in range(1, L):
            cols[n - k:, k] = 0.0
        st = BandedStrategy.from_columns(cols)
    p = 0.05
    mech = BandMFMonteCarlo(st, sigma, "bminsep", p, b, warm_start=warm)
    for direction in DIRECTIONS:
        loss, y = streamed_bminsep_losses(mech, 300, direction, np.random.default_rng(3),
                                          block=block, return_outputs=True,
                                          accelerator=accelerator)
        ref = bminsep_log_ratio(y, st, p, b, sigma, warm_start=warm)
        ref = ref if direction == "remove" else -ref
        np.testing.assert_allclose(loss, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.float_sensitive
@pytest.mark.parametrize("b,n,L,block", [(4, 300, 4, 128), (1, 90, 1, 32), (20, 150, 20, 32),
                                         (5, 37, 3, 8)])
def test_numba_path_is_bit_identical(b, n, L, block):
    """numba (optional) only fuses loops of the numpy path's float64 operations, in the same
    order: the samples are equal bit for bit (large ℓ and a non-Toeplitz C included)."""
    if numba_module() is None:
        pytest.skip("needs numba (and OPACUS_STRUCTURED_NUMBA not 0)")
    strategies = [BandedStrategy.toeplitz(_sqrt_coefficients(L), n)]
    cols = np.random.default_rng(4).uniform(0.1, 1.0, size=(n, L))
    for k in range(1, L):
        cols[n - k:, k] = 0.0
    strategies.append(BandedStrategy.from_columns(cols))
    for st in strategies:
        for sigma in (1.0, 0.25):
            mech = BandMFMonteCarlo(st, sigma, "bminsep", 0.05, b, warm_start=b > 1)
            for direction in DIRECTIONS:
                a = streamed_bminsep_losses(mech, 400, direction, np.random.default_rng(5),
                                            block=block, accelerator="numpy")
                c = streamed_bminsep_losses(mech, 400, direction, np.random.default_rng(5),
                                            block=block, accelerator="numba")
                np.testing.assert_array_equal(a, c)


def test_accelerator_argument():
    st = BandedStrategy.toeplitz([1.0], 8)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.2, 1)
    with pytest.raises(ValueError, match="accelerator must be"):
        streamed_bminsep_losses(mech, 10, "remove", np.random.default_rng(0), accelerator="gpu")


def test_streamed_sampler_general_columns_and_p_one():
    """A non-Toeplitz C (per-column coefficients) and p = 1 (log-space path throughout)."""
    rng = np.random.default_rng(0)
    n, L = 40, 3
    cols = rng.uniform(0.1, 1.0, size=(n, L))
    for k in range(1, L):
        cols[n - k:, k] = 0.0
    st = BandedStrategy.from_columns(cols)
    for p in (0.2, 1.0):
        mech = BandMFMonteCarlo(st, 0.7, "bminsep", p, 3, warm_start=p < 1)
        loss, y = streamed_bminsep_losses(mech, 200, "remove", np.random.default_rng(1),
                                          block=16, return_outputs=True, accelerator="numpy")
        ref = bminsep_log_ratio(y, st, p, 3, 0.7, warm_start=p < 1)
        np.testing.assert_allclose(loss, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("accelerator", ["numpy", "fused"])
def test_streamed_sampler_participation_law(accelerator):
    """The drawn outputs have mean C·E[x]/σ… in law: the mean of y is C times the stationary
    participation rate p0 per iteration (warm start), within Monte Carlo error."""
    n, b, p = 60, 4, 0.1
    st = BandedStrategy.toeplitz([1.0, 0.5, 0.25, 0.125], n)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", p, b, warm_start=True)
    if accelerator == "fused" and not fused_available():
        pytest.skip("the fused sampler needs numba")
    _, y = streamed_bminsep_losses(mech, 40000, "remove", np.random.default_rng(2),
                                   return_outputs=True, accelerator=accelerator)
    p0 = p / (1 + (b - 1) * p)
    expected = st.apply(np.full((n, 1), p0))[:, 0]
    se = y.std(axis=1) / np.sqrt(y.shape[1])
    assert np.all(np.abs(y.mean(axis=1) - expected) < 5 * se)
    _, y0 = streamed_bminsep_losses(mech, 20000, "add", np.random.default_rng(2),
                                    return_outputs=True, accelerator=accelerator)
    assert abs(y0.mean()) < 5 / np.sqrt(y0.size) and abs(y0.std() - 1.0) < 0.01


def test_streamed_sampler_rejects_other_variants():
    st = BandedStrategy.toeplitz([1.0], 8)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.2, 1, max_user_examples=2)
    with pytest.raises(ValueError, match="plain b-min-sep"):
        streamed_bminsep_losses(mech, 10, "remove", np.random.default_rng(0))


def test_old_sampler_version_directory_is_refused(tmp_path):
    """Shards written by another sampler version are never mixed into a run."""
    st = BandedStrategy.toeplitz([1.0, 0.5], 12)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.2, 2)
    d = tmp_path / "run"
    collect_privacy_losses(mech, 100, seed=1, shard_size=50, workers=1, directory=str(d))
    meta = json.loads((d / "meta.json").read_text())
    meta.pop("sampler_version")  # what a directory of the previous sampler looks like
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="sampler version 1"):
        collect_privacy_losses(mech, 100, seed=1, shard_size=50, workers=1, directory=str(d))


class _FlakyExecutor(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose first task on each listed shard raises, as a crashed worker."""

    def __init__(self, fail_shards):
        super().__init__(max_workers=2)
        self.fail = set(fail_shards)
        self.lock = threading.Lock()

    def submit(self, fn, *args, **kwargs):
        key = (args[1], args[3])  # (direction, shard) of _run_shard
        with self.lock:
            crash = key in self.fail
            self.fail.discard(key)
        if crash:
            def boom():
                raise RuntimeError("worker died")
            return super().submit(boom)
        return super().submit(fn, *args, **kwargs)


def test_any_executor_retries_crashed_shards_and_merges_exactly(tmp_path):
    st = BandedStrategy.toeplitz(_sqrt_coefficients(3), 50)
    mech = BandMFMonteCarlo(st, 0.9, "bminsep", 0.1, 3, warm_start=True)
    ref = collect_privacy_losses(mech, 1000, seed=11, shard_size=200, workers=1)
    with _FlakyExecutor({("remove", 1), ("add", 4)}) as ex:
        got = collect_privacy_losses(mech, 1000, seed=11, shard_size=200, executor=ex,
                                     directory=str(tmp_path / "a"))
    np.testing.assert_array_equal(ref.remove, got.remove)
    np.testing.assert_array_equal(ref.add, got.add)
    # a run that gives up keeps its finished shards; the resumed run loads them
    with _FlakyExecutor({("remove", 2)}) as ex:
        with pytest.raises(RuntimeError, match="worker died"):
            collect_privacy_losses(mech, 1000, seed=11, shard_size=200, executor=ex,
                                   retries=0, directory=str(tmp_path / "b"))
    saved = {f for f in os.listdir(tmp_path / "b") if f.endswith(".npz")}
    assert "remove-2.npz" not in saved
    resumed = collect_privacy_losses(mech, 1000, seed=11, shard_size=200, workers=1,
                                     directory=str(tmp_path / "b"))
    np.testing.assert_array_equal(ref.remove, resumed.remove)
    with pytest.raises(ValueError, match="executor must be a concurrent.futures.Executor"):
        collect_privacy_losses(mech, 10, seed=1, executor="dask")


def test_settings_executor_flags_and_missing_distributed(monkeypatch):
    with pytest.raises(ValueError, match="executor must be one of"):
        MonteCarloSettings(executor="ray")
    with pytest.raises(ValueError, match="scheduler"):
        MonteCarloSettings(scheduler="tcp://localhost:8786")
    s = MonteCarloSettings(executor="dask", scheduler="tcp://localhost:8786")
    assert MonteCarloSettings.from_dict(s.to_dict()) == s
    assert "executor" not in s.differences(MonteCarloSettings(samples=s.samples))
    monkeypatch.setitem(sys.modules, "distributed", None)
    with pytest.raises(MissingOptionalDependency, match=r"opacus-structured\[cluster\]"):
        with dask_executor("tcp://localhost:8786"):
            pass


def test_cli_executor_dask_without_distributed(monkeypatch, capsys):
    from opacus_structured.cli import main

    monkeypatch.setitem(sys.modules, "distributed", None)
    rc = main(["bminsep-mc", "estimate", "--bands", "2", "--dataset-size", "1280", "--batch-size", "10",
               "--min-sep", "2", "--steps", "8", "--delta", "1e-3", "--noise-multiplier", "1",
               "--samples", "100", "--seed", "1", "--executor", "dask",
               "--scheduler", "tcp://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert rc == 2 and "opacus-structured[cluster]" in err and len(err.strip().splitlines()) == 1


def _kill_one_worker(client) -> int:
    """SIGKILL one worker process of the test's own cluster (by its pid): a crash."""
    addr = sorted(client.scheduler_info()["workers"])[0]
    pid = client.run(os.getpid, workers=[addr])[addr]
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_dask_local_cluster_killed_worker_merges_exactly(tmp_path):
    """Two worker processes; one is killed mid-run (its nanny restarts it, the scheduler
    reruns its shard); the merged samples equal the single-process run of the same seed."""
    distributed = pytest.importorskip("distributed")
    st = BandedStrategy.toeplitz(_sqrt_coefficients(4), 1000)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.03, 4, warm_start=True)
    S, shard = 12000, 1500  # 16 shards of ~0.1 s
    ref = collect_privacy_losses(mech, S, seed=21, shard_size=shard, workers=1)
    d = tmp_path / "dask"
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        box = {}

        def run():
            try:
                box["samples"] = collect_privacy_losses(
                    mech, S, seed=21, shard_size=shard, executor=client.get_executor(),
                    directory=str(d), progress=True)
            except BaseException as exc:  # pragma: no cover - reported below
                box["error"] = exc

        th = threading.Thread(target=run)
        th.start()
        deadline = time.monotonic() + 40
        while not (d.exists() and any(f.endswith(".npz") for f in os.listdir(d))):
            assert time.monotonic() < deadline, "no shard finished"
            time.sleep(0.05)
        _kill_one_worker(client)
        th.join(timeout=50)
        assert not th.is_alive()
    assert "error" not in box, box.get("error")
    got = box["samples"]
    np.testing.assert_array_equal(ref.remove, got.remove)
    np.testing.assert_array_equal(ref.add, got.add)
    assert got.seed == ref.seed == 21


def test_benchmark_table_against_jax_privacy(tmp_path):
    """The benchmark runs jax_privacy's own sampler beside ours and prints the table (tiny
    sizes: this checks the harness, not the speed)."""
    pytest.importorskip("jax_privacy")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import bminsep_mc as bench
    finally:
        sys.path.pop(0)
    out = tmp_path / "b.json"
    bench.main(["--reference", "jax_privacy", "--bands", "1", "4", "--n", "60", "--reps", "1",
                "--ref-elements", "12000", "--our-elements", "24000", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["b"], r["n"]) for r in rows] == [(1, 60), (4, 60)]
    for r in rows:
        assert r["jax_privacy_samples_per_s"] > 0 and r["ours_samples_per_s"] > 0
        assert abs(r["mean_loss_ours"] - r["mean_loss_jax_privacy"]) < 6 * r["mean_loss_se"]
    assert rows[1]["note"] and not rows[0]["note"]


@pytest.mark.slow
def test_settings_dask_executor_local_cluster_equals_process_pool(tmp_path):
    """``MonteCarloSettings(executor="dask")`` without a scheduler runs the shards on a local
    cluster of ``workers`` processes; the samples are the process-pool run's."""
    pytest.importorskip("distributed")
    from opacus_structured.runners.monte_carlo import collect_with_settings

    st = BandedStrategy.toeplitz(_sqrt_coefficients(2), 40)
    mech = BandMFMonteCarlo(st, 1.0, "bminsep", 0.1, 2, warm_start=True)
    local = MonteCarloSettings(samples=600, seed=9, shard_size=200, workers=1)
    dask = MonteCarloSettings(samples=600, seed=9, shard_size=200, workers=1, executor="dask")
    a = collect_with_settings(mech, local)
    b = collect_with_settings(mech, dask, directory=str(tmp_path / "d"))
    np.testing.assert_array_equal(a.remove, b.remove)
    np.testing.assert_array_equal(a.add, b.add)
