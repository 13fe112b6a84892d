r"""Auditing a tuned procedure (issue 40): a canary attack on private selection, in numpy.

A *tuned procedure* runs several DP trials and releases only the best one. Reporting the
winner's ε alone under-reports (Papernot & Steinke, "Hyperparameter tuning with Rényi
differential privacy", ICLR 2022, Section 2): which trial wins depends on the data through
every trial. This module measures that leak on a small synthetic problem where every
repetition costs microseconds, so that 10^5–10^6 repetitions per side are cheap.

**The trial** (:class:`GaussianTrial`): a 1-d "training run" of ``steps`` steps; at each step
the canary (gradient +1, clipped at 1; the other records contribute a public constant, taken
as 0) is sampled with probability ``sample_rate`` (Poisson subsampling; 1: every step) and
Gaussian noise of standard deviation ``noise_multiplier`` is added. The run releases the sum
:math:`\theta = B + \sigma\sqrt T Z`, :math:`B \sim \mathrm{Bin}(T, q)` with the canary and
:math:`B = 0` without it. Its score is either :math:`\theta` itself (``score_noise_multiplier
=None``: the score is a post-processing of the run, e.g. computed on public data; the trial
costs the run alone) or a private validation score :math:`s = \theta + c + \sigma_s Z'`, where
the canary (:math:`c = 1` present, 0 absent) also sits in the validation split (the trial is
the run composed with a Gaussian mechanism of noise multiplier :math:`\sigma_s`, as
:func:`~opacus_structured.tuning.private_score` composes it). :meth:`GaussianTrial.event` is
the trial's dp_accounting event.

**The search** (:class:`TrialCount`): draws :math:`K` trials (a fixed number, or secretly from
the truncated negative binomial / Poisson law that :class:`~opacus_structured.tuning.
PrivateSelection` draws, by the same inverse CDF as
:func:`~opacus_structured.tuning.draw_num_trials`), runs them independently and releases the
winner's :math:`(\theta, s)`: the highest score (nothing at all when the Poisson law draws
:math:`K = 0`).

**The attack** is the likelihood-ratio (Neyman–Pearson) test of the released pair, which the
attacker can compute exactly: with :math:`f_c` the density of one trial's :math:`(\theta, s)`,
:math:`F_c` the CDF of its score and :math:`G` the probability generating function of
:math:`K`, the winner's pair has density

.. math::

    \sum_k \Pr[K = k]\, k\, f_c(\theta, s)\, F_c(s)^{k-1} = f_c(\theta, s)\, G'(F_c(s)),

so the score is :math:`\log f_1 - \log f_0 + \log G'(F_1(s)) - \log G'(F_0(s))`. The second
term is the selection's leak: for a fixed :math:`K` it is :math:`(K-1)\log(F_1/F_0)`, which
makes the event "every trial scored low" :math:`K` times more telling than in one trial;
for the truncated negative binomial it is :math:`-(1+\eta)\log\frac{\gamma + (1-\gamma)S_1}
{\gamma + (1-\gamma) S_0}` (:math:`S = 1 - F`), bounded by :math:`(1+\eta)\log(1/\gamma)`.
The canary is present in the "with" runs (raising the run and the score of every trial),
absent in the "without" runs (add/remove neighbours, what dp_accounting's events price).

**The bound**: the package's Clopper–Pearson estimator
(:func:`~opacus_structured.audit.estimators.epsilon_lower_bound`, thresholds chosen on the
data with its simultaneous bands) turns the scores into an ε **lower bound** at the stated
confidence. :func:`audit_selection` sets it against the ε the procedure reports: the whole
search's :func:`~opacus_structured.tuning.selection_epsilon` for a random :math:`K` (which
the bound must never exceed), the *winner's* ε (one trial) for a fixed :math:`K` that reports
only the winner (which the attack can exceed), and a valid upper bound for both (the
selection's ε; for a fixed :math:`K`, the :math:`K` trials composed, since the winner is a
post-processing of all of them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy import special, stats

from .._validation import check_int, check_open_unit, check_positive, check_probability
from ..accounting import private_selection as ps
from ..accounting.gaussian import gdp_epsilon
from ..tuning import PureDpTrial, selection_epsilon
from .estimators import AuditScores, EpsilonLowerBound, _cp_epsilons, _rates_counts

__all__ = ["GaussianTrial", "LaplaceTrial", "TrialCount", "SelectionAudit", "simulate_search",
           "attack_scores", "audit_selection", "draw_trial_counts"]

#: PLD grid of the ε of a Poisson-subsampled trial (dp_accounting's pessimistic estimate).
PLD_DISCRETIZATION = 1e-4
#: Trials simulated at once (memory: a few arrays of this many float64).
CHUNK_TRIALS = 1 << 21


# ---- the trial ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GaussianTrial:
    """One trial: a 1-d run of ``steps`` Poisson-subsampled Gaussian steps and its score
    (module docstring). ``score_noise_multiplier=None``: the score is the run's output."""

    noise_multiplier: float
    steps: int = 1
    sample_rate: float = 1.0
    score_noise_multiplier: Optional[float] = None

    def __post_init__(self):
        object.__setattr__(self, "noise_multiplier",
                           check_positive("noise_multiplier", self.noise_multiplier))
        object.__setattr__(self, "steps", check_int("steps", self.steps, minimum=1))
        object.__setattr__(self, "sample_rate",
                           check_probability("sample_rate", self.sample_rate))
        if self.score_noise_multiplier is not None:
            object.__setattr__(self, "score_noise_multiplier",
                               check_positive("score_noise_multiplier",
                                              self.score_noise_multiplier))

    # ---- pricing ----
    def event(self) -> dp_event.DpEvent:
        """The trial's dp_accounting event: the run's steps, then the score's Gaussian."""
        step: dp_event.DpEvent = dp_event.GaussianDpEvent(self.noise_multiplier)
        if self.sample_rate < 1:
            step = dp_event.PoissonSampledDpEvent(self.sample_rate, step)
        run = dp_event.SelfComposedDpEvent(step, self.steps)
        if self.score_noise_multiplier is None:
            return run
        return dp_event.ComposedDpEvent([run, dp_event.GaussianDpEvent(
            self.score_noise_multiplier)])

    def pricing(self) -> dp_event.DpEvent:
        """What :func:`~opacus_structured.tuning.selection_epsilon` prices: :meth:`event`."""
        return self.event()

    def describe(self) -> str:
        run = f"Gaussian run (sigma={self.noise_multiplier:.4g}"
        if self.steps > 1 or self.sample_rate < 1:
            run += f", {self.steps} steps at q={self.sample_rate:g}"
        run += ")"
        if self.score_noise_multiplier is None:
            return f"{run}, score = its output"
        return f"{run} + private score (sigma={self.score_noise_multiplier:.4g})"

    def _mu(self) -> float:
        """GDP parameter of the trial when every release is an unsubsampled Gaussian."""
        mu2 = self.steps / self.noise_multiplier ** 2
        if self.score_noise_multiplier is not None:
            mu2 += 1 / self.score_noise_multiplier ** 2
        return math.sqrt(mu2)

    def epsilon(self, delta: float, trials: int = 1) -> float:
        """ε(δ) of ``trials`` of these trials composed (1: the winner's own ε): exact
        (μ-GDP) without subsampling, else dp_accounting's pessimistic PLD (an upper bound)."""
        delta = check_open_unit("delta", delta)
        trials = check_int("trials", trials, minimum=1)
        if self.sample_rate == 1:
            return gdp_epsilon(delta, math.sqrt(trials) * self._mu())
        acc = pld_privacy_accountant.PLDAccountant(
            value_discretization_interval=PLD_DISCRETIZATION)
        return float(acc.compose(self.event(), trials).get_epsilon(delta))

    # ---- sampling and densities ----
    def sample(self, present: bool, n: int, rng: np.random.Generator):
        """``n`` independent trials with the canary present or absent: ``(theta, score)``."""
        tau = self.noise_multiplier * math.sqrt(self.steps)
        theta = tau * rng.standard_normal(n)
        if present:
            theta += rng.binomial(self.steps, self.sample_rate, n)
        if self.score_noise_multiplier is None:
            return theta, theta
        score = theta + self.score_noise_multiplier * rng.standard_normal(n)
        if present:
            score += 1.0
        return theta, score

    def _components(self, present: bool):
        """``(means of θ, log weights)`` of the mixture over the canary's count B."""
        if not present:
            return np.zeros(1), np.zeros(1)
        b = np.arange(self.steps + 1, dtype=np.float64)
        with np.errstate(divide="ignore"):
            logw = stats.binom.logpmf(b, self.steps, self.sample_rate)
        keep = np.isfinite(logw)
        return b[keep], logw[keep]

    def log_density(self, present: bool, theta, score) -> np.ndarray:
        """log density of one trial's released pair (of θ alone when the score is θ), up to a
        constant common to both worlds."""
        tau = self.noise_multiplier * math.sqrt(self.steps)
        means, logw = self._components(present)
        z = (np.asarray(theta)[:, None] - means[None, :]) / tau
        out = special.logsumexp(logw[None, :] - 0.5 * z * z, axis=1)
        if self.score_noise_multiplier is not None:
            r = (np.asarray(score) - np.asarray(theta) - float(present)) \
                / self.score_noise_multiplier
            out = out - 0.5 * r * r
        return out

    def log_cdf_sf(self, present: bool, score) -> tuple[np.ndarray, np.ndarray]:
        """``(log F(s), log (1 - F(s)))`` of one trial's score, accurate in both tails."""
        tau = self.noise_multiplier * math.sqrt(self.steps)
        means, logw = self._components(present)
        if self.score_noise_multiplier is not None:
            tau = math.hypot(tau, self.score_noise_multiplier)
            means = means + float(present)
        z = (np.asarray(score)[:, None] - means[None, :]) / tau
        log_cdf = special.logsumexp(logw[None, :] + special.log_ndtr(z), axis=1)
        log_sf = special.logsumexp(logw[None, :] + special.log_ndtr(-z), axis=1)
        return log_cdf, log_sf


@dataclasses.dataclass(frozen=True)
class LaplaceTrial:
    r"""One pure ε-DP trial: the Laplace mechanism :math:`\theta = c + \mathrm{Lap}(1/\varepsilon)`
    (sensitivity 1) whose output is also its score. Its privacy loss is :math:`\pm\varepsilon`
    on events of large probability, so an audit of 10^5 runs reaches about 0.9 of its ε (a
    Gaussian's ε at a small δ lies in tails no affordable audit samples): the trial on which
    the selection's own leak beyond the winner's ε can be seen. Priced as a
    :class:`~opacus_structured.tuning.PureDpTrial`."""

    epsilon0: float

    def __post_init__(self):
        object.__setattr__(self, "epsilon0", check_positive("epsilon0", self.epsilon0))

    def pricing(self) -> PureDpTrial:
        return PureDpTrial(self.epsilon0)

    def describe(self) -> str:
        return f"Laplace run (pure epsilon={self.epsilon0:g}), score = its output"

    def epsilon(self, delta: float, trials: int = 1) -> float:
        """The pure ε of ``trials`` trials composed (its ε at any δ is at most this)."""
        check_open_unit("delta", delta)
        return check_int("trials", trials, minimum=1) * self.epsilon0

    def sample(self, present: bool, n: int, rng: np.random.Generator):
        theta = rng.laplace(float(present), 1.0 / self.epsilon0, n)
        return theta, theta

    def log_density(self, present: bool, theta, score) -> np.ndarray:
        return -self.epsilon0 * np.abs(np.asarray(theta) - float(present))

    def log_cdf_sf(self, present: bool, score) -> tuple[np.ndarray, np.ndarray]:
        z = self.epsilon0 * (np.asarray(score) - float(present))
        low = math.log(0.5) - np.abs(z)  # log of the smaller tail
        high = np.log1p(-0.5 * np.exp(-np.abs(z)))
        return np.where(z < 0, low, high), np.where(z < 0, high, low)


#: A synthetic trial of the audit.
Trial = Union[GaussianTrial, LaplaceTrial]


# ---- the number of trials ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrialCount:
    """The law of the number of trials :math:`K`: ``fixed`` trials, or random with mean
    ``mean_trials`` (``eta`` the truncated negative binomial's shape; ``eta=None`` with
    ``poisson=True`` the Poisson law), as :class:`~opacus_structured.tuning.PrivateSelection`
    draws it."""

    fixed: Optional[int] = None
    mean_trials: Optional[float] = None
    eta: Optional[float] = None
    poisson: bool = False

    def __post_init__(self):
        if (self.fixed is None) == (self.mean_trials is None):
            raise ValueError("give either fixed= (a fixed number of trials) or mean_trials= "
                             "(a random number of trials)")
        if self.fixed is not None:
            object.__setattr__(self, "fixed", check_int("fixed", self.fixed, minimum=1))
            if self.eta is not None or self.poisson:
                raise ValueError("fixed= takes no eta / poisson")
            return
        object.__setattr__(self, "mean_trials", ps.check_mean_trials(self.mean_trials))
        if self.poisson != (self.eta is None):
            raise ValueError("a random K is the truncated negative binomial (eta= in (-1, "
                             "inf)) or the Poisson law (poisson=True, eta=None)")
        object.__setattr__(self, "eta", ps.check_eta(self.eta))

    @property
    def random(self) -> bool:
        return self.fixed is None

    def describe(self) -> str:
        if not self.random:
            return f"best of {self.fixed} (fixed, winner's ε reported)"
        return f"K ~ {ps.law_name(self.eta)}, mean {self.mean_trials:g}"

    def _gamma(self) -> float:
        return ps.tnb_gamma(self.mean_trials, self.eta)

    def log_gprime_ratio(self, log_cdf1, log_sf1, log_cdf0, log_sf0) -> np.ndarray:
        r""":math:`\log G'(F_1) - \log G'(F_0)` from the scores' log CDFs and log survivals."""
        if not self.random:
            return (self.fixed - 1) * (log_cdf1 - log_cdf0)
        if self.poisson:  # G'(u) = mu e^{mu (u - 1)}: the log difference is mu (S_0 - S_1)
            return self.mean_trials * (np.exp(log_sf0) - np.exp(log_sf1))
        gamma = self._gamma()
        if gamma >= 1:  # mean 1: K = 1
            return np.zeros_like(log_cdf1)
        lg, l1g = math.log(gamma), math.log1p(-gamma)
        # G'(u) ∝ (1 - (1 - γ) u)^{-(1 + η)} = (γ + (1 - γ) S)^{-(1 + η)}
        return -(1 + self.eta) * (np.logaddexp(lg, l1g + log_sf1)
                                  - np.logaddexp(lg, l1g + log_sf0))


def draw_trial_counts(count: TrialCount, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` independent draws of :math:`K`: for the truncated negative binomial, the inverse
    CDF of :func:`~opacus_structured.tuning.draw_num_trials` (same recursion, same uniforms:
    equal draws from equally seeded generators), vectorised."""
    n = check_int("n", n, minimum=0)
    if not count.random:
        return np.full(n, count.fixed, dtype=np.int64)
    if count.poisson:
        return rng.poisson(count.mean_trials, n).astype(np.int64)
    u = rng.random(n)
    gamma = count._gamma()
    if gamma >= 1 or n == 0:
        return np.ones(n, dtype=np.int64)
    eta = count.eta
    if eta == 0:
        p = (1 - gamma) / -math.log(gamma)
    else:
        p = eta * (1 - gamma) / math.expm1(-eta * math.log(gamma))
    cum, k, target = [p], 1, float(u.max())
    while cum[-1] < target and p > 0:
        k += 1
        p *= (1 - gamma) * (k + eta - 1) / k
        cum.append(cum[-1] + p)
    idx = np.searchsorted(np.asarray(cum), u, side="left")
    return np.minimum(idx, len(cum) - 1).astype(np.int64) + 1


# ---- the search, simulated --------------------------------------------------------------
def _winners(theta: np.ndarray, score: np.ndarray, counts: np.ndarray):
    """The winner's ``(theta, score)`` of each consecutive group of ``counts`` (all >= 1)
    trials: the highest score (ties, of probability 0, to the first)."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    best = np.maximum.reduceat(score, starts)
    group = np.repeat(np.arange(counts.size), counts)
    hits = np.flatnonzero(score == best[group])
    _, first = np.unique(group[hits], return_index=True)
    pick = hits[first]
    return theta[pick], score[pick]


def simulate_search(trial: Trial, count: TrialCount, *, present: bool,
                    repetitions: int, rng: np.random.Generator,
                    chunk_trials: int = CHUNK_TRIALS):
    """``repetitions`` independent searches with the canary present or absent: each draws
    :math:`K`, runs :math:`K` independent trials and releases the winner. Returns
    ``(theta, score, released)``: the winner's pair per search, and ``False`` where the
    Poisson law drew :math:`K = 0` (nothing released; ``theta``, ``score`` are NaN there)."""
    repetitions = check_int("repetitions", repetitions, minimum=1)
    chunk_trials = check_int("chunk_trials", chunk_trials, minimum=1)
    counts = draw_trial_counts(count, repetitions, rng)
    theta = np.full(repetitions, np.nan)
    score = np.full(repetitions, np.nan)
    released = counts > 0
    index = np.flatnonzero(released)
    ends = np.cumsum(counts[index])
    start = 0
    while start < index.size:  # chunks of whole searches, about chunk_trials trials each
        before = ends[start - 1] if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, before + chunk_trials, side="right")))
        reps = index[start:stop]
        t, s = trial.sample(present, int(counts[reps].sum()), rng)
        theta[reps], score[reps] = _winners(t, s, counts[reps])
        start = stop
    return theta, score, released


def attack_scores(trial: Trial, count: TrialCount, theta, score,
                  released) -> np.ndarray:
    """The likelihood-ratio attack's score (module docstring) of each released winner;
    higher = "the canary is present". A search that released nothing scores 0 (the empty
    output has the same probability in both worlds)."""
    released = np.asarray(released, dtype=bool)
    out = np.zeros(released.size)
    th, sc = np.asarray(theta)[released], np.asarray(score)[released]
    if th.size == 0:
        return out
    lc1, ls1 = trial.log_cdf_sf(True, sc)
    lc0, ls0 = trial.log_cdf_sf(False, sc)
    out[released] = (trial.log_density(True, th, sc) - trial.log_density(False, th, sc)
                     + count.log_gprime_ratio(lc1, ls1, lc0, ls0))
    return out


# ---- the audit ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SelectionAudit:
    """An audit of one tuned procedure at ``delta``.

    ``reported_epsilon``: what the procedure reports (the whole search's
    :func:`~opacus_structured.tuning.selection_epsilon` for a random :math:`K`; the winner's
    ε for a fixed :math:`K` that reports only the winner). ``winner_epsilon``: one trial's ε.
    ``upper_bound``: a valid ε of the procedure (the selection's ε, or :math:`K` trials
    composed). ``lower_bound``: the attack's **empirical lower bound** (Clopper–Pearson, at
    its ``confidence``). ``estimate``: ε at the bound's threshold from the observed rates,
    without confidence (a point estimate, not a bound). ``repetitions``: searches per side.
    """

    procedure: str
    count: TrialCount
    trial: Trial
    reported_epsilon: float
    winner_epsilon: float
    upper_bound: float
    lower_bound: EpsilonLowerBound
    estimate: float
    repetitions: int
    scores: AuditScores = dataclasses.field(repr=False)

    @property
    def exceeds_winner(self) -> bool:
        """Whether the lower bound shows more leakage than the winner's ε."""
        return self.lower_bound.epsilon > self.winner_epsilon

    @property
    def within_upper_bound(self) -> bool:
        """Whether the lower bound stays at or below the procedure's valid ε (it must, unless
        the pricing or the simulation is wrong, or the confidence level's risk struck)."""
        return self.lower_bound.epsilon <= self.upper_bound

    def row(self) -> dict:
        """One row of the audit table (JSON-ready)."""
        lb = self.lower_bound
        return {"procedure": self.procedure, "reported_epsilon": self.reported_epsilon,
                "winner_epsilon": self.winner_epsilon, "upper_bound": self.upper_bound,
                "epsilon_lower_bound": lb.epsilon, "confidence": lb.confidence,
                "method": lb.method, "estimate": self.estimate, "delta": lb.delta,
                "repetitions_per_side": self.repetitions,
                "exceeds_winner": self.exceeds_winner,
                "within_upper_bound": self.within_upper_bound}


def _point_estimate(scores: AuditScores, threshold: float) -> float:
    """ε at ``threshold`` from the observed false-positive and false-negative rates."""
    _, fp, fn = _rates_counts(scores.scores_with, scores.scores_without,
                              np.array([threshold]))
    with np.errstate(divide="ignore"):
        value = _cp_epsilons(fp / scores.scores_without.size, fn / scores.scores_with.size,
                             scores.delta)
    return max(0.0, float(value[0]))


def audit_selection(trial: Trial, count: TrialCount, *, repetitions: int,
                    delta: float, confidence: float = 0.95, seed: int = 0,
                    procedure: Optional[str] = None) -> SelectionAudit:
    """Audit a tuned procedure: ``repetitions`` searches with the canary and as many without
    (:func:`simulate_search`), the likelihood-ratio attack (:func:`attack_scores`), the
    Clopper–Pearson ε lower bound at ``confidence`` (thresholds chosen on the data, bands
    simultaneous over them), and the procedure's ε: :func:`~opacus_structured.tuning.
    selection_epsilon` of the trial for a random :math:`K`, the winner's and :math:`K`
    composed trials' for a fixed one. Deterministic given ``seed``."""
    delta = check_open_unit("delta", delta)
    repetitions = check_int("repetitions", repetitions, minimum=2)
    rng = np.random.default_rng(check_int("seed", seed))
    sides = []
    for present in (True, False):
        theta, score, released = simulate_search(trial, count, present=present,
                                                 repetitions=repetitions, rng=rng)
        sides.append(attack_scores(trial, count, theta, score, released))
    winner = trial.epsilon(delta)
    if count.random:
        upper = selection_epsilon(trial.pricing(), mean_trials=count.mean_trials,
                                  eta=count.eta, delta=delta)
        reported = upper
    else:
        upper = trial.epsilon(delta, trials=count.fixed)
        reported = winner
    scores = AuditScores(sides[0], sides[1], reported, delta,
                         meta={"trial": trial.describe(), "count": count.describe(),
                               "seed": seed, "attack": "likelihood ratio of the winner"})
    bound = scores.lower_bound(confidence=confidence)
    return SelectionAudit(procedure=procedure or count.describe(), count=count, trial=trial,
                          reported_epsilon=reported, winner_epsilon=winner,
                          upper_bound=upper, lower_bound=bound,
                          estimate=_point_estimate(scores, bound.threshold),
                          repetitions=repetitions, scores=scores)
