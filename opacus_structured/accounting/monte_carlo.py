r"""Monte Carlo δ estimation, confidence bounds and certified calibration (Algorithm 5).

Dong & Ganesh (arXiv:2602.09338) §2.5 and Appendix A; the KL–Chernoff–Hoeffding bound is Fact
4.2 of Chua et al., "Balls-and-bins sampling for DP-SGD" (arXiv:2412.16802). Digest
``seed1-bandmf-bminsep.md`` §4.3–4.4 and §5.6 (c).

**Estimate.** With privacy-loss samples ``L_j = ln(P/Q)(y_j)``, ``y_j ~ P`` i.i.d.,

.. math::  \tilde\delta_P(\varepsilon) = \frac1s\sum_j \max\{0, 1 - e^{\varepsilon - L_j}\}

is unbiased for ``H_{e^ε}(P‖Q)``; the add direction uses ``y ~ Q`` and ``ln(Q/P)``. Both are
needed (δ = max of the two). Each term lies in ``[0, 1]``.

**Confidence.** For a mean of ``s`` i.i.d. ``[0,1]`` variables with mean ``δ > δ′``,
``Pr[δ̃ ≤ δ′] ≤ q(δ, δ′, s) = exp(−s·KL(δ′‖δ))`` (Chernoff–Hoeffding, KL form). Inverting it
gives the upper confidence bound :func:`delta_upper_confidence`. A :class:`MonteCarloEstimate`
states its result as "Monte Carlo, holds with probability ≥ 1 − q": **it is not a
deterministic bound** and is never returned where a guarantee is asked for.

**Certification (Algorithm 5, Theorem A.1).** Candidates ``M_1, …, M_{k−1}`` (noise multipliers
on a grid of powers of 1.01, least private first) and a fallback ``M_k`` with a closed-form
``(ε, δ)`` guarantee. Verify each ``M_i`` with fresh samples (``v_i = 1`` iff both directions'
``δ̃ ≤ δ′``) and run ``M_{i*}``, ``i* = min{i : v_j = 1 ∀ j ≥ i}``. If every non-``(ε,δ)``-DP
candidate passes w.p. ``< q`` then the whole pipeline is ``(ε, δ + q(1−δ))``-DP.
With ``δ = τδ′``: ``δ_o(δ′, s) = min_{τ ≥ 1} τδ′ + q(τδ′, δ′, s)(1 − τδ′)`` (:func:`overall_delta`).

**Scale.** :func:`collect_privacy_losses` splits a run into seed-addressed shards (shard ``k``
of direction ``d`` always draws from ``SeedSequence(seed, spawn_key=(d, k))``), runs them in a
process pool, saves each to ``<dir>/<direction>-<k>.npz`` and resumes from what is there. The
merged samples are the concatenation in shard order, so a run split over processes or machines
and merged is bit-identical to one run; estimates use ``math.fsum`` (order independent).

**Seeds.** Every random check draws a fresh seed from OS entropy unless one is given
(``seed=None``, the default) and records the seed it used (:attr:`MonteCarloSamples.seed`,
:attr:`CertifiedCalibration.seed`, a shard directory's ``meta.json``) so that an auditor can
recompute it; a Monte Carlo seed is not a privacy secret. What voids the stated confidence is
*choosing* among seeds: re-running a check that failed (or an estimate that came out too high)
with another seed and keeping the better result is multiple testing, and the "probability
≥ 1 − q" no longer holds. Decide the configuration first, run each check once; a resumed run
(same ``directory``) reuses the recorded seed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
from typing import Callable, Optional, Sequence

import numpy as np
from scipy import optimize

from .._validation import check_int, check_nonnegative, check_open_unit, check_positive
from .bminsep_mc import DIRECTIONS, BandMFMonteCarlo, sample_privacy_losses
from .bounds import BoundKind
from .calibration import smallest_passing_int

__all__ = [
    "MONTE_CARLO",
    "fresh_monte_carlo_seed",
    "kl_bernoulli",
    "hoeffding_failure_probability",
    "overall_delta",
    "base_delta",
    "minimum_samples",
    "empirical_delta",
    "empirical_epsilon",
    "delta_upper_confidence",
    "MonteCarloSamples",
    "MonteCarloEstimate",
    "MonteCarloEpsilon",
    "collect_privacy_losses",
    "sigma_grid",
    "Fallback",
    "unamplified_fallback",
    "cyclic_poisson_fallback",
    "CertifiedCalibration",
    "verify_candidate",
    "certify_noise_multiplier",
]

#: The bound kind of every Monte Carlo result.
MONTE_CARLO = BoundKind.MONTE_CARLO


# ---------------------------------------------------------------------------------------------
# Tail bounds and the δ_t / δ′ / s relations (App. A)
# ---------------------------------------------------------------------------------------------
def kl_bernoulli(a: float, b: float) -> float:
    """``KL(Bern(a) ‖ Bern(b)) = a ln(a/b) + (1−a) ln((1−a)/(1−b))`` (``0 ln 0 = 0``)."""
    if not (0 <= a <= 1 and 0 <= b <= 1):
        raise ValueError(f"a and b must be in [0, 1], got a={a}, b={b}")
    if a == b:
        return 0.0
    if b in (0.0, 1.0):
        return math.inf
    first = 0.0 if a == 0 else a * math.log(a / b)
    second = 0.0 if a == 1 else (1 - a) * (math.log1p(-a) - math.log1p(-b))
    return max(first + second, 0.0)


def hoeffding_failure_probability(num_samples: int, true_delta: float, base_delta: float) -> float:
    """``q = exp(−s·KL(δ′‖δ))`` bounds ``Pr[δ̃ ≤ δ′]`` when the true mean is ``δ > δ′``
    (Fact 4.2 of arXiv:2412.16802). Returns 1 when ``δ ≤ δ′`` (no information)."""
    s = check_int("num_samples", num_samples, minimum=1)
    if not (0 < base_delta < 1 and 0 < true_delta <= 1):
        raise ValueError(f"deltas must be in (0, 1), got true_delta={true_delta}, "
                         f"base_delta={base_delta}")
    if true_delta <= base_delta:
        return 1.0
    return math.exp(-s * kl_bernoulli(base_delta, true_delta))


def _overall_from_tau(s: int, dp: float, tau: float) -> float:
    d = min(tau * dp, 1.0)
    return d + hoeffding_failure_probability(s, d, dp) * (1.0 - d)


def overall_delta(num_samples: int, base_delta: float) -> float:
    r"""``δ_{o,min}(δ′, s) = min_{τ ∈ [1, 1/δ′]} τδ′ + q(τδ′, δ′, s)(1 − τδ′)`` (Theorem A.1).

    The minimiser is searched on ``log τ`` (bounded Brent plus a coarse grid); any ``τ`` gives
    a valid bound, so an inexact minimum only loosens the result.
    """
    s = check_int("num_samples", num_samples, minimum=1)
    dp = check_open_unit("base_delta", base_delta)
    hi = math.log(1.0 / dp)
    f = lambda t: _overall_from_tau(s, dp, math.exp(t))  # noqa: E731
    grid = np.linspace(0.0, hi, 65)
    vals = [f(t) for t in grid]
    k = int(np.argmin(vals))
    lo_t, hi_t = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    res = optimize.minimize_scalar(f, bounds=(lo_t, hi_t), method="bounded",
                                   options={"xatol": 1e-10})
    return float(min(vals[k], f(res.x), 1.0))


def base_delta(num_samples: int, target_delta: float) -> float:
    """Largest ``δ′`` with :func:`overall_delta` ``(s, δ′) ≤ δ_t`` (rounded down; checked)."""
    s = check_int("num_samples", num_samples, minimum=1)
    dt = check_open_unit("target_delta", target_delta)
    g = lambda d: overall_delta(s, d) - dt  # noqa: E731
    lo = dt / 2
    while g(lo) > 0:
        lo *= 1e-2
        if lo < 1e-30 * dt:
            raise ValueError(f"num_samples={s} is too small to certify target_delta={dt}: "
                             f"need at least minimum_samples(base_delta, target_delta)")
    hi = dt * (1 - 1e-12)
    if g(hi) <= 0:
        return hi
    root = optimize.brentq(g, lo, hi, xtol=1e-9 * dt)
    step = 1e-9 * dt
    while g(root) > 0:
        root -= step
    return float(root)


def minimum_samples(base_delta: float, target_delta: float) -> int:
    """Smallest ``s`` with :func:`overall_delta` ``(s, δ′) ≤ δ_t`` (binary search; App. A).

    Digest §5.6 (c): ``δ_t = 1e-3, δ′ = 5e-4`` needs ``s ≈ 7.50e4``.
    """
    dp = check_open_unit("base_delta", base_delta)
    dt = check_open_unit("target_delta", target_delta)
    if dt <= dp:
        raise ValueError(f"target_delta must be > base_delta, got {dt} <= {dp}")
    ok = lambda s: overall_delta(s, dp) <= dt  # noqa: E731
    lo, hi = 1, max(2, int(1.0 / dt))
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e18:
            raise ValueError("minimum_samples exceeds 1e18; base_delta too close to target_delta")
    return smallest_passing_int(ok, lo, hi)


# ---------------------------------------------------------------------------------------------
# Estimates from samples
# ---------------------------------------------------------------------------------------------
def _as_losses(losses) -> np.ndarray:
    arr = np.asarray(losses, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"losses must be a non-empty 1-D array, got shape {arr.shape}")
    if np.any(np.isnan(arr)):
        raise ValueError("losses contain NaN")
    return arr


def empirical_delta(losses, epsilon: float) -> float:
    """``δ̃(ε) = mean_j max{0, 1 − e^{ε − L_j}}`` (``-expm1(min(ε − L, 0))``, exact ``fsum``)."""
    arr = _as_losses(losses)
    if math.isnan(epsilon):
        raise ValueError("epsilon must not be NaN")
    tail = arr[arr > float(epsilon)]  # other terms are exactly 0
    terms = -np.expm1(float(epsilon) - tail)
    return math.fsum(terms.tolist()) / arr.size


def _epsilon_for(delta_of_eps: Callable[[float], float], delta: float, upper: float) -> float:
    """Smallest ε ≥ 0 (to 1e-9, rounded up) with the non-increasing ``delta_of_eps(ε) ≤ δ``."""
    if delta_of_eps(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, max(upper, 1e-9)
    while delta_of_eps(hi) > delta:
        lo, hi = hi, 2 * hi + 1
        if hi > 1e6:
            return math.inf
    while hi - lo > 1e-9 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if delta_of_eps(mid) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def empirical_epsilon(losses, delta: float) -> float:
    """Point estimate: smallest ε with ``δ̃(ε) ≤ δ`` (not a bound)."""
    arr = _as_losses(losses)
    delta = check_open_unit("delta", delta)
    return _epsilon_for(lambda e: empirical_delta(arr, e), delta, float(arr.max()))


def delta_upper_confidence(delta_hat: float, num_samples: int, failure_probability: float) -> float:
    r"""KL upper confidence bound: the largest ``δ`` with ``s·KL(δ̃‖δ) ≤ ln(1/q)``.

    For a mean ``δ̃`` of ``s`` i.i.d. ``[0,1]`` terms with mean ``δ``, ``Pr[δ ≤ UCB] ≥ 1 − q``
    (Chernoff–Hoeffding in KL form: ``Pr[δ̃ ≤ a] ≤ exp(−s·KL(a‖δ))`` for ``a < δ``). Monotone
    non-decreasing in ``δ̃``; rounded up.
    """
    dh = check_nonnegative("delta_hat", delta_hat)
    if dh > 1:
        raise ValueError(f"delta_hat must be <= 1, got {dh}")
    s = check_int("num_samples", num_samples, minimum=1)
    q = check_open_unit("failure_probability", failure_probability)
    if dh >= 1:
        return 1.0
    budget = math.log(1.0 / q) / s
    f = lambda d: kl_bernoulli(dh, d) - budget  # noqa: E731  (increasing on [dh, 1))
    hi = 1.0 - 1e-15
    if f(hi) <= 0:
        return 1.0
    root = optimize.brentq(f, dh, hi, xtol=1e-300, rtol=1e-13, maxiter=500)
    return float(min(1.0, root * (1 + 1e-9)))


def fresh_monte_carlo_seed() -> int:
    """A 63-bit seed from the OS entropy pool: the default of every Monte Carlo check (a fixed
    default seed would invite re-running a failed check with "another" seed)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


@dataclasses.dataclass
class MonteCarloSamples:
    """Privacy-loss samples per direction (``"remove"``: ln P/Q under P; ``"add"``: ln Q/P
    under Q). Merge with ``+`` (concatenation: exact). ``seed`` is the run seed they were drawn
    with (:func:`collect_privacy_losses`; ``None`` for merged or hand-made samples)."""

    remove: np.ndarray
    add: np.ndarray
    seed: Optional[int] = None

    def __post_init__(self):
        self.remove = _as_losses(self.remove)
        self.add = _as_losses(self.add)

    def __add__(self, other: "MonteCarloSamples") -> "MonteCarloSamples":
        return MonteCarloSamples(np.concatenate([self.remove, other.remove]),
                                 np.concatenate([self.add, other.add]))

    @property
    def num_samples(self) -> int:
        """Samples per direction (the smaller count, used by the tail bounds)."""
        return int(min(self.remove.size, self.add.size))

    def empirical_delta(self, epsilon: float) -> float:
        """``max(δ̃_P(ε), δ̃_Q(ε))`` (point estimate)."""
        return max(empirical_delta(self.remove, epsilon), empirical_delta(self.add, epsilon))

    def estimate(self, delta: float, failure_probability: float = 1e-3) -> "MonteCarloEstimate":
        """ε at ``delta``: the point estimate and the high-confidence upper estimate."""
        delta = check_open_unit("delta", delta)
        q = check_open_unit("failure_probability", failure_probability)
        qd = q / 2  # one half per direction (union bound)

        def ucb(e):
            return max(delta_upper_confidence(empirical_delta(self.remove, e), self.remove.size, qd),
                       delta_upper_confidence(empirical_delta(self.add, e), self.add.size, qd))

        top = float(max(self.remove.max(), self.add.max()))
        eps_up = _epsilon_for(ucb, delta, top)
        eps_point = _epsilon_for(self.empirical_delta, delta, top)
        return MonteCarloEstimate(
            epsilon=eps_up, delta=delta, point_epsilon=eps_point,
            delta_remove=empirical_delta(self.remove, eps_up),
            delta_add=empirical_delta(self.add, eps_up),
            num_samples=self.num_samples, failure_probability=q)

    def estimate_delta(self, epsilon: float, failure_probability: float = 1e-3) -> dict:
        """δ at ``epsilon``: point estimates per direction and the confidence upper bound."""
        q = check_open_unit("failure_probability", failure_probability)
        dr, da = empirical_delta(self.remove, epsilon), empirical_delta(self.add, epsilon)
        up = max(delta_upper_confidence(dr, self.remove.size, q / 2),
                 delta_upper_confidence(da, self.add.size, q / 2))
        return {"kind": MONTE_CARLO, "epsilon": float(epsilon), "delta_remove": dr,
                "delta_add": da, "delta_point": max(dr, da), "delta_upper": up,
                "failure_probability": q, "num_samples": self.num_samples}


@dataclasses.dataclass(frozen=True)
class MonteCarloEstimate:
    """A Monte Carlo privacy estimate: **holds with probability ≥ 1 − q, not a deterministic
    bound**.

    Fields: ``epsilon`` is the high-confidence upper estimate: with probability ≥ ``1 − q``
    over the samples, the mechanism is ``(epsilon, delta)``-DP (KL upper confidence bound of
    both directions' δ̃, ``q/2`` each; valid at a data-dependent ε because δ̃ and its bound are
    monotone in ε). ``point_epsilon`` is the plain estimate (``δ̃(ε) = δ``), with no confidence
    statement. ``delta_remove`` / ``delta_add`` are δ̃ of each direction at ``epsilon``;
    ``num_samples`` is per direction; ``failure_probability`` is ``q``.
    """

    epsilon: float
    delta: float
    point_epsilon: float
    delta_remove: float
    delta_add: float
    num_samples: int
    failure_probability: float
    kind: str = MONTE_CARLO

    @property
    def confidence(self) -> float:
        return 1.0 - self.failure_probability

    @property
    def statement(self) -> str:
        if math.isinf(self.epsilon):
            need = math.ceil(math.log(2.0 / self.failure_probability) / self.delta)
            return (f"Monte Carlo estimate (not a deterministic bound): {self.num_samples} "
                    f"samples per direction cannot support delta={self.delta:g} at confidence "
                    f"{self.confidence:g} (epsilon = inf); use well over {need} samples. Point "
                    f"estimate epsilon={self.point_epsilon:.6g}")
        return (f"Monte Carlo estimate (not a deterministic bound): (epsilon={self.epsilon:.6g}, "
                f"delta={self.delta:g})-DP holds with probability >= {self.confidence:g} "
                f"(q = {self.failure_probability:g}) over {self.num_samples} samples per "
                f"direction; point estimate epsilon={self.point_epsilon:.6g}")

    def __str__(self):
        return self.statement

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["statement"] = self.statement
        return d


class MonteCarloEpsilon(float):
    """A float (the high-confidence upper ε) that carries its :class:`MonteCarloEstimate` and
    prints its label, so that text output never shows it as a bare guarantee."""

    estimate: MonteCarloEstimate

    def __new__(cls, estimate: MonteCarloEstimate):
        obj = super().__new__(cls, estimate.epsilon)
        obj.estimate = estimate
        return obj

    def _label(self) -> str:
        return (f" [Monte Carlo estimate, holds w.p. >= {self.estimate.confidence:g}; "
                f"not a deterministic bound]")

    def __format__(self, spec):
        return float.__format__(self, spec) + self._label()

    def __str__(self):
        return float.__repr__(self) + self._label()

    def __repr__(self):
        return f"MonteCarloEpsilon({float.__repr__(self)}, q={self.estimate.failure_probability:g})"


# ---------------------------------------------------------------------------------------------
# Sharded, resumable, parallel sample collection
# ---------------------------------------------------------------------------------------------
def _shard_seed(seed: int, direction: str, shard: int) -> np.random.SeedSequence:
    return np.random.SeedSequence(int(seed), spawn_key=(DIRECTIONS.index(direction), int(shard)))


def _run_shard(mech_dict: dict, direction: str, seed: int, shard: int, size: int,
               device: Optional[str]) -> np.ndarray:
    mech = BandMFMonteCarlo.from_dict(mech_dict)
    ss = _shard_seed(seed, direction, shard)
    if device is None:
        return sample_privacy_losses(mech, size, direction, rng=np.random.default_rng(ss))
    return sample_privacy_losses(mech, size, direction, seed=ss, device=device)


def _fingerprint(mech_dict: dict, seed: int, shard_size: int, device: Optional[str]) -> str:
    blob = json.dumps({"mechanism": mech_dict, "seed": int(seed), "shard_size": shard_size,
                       "backend": "numpy" if device is None else "torch"}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _recorded_seed(directory: Optional[str], mech_dict: dict, shard_size: int,
                   device: Optional[str]) -> Optional[int]:
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
    if meta.get("fingerprint") != _fingerprint(mech_dict, seed, shard_size, device):
        return None  # another run: the fingerprint check below refuses the directory
    return seed


def collect_privacy_losses(mechanism: BandMFMonteCarlo, num_samples: int, *,
                           seed: Optional[int] = None,
                           shard_size: int = 16384, shards: Optional[Sequence[int]] = None,
                           workers: Optional[int] = None, directory: Optional[str] = None,
                           progress: bool = False, device: Optional[str] = None
                           ) -> MonteCarloSamples:
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
        device: ``None`` numpy; a torch device string for the torch backend (run inline).
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
    mech_dict = mechanism.to_dict()
    if seed is None:
        seed = _recorded_seed(directory, mech_dict, shard_size, device)
    if seed is None:
        seed = fresh_monte_carlo_seed()
    seed = check_int("seed", seed, minimum=0)
    fp = _fingerprint(mech_dict, seed, shard_size, device)
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        meta_path = os.path.join(directory, "meta.json")
        meta = {"fingerprint": fp, "mechanism": mech_dict, "seed": int(seed),
                "shard_size": shard_size, "backend": "numpy" if device is None else "torch"}
        if os.path.exists(meta_path):
            with open(meta_path) as fh:
                old = json.load(fh)
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
        if workers == 1 or device is not None or len(todo) <= 1:
            for d, k, size, path in todo:
                finish(d, k, path, _run_shard(mech_dict, d, seed, k, size, device))
        else:
            with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
                futs = {pool.submit(_run_shard, mech_dict, d, seed, k, size, None): (d, k, path)
                        for d, k, size, path in todo}
                for fut in concurrent.futures.as_completed(futs):
                    d, k, path = futs[fut]
                    finish(d, k, path, fut.result())
    finally:
        if bar is not None:
            bar.close()
    if shards is not None:
        return None
    per_dir = {d: np.concatenate([results[(d, k)] for k in range(n_shards)]) for d in directions}
    return MonteCarloSamples(per_dir["remove"], per_dir["add"], seed=seed)


# ---------------------------------------------------------------------------------------------
# Algorithm 5: certified calibration
# ---------------------------------------------------------------------------------------------
def sigma_grid(sigma_min: float, sigma_max: float, ratio: float = 1.01) -> np.ndarray:
    """``σ_min·ratio^k`` for ``k = 0, 1, …`` up to ``σ_max`` (ascending; paper: ratio 1.01)."""
    lo = check_positive("sigma_min", sigma_min)
    hi = check_positive("sigma_max", sigma_max)
    r = check_positive("ratio", ratio)
    if r <= 1:
        raise ValueError(f"ratio must be > 1, got {r}")
    if hi < lo:
        raise ValueError(f"sigma_max must be >= sigma_min, got {hi} < {lo}")
    k = int(math.floor(math.log(hi / lo) / math.log(r) + 1e-12))
    return lo * r ** np.arange(k + 1)


@dataclasses.dataclass(frozen=True)
class Fallback:
    """``M_k`` of Algorithm 5: a mechanism with a closed-form ``(ε, δ)`` guarantee.

    Fields: ``noise_multiplier`` (its σ), ``description`` (what is run when it is chosen: the
    same sampler, or cyclic Poisson), ``epsilon`` (its certified ε at ``delta``, closed form or
    PLD, never Monte Carlo) and ``delta``.
    """

    noise_multiplier: float
    description: str
    epsilon: float
    delta: float


def unamplified_fallback(mechanism: BandMFMonteCarlo, epsilon: float, delta: float) -> Fallback:
    r"""The same BandMF + b-min-sep mechanism, certified *without* amplification (digest §4.9).

    Every realisation of ``x`` has at most ``k = ⌈n/b⌉`` participations at gaps ``≥ b ≥ L``,
    so ``‖C(x − x′)‖ ≤ a·√k·max_i‖c_i‖`` with ``a = k_u`` (multi-attribution) or ``a = 3``
    (truncated pair of Corollary D.2, coupled: ``x − y′ ∈ {0, 1, 3}``), else ``a = 1``. By joint
    convexity of the hockey-stick divergence the mechanism is at least as private as the
    Gaussian mechanism with that sensitivity, whose exact profile gives σ (rounded up).
    """
    from .gaussian import gaussian_delta, gdp_mu

    eps = check_positive("epsilon", epsilon)
    dl = check_open_unit("delta", delta)
    st = mechanism.strategy
    if mechanism.sampling != "bminsep":
        raise ValueError("unamplified_fallback is for sampling='bminsep'")
    k = -(-st.n // mechanism.min_sep)
    a = 3.0 if mechanism.truncated_batch_size is not None else float(mechanism.max_user_examples)
    sens = a * math.sqrt(k) * math.sqrt(float(st.squared_norms.max()))
    sigma = sens / gdp_mu(eps, dl) * (1 + 1e-12)
    assert gaussian_delta(eps, sigma, sens) <= dl
    return Fallback(sigma, f"same sampler, unamplified Gaussian bound (sensitivity {sens:.6g})",
                    eps, dl)


def cyclic_poisson_fallback(mechanism: BandMFMonteCarlo, expected_rate: float, epsilon: float,
                            delta: float, *, discretization: float = 1e-4) -> Fallback:
    r"""BandMF with **cyclic Poisson** sampling (cycle ``b``, rate ``q = b·p0``) priced by PLD.

    With ``L ≤ b`` participations in distinct cycles touch disjoint rows, so the mechanism is the
    composition of ``⌈n/b⌉`` Poisson-subsampled Gaussians with noise ``σ/max‖c_i‖`` (digest
    §3.2); σ is calibrated with the pessimistic PLD. Choosing it means training with the
    cyclic-Poisson sampler instead. One example per user only (``max_user_examples = 1``; a user
    with ``k_u`` examples is not priced by this pair, so it raises).
    """
    from .calibration import calibrate_noise_multiplier
    from .mixture import MixturePair
    from .pld import epsilon_for_delta, pld_from_profile, self_compose
    from .profiles import PairProfile

    eps = check_positive("epsilon", epsilon)
    dl = check_open_unit("delta", delta)
    if mechanism.max_user_examples != 1:
        raise ValueError("cyclic_poisson_fallback prices one example per user; with "
                         "max_user_examples > 1 use unamplified_fallback (sensitivity k_u)")
    st, b = mechanism.strategy, mechanism.min_sep
    q = b * check_positive("expected_rate", expected_rate)
    if q > 1:
        raise ValueError(f"cyclic Poisson needs min_sep * expected_rate <= 1, got {q}")
    cmax = math.sqrt(float(st.squared_norms.max()))
    comps = -(-st.n // b)

    def eps_of(sigma):
        pair = MixturePair.from_components([1.0, 0.0], [q, 1.0 - q], [0.0], [1.0], sigma / cmax)
        pld = pld_from_profile(PairProfile(pair), PairProfile(pair.reversed()),
                               discretization=discretization)
        return epsilon_for_delta(self_compose(pld, comps), dl)

    sigma = calibrate_noise_multiplier(eps_of, eps, rtol=1e-3)
    return Fallback(sigma, f"cyclic Poisson (q={q:.6g}, {comps} compositions), PLD",
                    eps_of(sigma), dl)


@dataclasses.dataclass(frozen=True)
class CertifiedCalibration:
    """Result of Algorithm 5 (Theorem A.1).

    The pipeline "verify the candidates with fresh Monte Carlo samples, then train with
    ``noise_multiplier``" is ``(epsilon, overall_delta)``-DP with ``overall_delta ≤
    target_delta`` — a certified guarantee of the randomised procedure (not of the chosen σ in
    isolation) under the theorem's assumptions: candidates ordered by privacy, independent
    verifications, and a fallback with a closed-form guarantee. ``seed`` is the run seed of the
    verifications (recorded for audit); the statement is void if this run was chosen among
    several with different seeds (multiple testing).
    """

    noise_multiplier: float
    fallback_used: bool
    fallback: Fallback
    epsilon: float
    target_delta: float
    base_delta: float
    overall_delta: float
    num_samples: int
    candidates: tuple
    verified: tuple  # (sigma, passed, delta_remove, delta_add) for each verified candidate
    kind: str = "algorithm-5"
    seed: Optional[int] = None  # the run seed the verifications drew from (for audit)

    @property
    def statement(self) -> str:
        how = ("fallback: " + self.fallback.description) if self.fallback_used else \
            "Monte Carlo verified candidate"
        return (f"Algorithm 5 (Theorem A.1, Dong & Ganesh 2026): the pipeline is "
                f"(epsilon={self.epsilon:g}, delta={self.overall_delta:.4g})-DP with "
                f"noise_multiplier={self.noise_multiplier:.6g} ({how}; base delta "
                f"{self.base_delta:.4g}, {self.num_samples} fresh samples per direction and "
                f"candidate" + ("" if self.seed is None else f", Monte Carlo seed {self.seed}")
                + ")")


def verify_candidate(mechanism: BandMFMonteCarlo, epsilon: float, base_delta_: float,
                     num_samples: int, *, seed: int, workers: int = 1,
                     shard_size: int = 16384, device: Optional[str] = None,
                     directory: Optional[str] = None) -> tuple[bool, float, float]:
    """Verifier ``V(M)``: 1 iff ``δ̃_P(ε) ≤ δ′`` and ``δ̃_Q(ε) ≤ δ′`` on fresh samples."""
    samples = collect_privacy_losses(mechanism, num_samples, seed=seed, workers=workers,
                                     shard_size=shard_size, device=device, directory=directory)
    dr = empirical_delta(samples.remove, epsilon)
    da = empirical_delta(samples.add, epsilon)
    return (dr <= base_delta_ and da <= base_delta_), dr, da


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
                             workers: int = 1, shard_size: int = 16384,
                             device: Optional[str] = None, directory: Optional[str] = None,
                             progress: Optional[Callable[[float, bool], None]] = None
                             ) -> CertifiedCalibration:
    r"""Algorithm 5: the smallest verified σ on a ``ratio`` grid, else the fallback.

    Candidates ``σ_min·ratio^k < σ_max`` (default ``σ_max`` = the fallback's σ) are verified from
    the largest down; the first failure stops the scan (``i*`` depends only on the verifications
    above it, so this equals verifying all). Candidate ``k`` uses seed
    ``SeedSequence(seed, (k,))`` — fresh, independent samples per candidate (footnote 12).

    Args:
        mechanism: the mechanism (its σ is replaced by each candidate).
        epsilon, target_delta: the certified target ``(ε, δ_t)``.
        num_samples: samples per direction and candidate; default :func:`minimum_samples`
            ``(δ′, δ_t)``. Must satisfy ``overall_delta(s, δ′) ≤ δ_t``.
        base_delta_: ``δ′``; default ``δ_t/2`` (the paper's recipe), or :func:`base_delta`
            ``(s, δ_t)`` when ``num_samples`` is given.
        fallback: ``M_k``; default :func:`unamplified_fallback` at ``(ε, δ′)``.
        seed: run seed of the verifications; ``None`` (default): the seed recorded in
            ``directory`` when resuming there, else fresh OS entropy. Returned as
            ``result.seed``. Run the certification **once**: re-running after a failed check
            with another seed and keeping the better outcome is multiple testing and voids
            Theorem A.1's guarantee. A directory refuses a different seed for the same reason.
    """
    eps = check_positive("epsilon", epsilon)
    dt = check_open_unit("target_delta", target_delta)
    if base_delta_ is None:
        dp = dt / 2 if num_samples is None else base_delta(num_samples, dt)
    else:
        dp = check_open_unit("base_delta", base_delta_)
    s = minimum_samples(dp, dt) if num_samples is None else check_int("num_samples", num_samples,
                                                                      minimum=1)
    od = overall_delta(s, dp)
    if od > dt:
        raise ValueError(f"num_samples={s} with base_delta={dp:g} certifies only delta={od:.4g} "
                         f"> target_delta={dt:g}; need num_samples >= {minimum_samples(dp, dt)}")
    fb = fallback if fallback is not None else unamplified_fallback(mechanism, eps, dp)
    if fb.epsilon > eps or fb.delta > dp:
        raise ValueError(f"the fallback must be ({eps:g}, delta)-DP with delta <= base_delta="
                         f"{dp:.4g} (Theorem A.1 (b)); got ({fb.epsilon:g}, {fb.delta:g})")
    hi = fb.noise_multiplier if sigma_max is None else check_positive("sigma_max", sigma_max)
    seed = _certification_seed(directory, seed)
    grid = sigma_grid(sigma_min, hi, ratio)
    grid = grid[grid < hi] if sigma_max is None else grid
    verified = []
    chosen, used_fallback = fb.noise_multiplier, True
    for k in range(len(grid) - 1, -1, -1):
        sig = float(grid[k])
        sub = None if directory is None else os.path.join(directory, f"candidate-{k}")
        ok, dr, da = verify_candidate(
            mechanism.with_noise(sig), eps, dp, s,
            seed=int(np.random.SeedSequence(int(seed), spawn_key=(k,)).generate_state(1)[0]),
            workers=workers, shard_size=shard_size, device=device, directory=sub)
        verified.append((sig, bool(ok), dr, da))
        if progress is not None:
            progress(sig, bool(ok))
        if not ok:
            break
        chosen, used_fallback = sig, False
    return CertifiedCalibration(
        noise_multiplier=float(chosen), fallback_used=used_fallback, fallback=fb, epsilon=eps,
        target_delta=dt, base_delta=dp, overall_delta=od, num_samples=s,
        candidates=tuple(float(g) for g in grid), verified=tuple(verified), seed=seed)
