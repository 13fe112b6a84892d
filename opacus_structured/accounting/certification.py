r"""Algorithm 5 (Estimate-Verify-Release without empty outputs): the statistics, no sampling.

Dong & Ganesh, "Privacy Amplification for BandMF via b-Min-Sep Subsampling" (arXiv:2602.09338),
Appendix A, Algorithm 5 and Theorem A.1. Candidates ``M_1, …, M_{k−1}`` (noise multipliers on
a grid of powers of 1.01, least private first) and a fallback ``M_k`` with a closed-form
``(ε, δ)`` guarantee. Verify each ``M_i`` with fresh samples (``v_i = 1`` iff both directions'
``δ̃ ≤ δ′``) and run ``M_{i*}``, ``i* = min{i : v_j = 1 ∀ j ≥ i}``. If every
non-``(ε, δ)``-DP candidate passes with probability ``< q`` and the verifications use
independent randomness (footnote 12), the pipeline is ``(ε, δ + q(1 − δ))``-DP; the sample
counts come from :func:`~.monte_carlo.overall_delta` / :func:`~.monte_carlo.minimum_samples`.

This module holds what the theorem needs to be true: the candidate grid
(:func:`sigma_grid`), the fallbacks (:func:`unamplified_fallback`,
:func:`cyclic_poisson_fallback`), the choice of ``δ′`` and ``s`` with its checks
(:func:`plan_certification`), the verifier's decision on given samples (:func:`passes`), the
independent per-candidate seeds (:func:`candidate_seed`) and the scan that picks ``i*``
(:func:`run_algorithm5`). Drawing the samples — a process pool, shards on disk, a seed
recorded in a directory — is :func:`opacus_structured.runners.monte_carlo.certify_noise_multiplier`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import numpy as np

from .._validation import check_int, check_open_unit, check_positive
from .bminsep_mc import BandMFMonteCarlo
from .calibration import calibrate_noise_multiplier
from .gaussian import gaussian_delta, gdp_mu
from .mixture import MixturePair
from .monte_carlo import (
    MonteCarloSamples,
    base_delta,
    empirical_delta,
    minimum_samples,
    overall_delta,
)
from .pld import epsilon_for_delta, pld_from_profile, self_compose
from .profiles import PairProfile

__all__ = [
    "sigma_grid",
    "Fallback",
    "unamplified_fallback",
    "cyclic_poisson_fallback",
    "CertificationPlan",
    "plan_certification",
    "candidate_seed",
    "passes",
    "CertifiedCalibration",
    "run_algorithm5",
]


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
    r"""The same BandMF + b-min-sep mechanism, certified *without* amplification.

    Every realisation of ``x`` has at most ``k = ⌈n/b⌉`` participations at gaps ``≥ b ≥ L``,
    so ``‖C(x − x′)‖ ≤ a·√k·max_i‖c_i‖`` with ``a = k_u`` (multi-attribution, Theorem 6.1) or
    ``a = 3`` (the truncated pair of Corollary D.2, coupled: ``x − y′ ∈ {0, 1, 3}``), else
    ``a = 1``. By joint convexity of the hockey-stick divergence the mechanism is at least as
    private as the Gaussian mechanism with that sensitivity, whose exact profile gives σ
    (rounded up).
    """
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
    composition of ``⌈n/b⌉`` Poisson-subsampled Gaussians with noise ``σ/max‖c_i‖``
    (Choquette-Choo et al., "(Amplified) banded matrix factorization", NeurIPS 2023; the
    comparison of §4.1 of arXiv:2602.09338); σ is calibrated with the pessimistic PLD. Choosing
    it means training with the cyclic-Poisson sampler instead. One example per user only
    (``max_user_examples = 1``; a user with ``k_u`` examples is not priced by this pair, so it
    raises).
    """
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
class CertificationPlan:
    """What Algorithm 5 verifies, fixed before any sample is drawn (:func:`plan_certification`).

    ``candidates`` are the noise multipliers ``M_1, …, M_{k−1}`` (ascending); ``fallback`` is
    ``M_k``; each candidate is verified with ``num_samples`` fresh samples per direction at
    ``base_delta`` (``δ′``), which makes the pipeline ``(epsilon, overall_delta)``-DP with
    ``overall_delta ≤ target_delta``.
    """

    epsilon: float
    target_delta: float
    base_delta: float
    num_samples: int
    overall_delta: float
    fallback: Fallback
    candidates: tuple


def plan_certification(mechanism: BandMFMonteCarlo, epsilon: float, target_delta: float, *,
                       sigma_min: float, sigma_max: Optional[float] = None,
                       ratio: float = 1.01, num_samples: Optional[int] = None,
                       base_delta_: Optional[float] = None,
                       fallback: Optional[Fallback] = None) -> CertificationPlan:
    r"""``δ′``, ``s``, the fallback and the candidate grid of Algorithm 5, checked.

    Candidates are ``σ_min·ratio^k < σ_max`` (default ``σ_max`` = the fallback's σ; an
    explicit ``σ_max`` is included when on the grid).

    Args:
        mechanism: the mechanism (its σ is replaced by each candidate).
        epsilon, target_delta: the certified target ``(ε, δ_t)``.
        num_samples: samples per direction and candidate; default
            :func:`~.monte_carlo.minimum_samples` ``(δ′, δ_t)``. Must satisfy
            ``overall_delta(s, δ′) ≤ δ_t``.
        base_delta_: ``δ′``; default ``δ_t/2`` (the paper's recipe), or
            :func:`~.monte_carlo.base_delta` ``(s, δ_t)`` when ``num_samples`` is given.
        fallback: ``M_k``; default :func:`unamplified_fallback` at ``(ε, δ′)``. It must be
            ``(ε, δ)``-DP with ``δ ≤ δ′`` (Theorem A.1 (b)).
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
    grid = sigma_grid(sigma_min, hi, ratio)
    grid = grid[grid < hi] if sigma_max is None else grid
    return CertificationPlan(epsilon=eps, target_delta=dt, base_delta=dp, num_samples=s,
                             overall_delta=od, fallback=fb,
                             candidates=tuple(float(g) for g in grid))


def candidate_seed(seed: int, k: int) -> int:
    """The seed of candidate ``k``'s verification: ``SeedSequence(seed, (k,))`` — fresh,
    independent samples per candidate, as Theorem A.1 requires (footnote 12)."""
    return int(np.random.SeedSequence(int(seed), spawn_key=(int(k),)).generate_state(1)[0])


def passes(samples: MonteCarloSamples, epsilon: float,
           base_delta_: float) -> tuple[bool, float, float]:
    """Verifier ``V(M)`` on drawn samples: ``(ok, δ̃_P(ε), δ̃_Q(ε))``, ``ok`` iff both are
    ``≤ δ′``."""
    dr = empirical_delta(samples.remove, epsilon)
    da = empirical_delta(samples.add, epsilon)
    return (dr <= base_delta_ and da <= base_delta_), dr, da


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


def run_algorithm5(plan: CertificationPlan,
                   verify: Callable[[int, float], tuple[bool, float, float]], *, seed: int,
                   progress: Optional[Callable[[float, bool], None]] = None
                   ) -> CertifiedCalibration:
    r"""Algorithm 5's scan: the smallest verified σ of ``plan.candidates``, else the fallback.

    ``verify(k, sigma)`` verifies candidate ``k`` (σ = ``plan.candidates[k]``) with
    ``plan.num_samples`` fresh samples per direction drawn from :func:`candidate_seed`
    ``(seed, k)`` and returns :func:`passes`' ``(ok, δ̃_P, δ̃_Q)``. Candidates are verified
    from the largest down and the first failure stops the scan: ``i*`` depends only on the
    verifications above it, so this equals verifying all. ``progress(sigma, ok)`` is called
    after each verification.
    """
    verified = []
    chosen, used_fallback = plan.fallback.noise_multiplier, True
    for k in range(len(plan.candidates) - 1, -1, -1):
        sig = plan.candidates[k]
        ok, dr, da = verify(k, sig)
        verified.append((sig, bool(ok), dr, da))
        if progress is not None:
            progress(sig, bool(ok))
        if not ok:
            break
        chosen, used_fallback = sig, False
    return CertifiedCalibration(
        noise_multiplier=float(chosen), fallback_used=used_fallback, fallback=plan.fallback,
        epsilon=plan.epsilon, target_delta=plan.target_delta, base_delta=plan.base_delta,
        overall_delta=plan.overall_delta, num_samples=plan.num_samples,
        candidates=plan.candidates, verified=tuple(verified), seed=int(seed))
