r"""Running Monte Carlo privacy accounting: settings, backends, shards, processes, Algorithm 5.

The math — the b-min-sep privacy-loss sampler (:mod:`opacus_structured.accounting.bminsep_mc`),
the estimates and confidence bounds (:mod:`opacus_structured.accounting.monte_carlo`) and the
statistics of Algorithm 5 (:mod:`opacus_structured.accounting.certification`; Dong & Ganesh,
arXiv:2602.09338, Appendix A) — runs in one process. This module runs it at scale:

* :class:`MonteCarloSettings`: how a run is made (samples, seed, confidence, workers, device,
  progress, shard size), kept out of the frozen scheme that describes the mechanism;
* :func:`sample_losses`: the backend — numpy, or torch on a CPU or GPU
  (:mod:`.bminsep_mc_torch`);
* :func:`collect_privacy_losses`: a run in seed-addressed shards over a process pool or any
  :class:`concurrent.futures.Executor` (a Dask cluster: :func:`dask_executor`), saved to and
  resumed from a directory;
* :func:`certify_noise_multiplier`: Algorithm 5 with fresh, independent samples per candidate.

**Shards.** Shard ``k`` of direction ``d`` always draws from ``SeedSequence(seed, (d, k))``,
runs in a process pool or on an executor (a failed task is resubmitted), is saved to
``<dir>/<direction>-<k>.npz`` as it arrives and is loaded instead of recomputed when the
directory is resumed; ``meta.json`` records the sampler version, and a directory of another
version is refused. The merged samples are the concatenation in shard
order, so a run split over processes or machines and merged is bit-identical to one run.

**Seeds.** Every random check draws a fresh seed from OS entropy unless one is given
(``seed=None``, the default) and records the seed it used
(:attr:`~opacus_structured.accounting.monte_carlo.MonteCarloSamples.seed`, the estimate's and
the certificate's ``seed``, a shard directory's ``meta.json`` / ``certify.json``) so that an
auditor can recompute it; a Monte Carlo seed is not a privacy secret. What voids the stated
confidence is *choosing* among seeds: re-running a check that failed (or an estimate that came
out too high) with another seed and keeping the better result is multiple testing. Decide the
configuration first and run each check once; a resumed run (same ``directory``) reuses the
recorded seed, and a directory refuses a different one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
from typing import Callable, Optional, Sequence

import numpy as np

from .._optional import require
from .._validation import check_int
from ..accounting.bminsep_mc import (
    DEFAULT_CHUNK_SIZE,
    DIRECTIONS,
    SAMPLER_VERSION,
    BandMFMonteCarlo,
    sample_privacy_losses,
    sampler_stream,
)
from ..accounting.certification import (
    CertifiedCalibration,
    Fallback,
    candidate_seed,
    passes,
    plan_certification,
    run_algorithm5,
)
from ..accounting.monte_carlo import (
    DEFAULT_SHARD_SIZE,
    MonteCarloSamples,
    MonteCarloSettings,
    fresh_monte_carlo_seed,
)
from ..schemes.bminsep_mc import BMinSepMonteCarloScheme
from ..schemes.registry import register_runner
from .bminsep_mc_torch import sample_losses_torch

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "fresh_monte_carlo_seed",
    "MonteCarloSettings",
    "MonteCarloRunner",
    "collect_with_settings",
    "dask_executor",
    "settings_executor",
    "sample_losses",
    "collect_privacy_losses",
    "verify_candidate",
    "certify_noise_multiplier",
]

@contextlib.contextmanager
def dask_executor(scheduler: Optional[str] = None, workers: Optional[int] = None):
    """A Dask cluster as a :class:`concurrent.futures.Executor` (a context manager).

    ``scheduler``: the address of a running cluster's scheduler (``"tcp://host:8786"``);
    ``None`` starts a local cluster of ``workers`` single-threaded processes (default: one per
    core) for the duration of the block. Needs ``distributed`` (the ``cluster`` extra), which
    is imported only here.
    """
    distributed = require("distributed", "the Dask executor (--executor dask)")
    cluster = None
    if scheduler is None:
        cluster = distributed.LocalCluster(n_workers=workers or os.cpu_count() or 1,
                                           threads_per_worker=1, processes=True)
        client = distributed.Client(cluster)
    else:
        client = distributed.Client(scheduler)
    try:
        yield client.get_executor()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


@contextlib.contextmanager
def settings_executor(settings: MonteCarloSettings):
    """The executor a run's ``settings`` ask for: ``None`` (the local process pool) or a Dask
    cluster's (:func:`dask_executor`)."""
    if settings.executor == "dask":
        with dask_executor(settings.scheduler, settings.workers) as executor:
            yield executor
    else:
        yield None


def collect_with_settings(mechanism: BandMFMonteCarlo, settings: MonteCarloSettings, *,
                          directory: Optional[str] = None,
                          shards: Optional[Sequence[int]] = None) -> Optional[MonteCarloSamples]:
    """:func:`collect_privacy_losses` of ``mechanism`` with a run's ``settings`` (on the
    executor they name)."""
    with settings_executor(settings) as executor:
        return collect_privacy_losses(mechanism, settings.samples, seed=settings.seed,
                                      shard_size=settings.shard_size, shards=shards,
                                      workers=settings.workers, directory=directory,
                                      progress=settings.progress, device=settings.device,
                                      executor=executor)


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------
def sample_losses(mechanism: BandMFMonteCarlo, num_samples: int, direction: str, *, seed=None,
                  device: Optional[str] = None,
                  chunk_size: int = DEFAULT_CHUNK_SIZE,
                  accelerator: str = "auto") -> np.ndarray:
    """Privacy-loss samples of ``mechanism`` in ``direction`` on one backend.

    ``device=None`` uses numpy (:func:`~opacus_structured.accounting.bminsep_mc.
    sample_privacy_losses`); ``"cpu"`` / ``"cuda"`` / ``"cuda:k"`` uses the torch backend
    (:func:`.bminsep_mc_torch.sample_losses_torch`, every variant, float64). The backends draw
    different random streams, so the same seed gives different (identically distributed)
    samples; so do the numpy backend's two streams (``accelerator``, plain b-min-sep only: see
    :func:`~opacus_structured.accounting.bminsep_mc.streamed_bminsep_losses`).
    """
    if device is None:
        return sample_privacy_losses(mechanism, num_samples, direction, seed=seed,
                                     chunk_size=chunk_size, accelerator=accelerator)
    return sample_losses_torch(mechanism, num_samples, direction, seed=seed, device=device,
                               chunk_size=chunk_size)


# ---------------------------------------------------------------------------------------------
# Sharded, resumable, parallel sample collection
# ---------------------------------------------------------------------------------------------
def _shard_seed(seed: int, direction: str, shard: int) -> np.random.SeedSequence:
    return np.random.SeedSequence(int(seed), spawn_key=(DIRECTIONS.index(direction), int(shard)))


def _run_shard(mech_dict: dict, direction: str, seed: int, shard: int, size: int,
               device: Optional[str], stream: str = "numpy") -> np.ndarray:
    """One shard's samples: what a process-pool or cluster worker runs. ``stream`` is the
    driver's, so a worker without numba fails loudly instead of drawing another stream."""
    mech = BandMFMonteCarlo.from_dict(mech_dict)
    return sample_losses(mech, size, direction, seed=_shard_seed(seed, direction, shard),
                         device=device, accelerator=stream)


def _stream(mechanism: BandMFMonteCarlo, device: Optional[str]) -> str:
    """The random stream a run of ``mechanism`` draws here: ``"torch"`` on a device, else the
    numpy backend's (``"fused"`` with numba for plain b-min-sep, ``"numpy"`` otherwise)."""
    return "torch" if device is not None else sampler_stream(mechanism)


def _fingerprint(mech_dict: dict, seed: int, shard_size: int, device: Optional[str],
                 stream: str = "numpy") -> str:
    record = {"mechanism": mech_dict, "seed": int(seed), "shard_size": shard_size,
              "backend": "numpy" if device is None else "torch",
              "sampler_version": SAMPLER_VERSION}
    if stream == "fused":  # numpy-stream fingerprints stay those of earlier releases
        record["stream"] = stream
    blob = json.dumps(record, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _recorded_seed(directory: Optional[str], mech_dict: dict, shard_size: int,
                   device: Optional[str], stream: str) -> Optional[int]:
    """The seed in ``directory``'s ``meta.json`` if it records this same run (mechanism, shard
    size, backend), so that ``seed=None`` resumes it; else ``None``."""
    if directory is None:
        return None
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.exists(meta_path):
        return None
    with open(meta_path) as fh:
        meta = json.load(fh)
    seed = meta.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        return None
    if meta.get("fingerprint") != _fingerprint(mech_dict, seed, shard_size, device, stream):
        return None  # another run: the fingerprint check below refuses the directory
    return seed


def _run_on_executor(executor: concurrent.futures.Executor, todo: list, mech_dict: dict,
                     seed: int, device: Optional[str], finish: Callable, retries: int,
                     stream: str = "numpy") -> None:
    """Submit every shard of ``todo`` to ``executor`` and ``finish`` each as it completes.

    A shard whose future fails (a crashed or killed worker) is resubmitted — it is
    seed-addressed, so a retry draws the same samples — up to ``retries`` times; the shards
    already finished are saved, so even a run that gives up resumes from them.
    """
    attempts: dict[tuple[str, int], int] = {}

    def submit(d, k, size):
        return executor.submit(_run_shard, mech_dict, d, seed, k, size, device, stream)

    pending = {submit(d, k, size): (d, k, size, path) for d, k, size, path in todo}
    while pending:
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for fut in done:
            d, k, size, path = pending.pop(fut)
            try:
                arr = fut.result()
            except Exception:
                attempts[(d, k)] = attempts.get((d, k), 0) + 1
                if attempts[(d, k)] > retries:
                    for other in pending:
                        other.cancel()
                    raise
                pending[submit(d, k, size)] = (d, k, size, path)
                continue
            finish(d, k, path, np.asarray(arr, dtype=np.float64))


def collect_privacy_losses(mechanism: BandMFMonteCarlo, num_samples: int, *,
                           seed: Optional[int] = None,
                           shard_size: int = DEFAULT_SHARD_SIZE,
                           shards: Optional[Sequence[int]] = None,
                           workers: Optional[int] = None, directory: Optional[str] = None,
                           progress: bool = False, device: Optional[str] = None,
                           executor: Optional[concurrent.futures.Executor] = None,
                           retries: int = 3) -> MonteCarloSamples:
    """``num_samples`` privacy-loss samples per direction, in seed-addressed shards.

    Args:
        mechanism: the mechanism (its ``to_dict`` goes to the workers and the shard files).
        num_samples: samples per direction.
        seed: run seed; shard ``k`` of direction ``d`` uses ``SeedSequence(seed, (d, k))``, so
            the samples do not depend on ``workers``, on resuming, or on which machine ran a
            shard (merge shard directories by copying the files). ``None`` (default): the seed
            recorded in ``directory`` when resuming the same run there, else fresh OS
            entropy; the seed used is returned as ``samples.seed`` and saved in
            ``meta.json``. Pass one explicitly to split a run over machines.
        shard_size: samples per shard (the last one may be smaller).
        shards: compute only these shard indices (both directions) into ``directory`` and
            return ``None`` — to split a run over machines; a later call without ``shards``
            on the merged directory loads them all.
        workers: processes (``None``: ``os.cpu_count()``; 1: run inline).
        directory: save each shard as ``<direction>-<k>.npz`` with ``meta.json``; existing
            shards with the same fingerprint are loaded instead of recomputed.
        progress: show a tqdm progress bar.
        device: ``None`` numpy; a torch device string for the torch backend (run inline
            unless an ``executor`` is given).
        executor: any :class:`concurrent.futures.Executor` to run the shards on instead of a
            process pool of ``workers`` — e.g. a Dask cluster's
            ``distributed.Client(address).get_executor()`` (:func:`dask_executor`). Each shard is
            one task; finished shards are saved to ``directory`` as they arrive (a killed run
            resumes from them), and the merge is the same concatenation in shard order, so the
            result is bit-identical to a single-process run of the same seed.
        retries: how many times a shard whose task failed (a crashed worker) is resubmitted
            to ``executor`` before the run raises.
    """
    S = check_int("num_samples", num_samples, minimum=1)
    shard_size = check_int("shard_size", shard_size, minimum=1)
    directions = DIRECTIONS
    n_shards = -(-S // shard_size)
    if shards is not None:
        if directory is None:
            raise ValueError("shards needs a directory to save them in")
        shards = sorted({check_int("shard", k, minimum=0, maximum=n_shards - 1) for k in shards})
    workers = (os.cpu_count() or 1) if workers is None else check_int("workers", workers,
                                                                      minimum=1)
    retries = check_int("retries", retries, minimum=0)
    if executor is not None and not isinstance(executor, concurrent.futures.Executor):
        raise ValueError(f"executor must be a concurrent.futures.Executor (e.g. "
                         f"distributed.Client(...).get_executor()), got "
                         f"{type(executor).__name__}")
    mech_dict = mechanism.to_dict()
    stream = _stream(mechanism, device)
    if seed is None:
        seed = _recorded_seed(directory, mech_dict, shard_size, device, stream)
    if seed is None:
        seed = fresh_monte_carlo_seed()
    seed = check_int("seed", seed, minimum=0)
    fp = _fingerprint(mech_dict, seed, shard_size, device, stream)
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        meta_path = os.path.join(directory, "meta.json")
        meta = {"fingerprint": fp, "mechanism": mech_dict, "seed": int(seed),
                "shard_size": shard_size, "backend": "numpy" if device is None else "torch",
                "sampler_version": SAMPLER_VERSION, "stream": stream}
        if os.path.exists(meta_path):
            with open(meta_path) as fh:
                old = json.load(fh)
            if old.get("sampler_version", 1) != SAMPLER_VERSION:
                raise ValueError(f"directory {directory!r} holds shards of sampler version "
                                 f"{old.get('sampler_version', 1)}, not {SAMPLER_VERSION} (the "
                                 f"random stream changed; mixing them would bias the run): use "
                                 f"a new directory")
            old_stream = old.get("stream", "torch" if old.get("backend") == "torch" else "numpy")
            if old_stream != stream:
                hint = (" (install numba: pip install \"opacus-structured[fast]\")"
                        if old_stream == "fused" else "")
                raise ValueError(f"directory {directory!r} holds shards of the {old_stream!r} "
                                 f"random stream, and this run draws the {stream!r} stream"
                                 f"{hint}; a run draws one stream (so that its seed reproduces it): "
                                 f"resume it where that stream is available, or use a new "
                                 f"directory")
            if old.get("fingerprint") != fp:
                raise ValueError(f"directory {directory!r} holds shards of another run "
                                 f"(fingerprint {old.get('fingerprint')} != {fp}); use a new "
                                 f"directory")
        else:
            with open(meta_path, "w") as fh:
                json.dump(meta, fh, sort_keys=True)
    wanted = range(n_shards) if shards is None else shards
    jobs = [(d, k, min(shard_size, S - k * shard_size)) for d in directions for k in wanted]
    results: dict[tuple[str, int], np.ndarray] = {}
    todo = []
    for d, k, size in jobs:
        path = None if directory is None else os.path.join(directory, f"{d}-{k}.npz")
        if path is not None and os.path.exists(path):
            with np.load(path) as z:
                arr = z["losses"]
            if arr.size >= size:
                results[(d, k)] = arr[:size]
                continue
        todo.append((d, k, size, path))
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), unit="shard",
                   desc="Monte Carlo shards")

    def finish(d, k, path, arr):
        results[(d, k)] = arr
        if path is not None:
            tmp = path + ".tmp.npz"
            np.savez(tmp, losses=arr)
            os.replace(tmp, path)
        if bar is not None:
            bar.update(1)

    try:
        if executor is not None:
            _run_on_executor(executor, todo, mech_dict, seed, device, finish, retries, stream)
        elif workers == 1 or device is not None or len(todo) <= 1:
            for d, k, size, path in todo:
                finish(d, k, path, _run_shard(mech_dict, d, seed, k, size, device, stream))
        else:
            with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
                _run_on_executor(pool, todo, mech_dict, seed, None, finish, retries=0,
                                 stream=stream)
    finally:
        if bar is not None:
            bar.close()
    if shards is not None:
        return None
    per_dir = {d: np.concatenate([results[(d, k)] for k in range(n_shards)]) for d in directions}
    return MonteCarloSamples(per_dir["remove"], per_dir["add"], seed=seed)




# ---------------------------------------------------------------------------------------------
# Algorithm 5 with sampled verifications
# ---------------------------------------------------------------------------------------------
def verify_candidate(mechanism: BandMFMonteCarlo, epsilon: float, base_delta_: float,
                     num_samples: int, *, seed: int, workers: int = 1,
                     shard_size: int = DEFAULT_SHARD_SIZE, device: Optional[str] = None,
                     directory: Optional[str] = None,
                     executor: Optional[concurrent.futures.Executor] = None
                     ) -> tuple[bool, float, float]:
    """Verifier ``V(M)``: 1 iff ``δ̃_P(ε) ≤ δ′`` and ``δ̃_Q(ε) ≤ δ′`` on fresh samples
    (:func:`~opacus_structured.accounting.certification.passes`)."""
    samples = collect_privacy_losses(mechanism, num_samples, seed=seed, workers=workers,
                                     shard_size=shard_size, device=device, directory=directory,
                                     executor=executor)
    return passes(samples, epsilon, base_delta_)


def _certification_seed(directory: Optional[str], seed: Optional[int]) -> int:
    """The run seed of a certification: ``seed``, else the one recorded in ``directory``
    (resume), else fresh entropy; recorded in ``<directory>/certify.json``. A directory that
    recorded another seed is refused (a second certification with a new seed is multiple
    testing)."""
    if seed is not None:
        seed = check_int("seed", seed, minimum=0)
    recorded = None
    path = None if directory is None else os.path.join(directory, "certify.json")
    if path is not None and os.path.exists(path):
        with open(path) as fh:
            recorded = json.load(fh).get("seed")
    if recorded is not None and seed is not None and seed != recorded:
        raise ValueError(
            f"directory {directory!r} holds a certification with seed {recorded}, not {seed}: "
            f"re-running Algorithm 5 with another seed and keeping the better outcome voids its "
            f"guarantee (multiple testing); resume with seed={recorded} (or seed=None)")
    seed = seed if seed is not None else recorded if recorded is not None else \
        fresh_monte_carlo_seed()
    if path is not None and recorded is None:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as fh:
            json.dump({"seed": int(seed)}, fh)
    return int(seed)


def certify_noise_multiplier(mechanism: BandMFMonteCarlo, epsilon: float, target_delta: float, *,
                             sigma_min: float, sigma_max: Optional[float] = None,
                             ratio: float = 1.01, num_samples: Optional[int] = None,
                             base_delta_: Optional[float] = None,
                             fallback: Optional[Fallback] = None,
                             seed: Optional[int] = None,
                             workers: int = 1, shard_size: int = DEFAULT_SHARD_SIZE,
                             device: Optional[str] = None, directory: Optional[str] = None,
                             progress: Optional[Callable[[float, bool], None]] = None,
                             executor: Optional[concurrent.futures.Executor] = None
                             ) -> CertifiedCalibration:
    r"""Algorithm 5 (Theorem A.1): the smallest verified σ on a ``ratio`` grid, else the fallback.

    The plan — ``δ′``, the sample count, the fallback and the candidates — is
    :func:`~opacus_structured.accounting.certification.plan_certification` (see it for
    ``sigma_max``, ``ratio``, ``num_samples``, ``base_delta_`` and ``fallback``); the scan is
    :func:`~opacus_structured.accounting.certification.run_algorithm5`. Candidate ``k`` is
    verified with :func:`collect_privacy_losses` from the seed
    :func:`~opacus_structured.accounting.certification.candidate_seed` ``(seed, k)`` — fresh,
    independent samples per candidate — in ``<directory>/candidate-<k>`` when a directory is
    given (resumable).

    Args:
        mechanism: the mechanism (its σ is replaced by each candidate).
        epsilon, target_delta: the certified target ``(ε, δ_t)``.
        seed: run seed of the verifications; ``None`` (default): the seed recorded in
            ``directory`` when resuming there, else fresh OS entropy. Returned as
            ``result.seed``. Run the certification **once**: re-running after a failed check
            with another seed and keeping the better outcome is multiple testing and voids
            Theorem A.1's guarantee. A directory refuses a different seed for the same reason.
        workers, shard_size, device, executor: how the verifications run
            (:func:`collect_privacy_losses`).
        progress: ``progress(sigma, passed)`` after each verified candidate.
    """
    plan = plan_certification(mechanism, epsilon, target_delta, sigma_min=sigma_min,
                              sigma_max=sigma_max, ratio=ratio, num_samples=num_samples,
                              base_delta_=base_delta_, fallback=fallback)
    seed = _certification_seed(directory, seed)

    def verify(k: int, sigma: float) -> tuple[bool, float, float]:
        sub = None if directory is None else os.path.join(directory, f"candidate-{k}")
        return verify_candidate(mechanism.with_noise(sigma), plan.epsilon, plan.base_delta,
                                plan.num_samples, seed=candidate_seed(seed, k), workers=workers,
                                shard_size=shard_size, device=device, directory=sub,
                                executor=executor)

    return run_algorithm5(plan, verify, seed=seed, progress=progress)


@register_runner(BMinSepMonteCarloScheme)
class MonteCarloRunner:
    """Runs a Monte Carlo scheme's pricing: what ``scheme.estimate`` / ``certify`` call."""

    @staticmethod
    def collect(mechanism: BandMFMonteCarlo, settings: MonteCarloSettings, **kwargs):
        """Privacy-loss samples of ``mechanism`` (:func:`collect_with_settings`)."""
        return collect_with_settings(mechanism, settings, **kwargs)

    @staticmethod
    def certify(mechanism: BandMFMonteCarlo, epsilon: float, target_delta: float, *,
                settings: Optional[MonteCarloSettings] = None, **kwargs):
        """Algorithm 5 (:func:`certify_noise_multiplier`), on the executor ``settings`` names."""
        if settings is None or "executor" in kwargs:
            return certify_noise_multiplier(mechanism, epsilon, target_delta, **kwargs)
        with settings_executor(settings) as executor:
            return certify_noise_multiplier(mechanism, epsilon, target_delta,
                                            executor=executor, **kwargs)
