r"""Monte Carlo δ estimation and its confidence bounds: the math, torch-free and process-free.

Dong & Ganesh, "Privacy Amplification for BandMF via b-Min-Sep Subsampling" (arXiv:2602.09338),
§2.5 and Appendix A; the KL–Chernoff–Hoeffding bound is Fact 4.2 of Chua et al., "Balls-and-bins
sampling for DP-SGD" (arXiv:2412.16802). Drawing the samples (process pool, shards on disk,
resume, the torch backend) is :mod:`opacus_structured.runners.monte_carlo`; Algorithm 5 is
:mod:`.certification`.

**Estimate.** With privacy-loss samples ``L_j = ln(P/Q)(y_j)``, ``y_j ~ P`` i.i.d.,

.. math::  \tilde\delta_P(\varepsilon) = \frac1s\sum_j \max\{0, 1 - e^{\varepsilon - L_j}\}

is unbiased for ``H_{e^ε}(P‖Q)``; the add direction uses ``y ~ Q`` and ``ln(Q/P)``. Both are
needed (δ = max of the two). Each term lies in ``[0, 1]``.

**Confidence.** For a mean of ``s`` i.i.d. ``[0,1]`` variables with mean ``δ > δ′``,
``Pr[δ̃ ≤ δ′] ≤ q(δ, δ′, s) = exp(−s·KL(δ′‖δ))`` (Chernoff–Hoeffding, KL form). Inverting it
gives the upper confidence bound :func:`delta_upper_confidence`. A :class:`MonteCarloEstimate`
states its result as "Monte Carlo, holds with probability ≥ 1 − q": **it is not a
deterministic bound** (its kind is :attr:`BoundKind.MONTE_CARLO
<opacus_structured.accounting.bounds.BoundKind.MONTE_CARLO>`) and is never returned where a
guarantee is asked for.

**Sample counts of Algorithm 5.** Theorem A.1 makes the verify-then-train pipeline
``(ε, δ + q(δ, δ′, s)(1 − δ))``-DP. With ``δ = τδ′``:
``δ_o(δ′, s) = min_{τ ≥ 1} τδ′ + q(τδ′, δ′, s)(1 − τδ′)`` (:func:`overall_delta`), and
:func:`base_delta` / :func:`minimum_samples` solve ``δ_o ≤ δ_t`` for ``δ′`` or ``s``.

**Seeds.** A :class:`MonteCarloSamples` and the :class:`MonteCarloEstimate` made from it carry
the run seed the samples were drawn with, so that an auditor can recompute them; a Monte Carlo
seed is not a privacy secret. What voids the stated confidence is *choosing* among seeds:
re-running a check that failed (or an estimate that came out too high) with another seed and
keeping the better result is multiple testing, and the "probability ≥ 1 − q" no longer holds.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Optional

import numpy as np
from scipy import optimize

from .._validation import check_int, check_nonnegative, check_open_unit
from .bounds import BoundKind
from .calibration import smallest_passing, smallest_passing_int

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "EXECUTORS",
    "fresh_monte_carlo_seed",
    "MonteCarloSettings",
    "kl_bernoulli",
    "hoeffding_failure_probability",
    "overall_delta",
    "base_delta",
    "minimum_samples",
    "empirical_delta",
    "empirical_epsilon",
    "delta_upper_confidence",
    "delta_upper_confidence_second_moment",
    "DELTA_BOUND_METHODS",
    "MonteCarloSamples",
    "MonteCarloEstimate",
    "MonteCarloEpsilon",
]


# ---------------------------------------------------------------------------------------------
# Tail bounds and the δ_t / δ′ / s relations (Appendix A)
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
    """Smallest ``s`` with :func:`overall_delta` ``(s, δ′) ≤ δ_t`` (binary search; Appendix A
    of Dong & Ganesh, arXiv:2602.09338, with its recipe ``δ′ = δ_t/2``: ``δ_t = 1e-3`` needs
    ``s ≈ 7.50e4`` samples per direction and candidate).
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
    return smallest_passing(lambda eps: delta_of_eps(eps) <= delta, lo, hi,
                            lambda lo_, hi_: hi_ - lo_ > 1e-9 * max(1.0, hi_))


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


def delta_upper_confidence_second_moment(terms, failure_probability: float) -> float:
    r"""Second-moment upper confidence bound on the mean of i.i.d. ``[0, 1]`` terms.

    For non-negative independent ``X_j`` (Maurer 2003, "A bound on the deviation probability
    for sums of non-negative random variables"):
    ``Pr[μ − X̄ ≥ t] ≤ exp(−s t²/(2 E[X²]))``. With ``m₂⁺`` the KL upper confidence bound
    (:func:`delta_upper_confidence`) on ``E[X²]`` at ``β/2`` (``X² ∈ [0, 1]``), the union bound
    gives, with probability ``≥ 1 − β``,

    .. math::  μ ≤ \bar X + \sqrt{2 m_2^+ \ln(2/β) / s}.

    The KL bound's variance proxy at small ``μ`` is ``μ`` itself (``KL(a‖μ) ≥ (μ−a)²/(2μ)``);
    this one's is ``E[X²] ≤ μ``, much smaller when the terms ``max(0, 1 − e^{ε−L})`` are mostly
    well below 1 — then it needs fewer samples for the same confidence (it pays ``ln(2/β)``
    instead of ``ln(1/β)`` and the slack of ``m₂⁺``).
    """
    x = np.asarray(terms, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"terms must be a non-empty 1-D array, got shape {x.shape}")
    if np.any(x < 0) or np.any(x > 1) or np.any(np.isnan(x)):
        raise ValueError("terms must lie in [0, 1]")
    beta = check_open_unit("failure_probability", failure_probability)
    s = x.size
    m2_up = delta_upper_confidence(float(np.mean(x * x)), s, beta / 2)
    bound = float(np.mean(x)) + math.sqrt(2.0 * m2_up * math.log(2.0 / beta) / s)
    return float(min(1.0, bound * (1 + 1e-12)))


def _delta_terms(losses: np.ndarray, epsilon: float) -> np.ndarray:
    """``max(0, 1 − e^{ε−L})`` per sample (the terms of :func:`empirical_delta`)."""
    return -np.expm1(np.minimum(float(epsilon) - losses, 0.0))


#: Confidence bounds on δ(ε) from samples (:meth:`MonteCarloSamples.estimate_delta`).
DELTA_BOUND_METHODS = ("kl", "second-moment")


@dataclasses.dataclass
class MonteCarloSamples:
    """Privacy-loss samples per direction (``"remove"``: ln P/Q under P; ``"add"``: ln Q/P
    under Q). Merge with ``+`` (concatenation: exact). ``seed`` is the run seed they were drawn
    with (:func:`opacus_structured.runners.monte_carlo.collect_privacy_losses`; ``None`` for
    merged or hand-made samples)."""

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
            num_samples=self.num_samples, failure_probability=q, seed=self.seed)

    def estimate_delta(self, epsilon: float, failure_probability: float = 1e-3,
                       method: str = "kl") -> dict:
        """δ at ``epsilon``: point estimates per direction and the confidence upper bound
        (``q/2`` per direction). ``method="kl"``: :func:`delta_upper_confidence`;
        ``"second-moment"``: :func:`delta_upper_confidence_second_moment` (fewer samples when
        the terms' second moment is well below their mean). Either holds with probability
        ``≥ 1 − q`` over the samples: a Monte Carlo bound, not a deterministic one."""
        q = check_open_unit("failure_probability", failure_probability)
        if method not in DELTA_BOUND_METHODS:
            raise ValueError(f"method must be one of {DELTA_BOUND_METHODS}, got {method!r}")
        dr, da = empirical_delta(self.remove, epsilon), empirical_delta(self.add, epsilon)
        if method == "kl":
            up = max(delta_upper_confidence(dr, self.remove.size, q / 2),
                     delta_upper_confidence(da, self.add.size, q / 2))
        else:
            up = max(delta_upper_confidence_second_moment(_delta_terms(self.remove, epsilon), q / 2),
                     delta_upper_confidence_second_moment(_delta_terms(self.add, epsilon), q / 2))
        return {"kind": BoundKind.MONTE_CARLO, "epsilon": float(epsilon), "delta_remove": dr,
                "delta_add": da, "delta_point": max(dr, da), "delta_upper": up,
                "failure_probability": q, "num_samples": self.num_samples, "method": method}


@dataclasses.dataclass(frozen=True)
class MonteCarloEstimate:
    """A Monte Carlo privacy estimate: **holds with probability ≥ 1 − q, not a deterministic
    bound**.

    Fields: ``epsilon`` is the high-confidence upper estimate: with probability ≥ ``1 − q``
    over the samples, the mechanism is ``(epsilon, delta)``-DP (KL upper confidence bound of
    both directions' δ̃, ``q/2`` each; valid at a data-dependent ε because δ̃ and its bound are
    monotone in ε). ``point_epsilon`` is the plain estimate (``δ̃(ε) = δ``), with no confidence
    statement. ``delta_remove`` / ``delta_add`` are δ̃ of each direction at ``epsilon``;
    ``num_samples`` is per direction; ``failure_probability`` is ``q``; ``seed`` is the run
    seed of the samples (``None`` when unknown), recorded so that the estimate can be audited.
    """

    epsilon: float
    delta: float
    point_epsilon: float
    delta_remove: float
    delta_add: float
    num_samples: int
    failure_probability: float
    kind: BoundKind = BoundKind.MONTE_CARLO
    seed: Optional[int] = None

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
# Run settings (a record; the runner registered for the scheme executes a run with them)
# ---------------------------------------------------------------------------------------------
#: Samples per shard unless set (a run's samples depend on it: resume with the same value).
DEFAULT_SHARD_SIZE = 16384


def fresh_monte_carlo_seed() -> int:
    """A 63-bit seed from the OS entropy pool: the default of every Monte Carlo check (a fixed
    default seed would invite re-running a failed check with "another" seed)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


# ---------------------------------------------------------------------------------------------
# Run settings
# ---------------------------------------------------------------------------------------------
#: Where a run's shards execute (:attr:`MonteCarloSettings.executor`).
EXECUTORS = ("process", "dask")


@dataclasses.dataclass(frozen=True)
class MonteCarloSettings:
    """How a Monte Carlo run is made — not what it measures.

    A :class:`~opacus_structured.schemes.bminsep_mc.BMinSepMonteCarloScheme` describes the
    mechanism (its batches and its noise); these settings describe a run that estimates its ε.
    They are passed to ``scheme.estimate`` / ``epsilon`` / ``delta`` / ``certify`` and to the
    accountant (``BMinSepMonteCarloAccountant(scheme, settings=...)``), whose ``state_dict``
    records them with the seed actually used. A plain record: the runner registered for the
    scheme (:mod:`opacus_structured.runners.monte_carlo`) executes a run with them.

    Args:
        samples: Monte Carlo samples per direction.
        seed: run seed; ``None`` (default): fresh OS entropy, drawn by :meth:`resolved` when a
            run starts and recorded in its result. Do not re-run with new seeds until an
            estimate or a certification looks good: picking among seeds voids the confidence
            (multiple testing).
        failure_probability: ``q`` of the high-confidence upper estimate (it holds with
            probability ``≥ 1 − q``). The confidence belongs to the run, not to the scheme:
            the mechanism has one true ε, and ``samples``, ``seed`` and ``q`` only say how well
            a run pins it down; two runs of one scheme at different ``q`` train on the same
            batches with the same noise. Algorithm 5 does not use it (its ``q`` follows from
            ``δ′`` and the sample count, Theorem A.1).
        workers: processes (``None``: all cores; 1: inline).
        device: ``None`` (numpy) or a torch device for the torch backend (run inline).
        progress: show a progress bar over the shards.
        shard_size: samples per shard (the samples of a seed depend on it).
        executor: ``"process"`` (default: a local process pool of ``workers``) or ``"dask"``
            (the shards run as tasks on a Dask cluster; needs the ``cluster`` extra). Never
            changes a result.
        scheduler: the Dask scheduler address (``"tcp://host:8786"``) for
            ``executor="dask"``; ``None`` starts a local cluster of ``workers`` processes.
    """

    samples: int = 100_000
    seed: Optional[int] = None
    failure_probability: float = 1e-3
    workers: Optional[int] = None
    device: Optional[str] = None
    progress: bool = False
    shard_size: int = DEFAULT_SHARD_SIZE
    executor: str = "process"
    scheduler: Optional[str] = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("samples", check_int("samples", self.samples, minimum=1))
        if self.seed is not None:
            set_("seed", check_int("seed", self.seed, minimum=0))
        set_("failure_probability",
             check_open_unit("failure_probability", self.failure_probability))
        if self.workers is not None:
            set_("workers", check_int("workers", self.workers, minimum=1))
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise ValueError(f"device must be None (numpy) or a torch device string such as "
                             f"'cpu' or 'cuda:0', got {self.device!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"progress must be a bool, got {self.progress!r}")
        set_("shard_size", check_int("shard_size", self.shard_size, minimum=1))
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.scheduler is not None and (self.executor != "dask"
                                           or not isinstance(self.scheduler, str)
                                           or not self.scheduler):
            raise ValueError(f"scheduler must be a Dask scheduler address string and needs "
                             f"executor='dask', got {self.scheduler!r}")

    @property
    def backend(self) -> str:
        """``"numpy"``, ``"torch-cpu"`` or ``"torch-cuda"``: backends draw different streams
        from one seed, so a run resumes exactly only on the same one."""
        return "numpy" if self.device is None else "torch-" + self.device.split(":")[0]

    def resolved(self) -> "MonteCarloSettings":
        """These settings with a concrete seed (a fresh one from OS entropy if ``seed`` is
        ``None``): what a run uses and records."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=fresh_monte_carlo_seed())

    def differences(self, other: "MonteCarloSettings") -> list[str]:
        """The settings that make ``other``'s results differ from these (``samples``, ``seed``,
        ``failure_probability``, ``shard_size``, the backend); ``workers``, ``progress``,
        ``executor`` and ``scheduler`` never change a result."""
        out = [name for name in ("samples", "seed", "failure_probability", "shard_size")
               if getattr(self, name) != getattr(other, name)]
        if self.backend != other.backend:
            out.append("device")
        return out

    # ---- serialisation and command line ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MonteCarloSettings":
        return cls(**dict(data))

    @staticmethod
    def add_cli_arguments(parser) -> None:
        """``--samples``, ``--seed``, ``--confidence-failure``, ``--workers``, ``--device``."""
        default = MonteCarloSettings()
        parser.add_argument("--samples", type=int, default=default.samples, metavar="S",
                            help="Monte Carlo samples per direction (default %(default)s)")
        parser.add_argument("--seed", type=int, default=None,
                            help="Monte Carlo seed (default: fresh OS entropy; the seed used "
                                 "is printed/recorded for audit). Never re-run a failed check "
                                 "or a disappointing estimate with another seed: choosing "
                                 "among seeds voids the confidence (multiple testing)")
        parser.add_argument("--confidence-failure", type=float,
                            default=default.failure_probability, metavar="q",
                            help="failure probability q of the Monte Carlo upper estimate")
        parser.add_argument("--workers", type=int, default=None,
                            help="worker processes (default: all cores; 1: inline)")
        parser.add_argument("--device", default=None, help="torch device (e.g. cuda)")
        parser.add_argument("--executor", choices=EXECUTORS, default="process",
                            help="where the shards run: a local process pool (default) or a "
                                 "Dask cluster (pip install \"opacus-structured[cluster]\")")
        parser.add_argument("--scheduler", default=None, metavar="ADDRESS",
                            help="Dask scheduler address for --executor dask (e.g. "
                                 "tcp://host:8786; default: a local cluster of --workers)")

    @classmethod
    def from_cli_args(cls, args) -> "MonteCarloSettings":
        """From the flags of :meth:`add_cli_arguments` (and ``--shard-size`` / ``--progress``
        where a command has them)."""
        return cls(samples=args.samples, seed=args.seed,
                   failure_probability=args.confidence_failure, workers=args.workers,
                   device=args.device, progress=bool(getattr(args, "progress", False)),
                   shard_size=getattr(args, "shard_size", DEFAULT_SHARD_SIZE),
                   executor=getattr(args, "executor", "process"),
                   scheduler=getattr(args, "scheduler", None))
