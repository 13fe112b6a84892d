r"""Private per-panel choices for the forecast job: ``forecast --tune`` (issue 40).

The job's recipe (:mod:`.model_defaults`) was chosen on public panels. ``--tune`` chooses the
learning rate, the number of steps and the zero-shot weight :math:`w` **on the private panel**,
with private selection (Papernot & Steinke, ICLR 2022; :mod:`opacus_structured.tuning`), and
prices the whole search inside the user's ε.

**One trial.** Hold out the last :math:`h` (= prediction length) steps of every training series
as a validation split; the rest is the *fit* panel. A trial draws a candidate
:math:`c = (\text{lr}, T_c, w)` uniformly from the grid, runs structured-subsampling DP-SGD on the
fit panel for :math:`T_c` steps at noise multiplier :math:`\sigma`, forecasts the validation
steps with the mixture :math:`(1-w)\cdot` DP model :math:`+\,w\cdot` zero-shot model, and
releases the private score

.. math::

    s = \frac{1}{N}\Big(\sum_{i=1}^{N} \min(\ell_i, C) + \mathcal N(0, \sigma_s^2 C^2)\Big),
    \qquad
    \ell_i = \frac{1}{h}\sum_{t}\frac{2}{9}\sum_{\tau\in\{0.1,\dots,0.9\}}
             \frac{\rho_\tau\big(y_{i,t} - \hat y^{(\tau)}_{i,t}\big)}{m_i},

the mean scaled quantile loss (a CRPS scaled like MASE: :math:`m_i` is series :math:`i`'s
in-sample seasonal-naive mean absolute error on the fit part; :math:`\ell_i = C` when
:math:`m_i = 0` and the forecast misses) with :math:`C` = :data:`SCORE_CLIP` and :math:`N` the
public number of series. Changing one time step changes one series' clipped loss by at most
:math:`C`: the score is the Gaussian mechanism with noise multiplier :math:`\sigma_s`.

**What one trial costs.** Every trial is priced as the *same* mechanism: :math:`T_{\max} =
\max_c T_c` steps at :math:`\sigma` plus the score at :math:`\sigma_s`
(:class:`~opacus_structured.tuning.TrialCost` of the scheme's accountant). A candidate with
:math:`T_c < T_{\max}` is a prefix of that run (the same sampler and noise law; the released
model, its tail average and its mixture are functions of the first :math:`T_c` iterates), hence
post-processing of it; the learning rate and :math:`w` do not change the mechanism. So every
trial is dominated by the priced one, and the theorem's "i.i.d. runs of one mechanism" holds for
the dominating mechanism.

**The price.** :math:`K` trials, :math:`K` drawn secretly (truncated negative binomial of shape
``eta``, mean ``mean_trials``), the best score's candidate released:
:func:`~opacus_structured.tuning.selection_epsilon` of the trial above. :math:`\sigma_s` is
fixed first so that the score alone, selected the same way, would cost :data:`SCORE_SHARE` of
the target ε; then :math:`\sigma` is calibrated so that the whole search costs at most the
target (:func:`~opacus_structured.tuning.calibrate_selection`). The released model is the
winning trial's: trained on the fit panel only (the validation steps are seen by the score).

**When the search runs** (``forecast --tune``; :func:`tuning_gate`). The score's noise on the
mean clipped loss has standard deviation :math:`\sigma_s C/N`, known before any private data is
read (ε, δ, the law and the public :math:`N`). Above :data:`MAX_SCORE_NOISE` the command does not
search and trains the recipe once at the whole ε instead; the decision costs no privacy.
:func:`tune_forecaster` itself always searches (call :func:`tuning_gate` first to decide).

**What may be published**: the winner's candidate, its private score and the search's ε.
:math:`K` and the other trials' scores are not: publishing them voids the theorem, so
:math:`K` is kept only in the search's own state (:class:`~opacus_structured.tuning.
PrivateSelection`), never in :class:`TuneResult`, a progress bar or the report.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_mod

from .._validation import check_int, check_open_unit, check_positive
from ..accountants.structured import StructuredSubsamplingAccountant
from ..accounting import pld as pld_lib
from ..accounting.calibration import calibrate_noise_multiplier
from ..tuning import PrivateSelection, TrialCost, calibrate_selection, selection_epsilon
from .data import Panel, train_test_split
from .estimators import prepare_estimator
from .fast_metrics import _forecast_arrays, _sample_forecast_class
from .pretraining import zero_shot_predictor
from .training import train_forecaster
from .training_scheme import make_scheme

__all__ = ["SCORE_CLIP", "SCORE_SHARE", "DEFAULT_MEAN_TRIALS", "DEFAULT_ETA",
           "MAX_SCORE_NOISE", "TuneCandidate", "TuneGate", "TunePlan", "TuneResult",
           "default_candidates", "validation_losses", "score_noise_multiplier", "tuning_gate",
           "plan_tuning", "tune_forecaster"]

#: :math:`C`: a per-series scaled loss above the fit part's in-sample seasonal-naive error
#: counts as 1 (worse than seasonal naive in sample).
SCORE_CLIP = 1.0
#: Share of the target ε that the score alone (selected the same way) would cost: fixes
#: :math:`\sigma_s` before :math:`\sigma` is calibrated for the whole search.
SCORE_SHARE = 0.25
#: Largest standard deviation of the score's noise, :math:`\sigma_s C/N` on the mean clipped
#: loss, at which ``forecast --tune`` runs its search (:class:`TuneGate`); chosen on the public
#: study panels by ``benchmarks/tuning_resolution.py`` (docs/benchmarks.md).
MAX_SCORE_NOISE = 0.01
_SCORE_SIGMA_FLOOR = 0.5  # σ_s's calibration range starts here
_SCORE_RTOL = 1e-2  # and its relative tolerance
#: :math:`\mathbb E[K]` and the law's shape (η = 1: geometric) of ``forecast --tune``.
DEFAULT_MEAN_TRIALS = 3.0
DEFAULT_ETA = 1.0
_LEVELS = tuple(round(0.1 * i, 1) for i in range(1, 10))
#: train_forecaster keywords every trial sets itself (a caller's ``common`` may hold them)
_SET_HERE = frozenset({"prediction_length", "batch_size", "lr", "max_steps", "epochs", "seed",
                       "discretization", "zero_shot_weight", "epsilon", "delta",
                       "noise_multiplier", "log", "progress"})


@dataclasses.dataclass(frozen=True)
class TuneCandidate:
    """One configuration of the grid: Adam's step size, the number of DP-SGD steps and the
    zero-shot weight :math:`w` of the released mixture (``1``: the public model itself)."""

    lr: float
    max_steps: int
    zero_shot_weight: float

    def describe(self) -> dict:
        return {"lr": self.lr, "max_steps": self.max_steps,
                "zero_shot_weight": self.zero_shot_weight}


def default_candidates(*, lr: float, max_steps: int, zero_shot: bool) -> list[TuneCandidate]:
    """The grid of ``forecast --tune``: lr × {1/3, 1, 3}, steps × {1/2, 1} of the recipe, and
    :math:`w \\in \\{0, 0.25, 0.5\\}` with public weights (plus :math:`w = 1`, the public model
    alone, once); without public weights :math:`w = 0` only."""
    lr = check_positive("lr", lr)
    max_steps = check_int("max_steps", max_steps, minimum=1)
    weights = (0.0, 0.25, 0.5) if zero_shot else (0.0,)
    steps = sorted({max(1, max_steps // 2), max_steps})
    grid = [TuneCandidate(float(f * lr), int(t), float(w))
            for w in weights for t in steps for f in (1 / 3, 1.0, 3.0)]
    if zero_shot:
        grid.append(TuneCandidate(float(lr), int(max_steps), 1.0))
    return grid


def _seasonal_scale(values: np.ndarray, season: int) -> float:
    m = season if len(values) > season else 1
    if len(values) <= m:
        return 0.0
    return float(np.mean(np.abs(values[m:] - values[:-m])))


def validation_losses(forecasts: Sequence, fit: Panel, full: Panel, prediction_length: int,
                      season_length: int, clip: float = SCORE_CLIP) -> np.ndarray:
    r"""Per-series clipped scaled quantile losses :math:`\min(\ell_i, C)` (module docstring)
    of ``forecasts`` (one gluonts forecast per series of ``fit``, of the ``prediction_length``
    steps after its end) against the last ``prediction_length`` steps of ``full``."""
    h = check_int("prediction_length", prediction_length, minimum=1)
    clip = check_positive("clip", clip)
    if len(forecasts) != len(fit) or len(full) != len(fit):
        raise ValueError(f"need one forecast per series: {len(forecasts)} forecasts, "
                         f"{len(fit)} fit and {len(full)} full series")
    _, _, quants = _forecast_arrays(list(forecasts), _LEVELS, _sample_forecast_class())
    levels = np.asarray(_LEVELS)[:, None]
    out = np.empty(len(fit))
    for i, (past, whole) in enumerate(zip(fit.targets, full.targets, strict=True)):
        truth = np.asarray(whole[-h:], dtype=np.float64)
        q = np.asarray(quants[i], dtype=np.float64)[:, :h]
        diff = truth[None, :] - q
        pinball = np.maximum(levels * diff, (levels - 1) * diff)  # ρ_τ(y − q)
        raw = float(2.0 * pinball.mean())  # (1/h) Σ_t (2/9) Σ_τ ρ_τ
        scale = _seasonal_scale(np.asarray(past, dtype=np.float64), int(season_length))
        if scale > 0:
            out[i] = min(raw / scale, clip)
        else:
            out[i] = 0.0 if raw == 0 else clip
    return out


@dataclasses.dataclass(frozen=True)
class TunePlan:
    """The search's privacy plan: ``sigma`` of every trial's training, ``score_sigma`` of its
    score, ``epsilon`` of the whole search (≤ the target), ``trial_epsilon`` of one trial alone
    (what a single run with this noise would report), at ``delta``."""

    sigma: float
    score_sigma: float
    epsilon: float
    trial_epsilon: float
    delta: float
    mean_trials: float
    eta: Optional[float]
    max_steps: int
    score_clip: float = SCORE_CLIP
    #: what priced the trial (:data:`~opacus_structured.tuning.pricing.ROUTES`)
    pricing_route: str = ""

    @property
    def selection_share(self) -> float:
        """Share of the search's ε above one trial's: what choosing costs."""
        return max(0.0, 1.0 - self.trial_epsilon / self.epsilon) if self.epsilon > 0 else 0.0


def planned_trial(scheme, sigma: float, steps: int, score_sigma: float, discretization: float):
    """The priced trial: the scheme's accountant after ``steps`` steps at ``sigma`` plus the
    score's Gaussian release at ``score_sigma`` (module docstring)."""

    acc = StructuredSubsamplingAccountant(scheme, discretization=discretization)
    acc.step(noise_multiplier=float(sigma), sample_rate=scheme.expected_sample_rate(),
             num_steps=int(steps))
    return TrialCost(acc, (float(score_sigma),))


def score_noise_multiplier(epsilon: float, *, delta: float,
                           mean_trials: float = DEFAULT_MEAN_TRIALS,
                           eta: Optional[float] = DEFAULT_ETA,
                           score_share: float = SCORE_SHARE) -> float:
    """σ_s: the score's noise multiplier such that the score alone, selected the same way,
    would cost ``score_share`` of ``epsilon`` (:func:`plan_tuning`'s first step; public
    quantities only)."""
    epsilon = check_positive("epsilon", epsilon)
    if not 0.0 < score_share < 1.0:
        raise ValueError(f"score_share must be in (0, 1), got {score_share!r}")
    return float(calibrate_selection(epsilon * score_share,
                                     trial_for_sigma=dp_event.GaussianDpEvent,
                                     sigma_range=(_SCORE_SIGMA_FLOOR, 1e5), rtol=_SCORE_RTOL,
                                     delta=delta,
                                     mean_trials=mean_trials, eta=eta))


@dataclasses.dataclass(frozen=True)
class TuneGate:
    r"""Whether ``forecast --tune`` runs its search here, decided on public quantities only
    (ε, δ, the law of :math:`K`, the public number of series :math:`N`), before any private
    data is read, so the decision costs no privacy.

    The score's noise has standard deviation :math:`\sigma_s C / N` on the mean clipped loss
    (:func:`score_noise_multiplier`). Above :data:`MAX_SCORE_NOISE` the search cannot tell
    the candidates apart, and it would still run every trial at a larger σ than one run needs
    (× 1.6–1.9 in the benchmark): the recipe is then trained once at the whole ε.
    ``series_needed`` and ``epsilon_needed`` say what would let the search run (each with
    the other quantities as they are)."""

    tune: bool
    epsilon: float
    delta: float
    num_series: int
    mean_trials: float
    eta: Optional[float]
    score_sigma: float
    score_noise_sd: float
    max_score_noise: float
    series_needed: int
    epsilon_needed: float

    def message(self) -> str:
        if self.tune:
            return (f"--tune: the score's noise (sd {self.score_noise_sd:.3g} on the mean "
                    f"clipped loss of {self.num_series} series) is within "
                    f"{self.max_score_noise:g}: running the private search")
        return (f"--tune skipped: with {self.num_series} series at epsilon="
                f"{self.epsilon:g} the private score's noise would have sd "
                f"{self.score_noise_sd:.3g} on the mean clipped loss (> {self.max_score_noise:g}"
                f", the most at which a search paid on the public study panels), and every "
                f"trial would run at a larger sigma than one run needs. The recipe is "
                f"trained once at the whole epsilon instead. A search "
                f"needs >= {self.series_needed} series at this epsilon"
                + (f", or epsilon >= {self.epsilon_needed:.3g} with {self.num_series} series"
                   if math.isfinite(self.epsilon_needed) else "")
                + " (--tune-always runs it anyway)")

    def describe(self) -> dict:
        return {"search_run": self.tune, "score_noise_sd": self.score_noise_sd,
                "max_score_noise": self.max_score_noise,
                "score_noise_multiplier": self.score_sigma, "num_series": self.num_series,
                "series_needed": self.series_needed,
                # null: no ε brings the noise under the limit with these series
                "epsilon_needed": (self.epsilon_needed if math.isfinite(self.epsilon_needed)
                                   else None),
                "decided_on": "public quantities only: epsilon, delta, the law of the number "
                              "of trials and the public number of series"}


def tuning_gate(*, epsilon: float, delta: float, num_series: int,
                mean_trials: float = DEFAULT_MEAN_TRIALS, eta: Optional[float] = DEFAULT_ETA,
                max_score_noise: Optional[float] = None) -> TuneGate:
    """The :class:`TuneGate` of a search (public quantities only)."""
    epsilon = check_positive("epsilon", epsilon)
    n = check_int("num_series", num_series, minimum=1)
    limit = MAX_SCORE_NOISE if max_score_noise is None else check_positive(
        "max_score_noise", max_score_noise)
    law = dict(delta=delta, mean_trials=mean_trials, eta=eta)
    sigma_s = score_noise_multiplier(epsilon, **law)
    sd = sigma_s * SCORE_CLIP / n
    needed_n = max(n, math.ceil(sigma_s * SCORE_CLIP / limit))
    needed_eps = epsilon
    if sd > limit and _SCORE_SIGMA_FLOOR * SCORE_CLIP / n > limit:
        needed_eps = math.inf  # no ε brings σ_s below the calibration's floor: more series
    elif sd > limit:
        # σ_s(ε) is the σ whose selection costs SCORE_SHARE·ε, found to within _SCORE_RTOL and
        # rounded up; so σ_s <= σ* = limit·N/C as soon as SCORE_SHARE·ε covers the selection
        # price at σ*/(1 + _SCORE_RTOL): one price, no search over ε
        sigma_star = limit * n / SCORE_CLIP / (1.0 + _SCORE_RTOL)
        needed_eps = max(epsilon, selection_epsilon(dp_event.GaussianDpEvent(sigma_star),
                                                    **law) / SCORE_SHARE)
    return TuneGate(tune=sd <= limit, epsilon=epsilon, delta=float(delta), num_series=n,
                    mean_trials=float(mean_trials), eta=eta, score_sigma=sigma_s,
                    score_noise_sd=sd, max_score_noise=limit, series_needed=int(needed_n),
                    epsilon_needed=float(needed_eps))


def plan_tuning(scheme, *, epsilon: float, delta: float, max_steps: int,
                mean_trials: float = DEFAULT_MEAN_TRIALS, eta: Optional[float] = DEFAULT_ETA,
                discretization: float = 1e-4, score_share: float = SCORE_SHARE) -> TunePlan:
    """σ_s, then σ, for a search over ``scheme`` costing at most ``epsilon`` at ``delta``
    (module docstring). Both calibrations keep the sound side (the ε computed at the returned
    σ is ≤ the target)."""

    epsilon = check_positive("epsilon", epsilon)
    delta = check_open_unit("delta", delta)
    max_steps = check_int("max_steps", max_steps, minimum=1)
    law = dict(mean_trials=mean_trials, eta=eta, delta=delta)
    score_sigma = score_noise_multiplier(epsilon, score_share=score_share, **law)

    def trial(sigma):
        return planned_trial(scheme, sigma, max_steps, score_sigma, discretization)

    # The search costs more than one run at the same σ: the σ of one run at the target is
    # the bracket's low end (calibrate_selection checks it like any other σ).
    single = calibrate_noise_multiplier(
        lambda s: scheme.epsilon(s, max_steps, delta, discretization=discretization), epsilon,
        rtol=1e-2)
    sigma = calibrate_selection(epsilon, trial_for_sigma=trial, sigma_range=(single, 1e4),
                                rtol=1e-2, discretization=discretization, **law)
    priced = trial(sigma)
    spent = selection_epsilon(priced, discretization=discretization, **law)
    return TunePlan(sigma=float(sigma), score_sigma=float(score_sigma), epsilon=float(spent),
                    trial_epsilon=_trial_epsilon(priced.run, score_sigma, delta,
                                                 discretization),
                    delta=delta, mean_trials=float(mean_trials), eta=eta, max_steps=max_steps,
                    pricing_route=getattr(spent, "route", ""))


def _trial_epsilon(accountant, score_sigma: float, delta: float, discretization: float) -> float:
    """ε of one trial alone (what a single run with this noise and its score would report):
    the run's pessimistic PLD composed with the score's Gaussian PLD."""
    score = pld_mod.from_gaussian_mechanism(
        float(score_sigma), sensitivity=1.0, value_discretization_interval=discretization,
        use_connect_dots=True)
    run = accountant.composed_pld(discretization)
    return float(pld_lib.epsilon_for_delta(run.compose(score), delta))


@dataclasses.dataclass
class TuneResult:
    """Outcome of :func:`tune_forecaster`. ``result`` is the winning trial's
    :class:`~.train_result.TrainResult` (its ``epsilon`` is that run's alone: report
    :attr:`epsilon`, the search's); ``candidate`` and ``score`` are the winner and its private
    score. It does not hold :math:`K`, the number of trials drawn: only the search's own
    state does (module docstring)."""

    result: Any
    candidate: TuneCandidate
    score: float
    plan: TunePlan
    candidates: list
    seconds: float
    public_state: Optional[dict] = None
    model: str = ""
    freq: str = ""
    prediction_length: int = 0
    context_length: Optional[int] = None

    @property
    def epsilon(self) -> float:
        return self.plan.epsilon

    def create_predictor(self):
        """The released forecaster: the winner's mixture (``w = 1``: the public model)."""
        w = self.candidate.zero_shot_weight
        if w >= 1.0:
            return zero_shot_predictor(self.model, self.public_state, freq=self.freq,
                                       prediction_length=self.prediction_length,
                                       context_length=self.context_length)
        return self.result.create_predictor(zero_shot_weight=w)

    def describe(self) -> dict:
        """JSON-ready record for ``report.json["tuning"]``."""
        plan = self.plan
        return {
            "candidates": [c.describe() for c in self.candidates],
            "chosen": self.candidate.describe(), "private_score": self.score,
            "score": ("mean over series of the clipped scaled quantile loss on the last "
                      "prediction-length steps of the training part (Gaussian mechanism)"),
            "score_clip": plan.score_clip, "score_noise_multiplier": plan.score_sigma,
            "noise_multiplier": plan.sigma, "epsilon": plan.epsilon, "delta": plan.delta,
            "trial_epsilon": plan.trial_epsilon, "selection_share": plan.selection_share,
            "pricing_route": plan.pricing_route,
            "law": "truncated negative binomial" if plan.eta is not None else "Poisson",
            "eta": plan.eta, "mean_trials": plan.mean_trials, "max_steps": plan.max_steps,
            "number_of_trials": ("secret: drawn from OS entropy and kept nowhere but in the "
                                 "search's own state; publishing it (or the other trials' "
                                 "scores) voids the selection's guarantee"),
        }


def _check_prefix(result, scheme, plan: TunePlan) -> None:
    """The trial's run must be a prefix of the priced one: same scheme, σ and rate."""
    acc = result.accountant
    if acc is None or acc.scheme.to_dict() != scheme.to_dict():
        raise RuntimeError("a tuning trial ran another scheme than the one priced")
    for sigma, rate, n in acc.history:
        if n and (float(sigma) != plan.sigma or float(rate) != scheme.expected_sample_rate()):
            raise RuntimeError(f"a tuning trial ran at sigma={sigma}, rate={rate}; priced: "
                               f"sigma={plan.sigma}, rate={scheme.expected_sample_rate()}")
    if len(acc) > plan.max_steps:
        raise RuntimeError(f"a tuning trial ran {len(acc)} steps > the priced {plan.max_steps}")


def tune_forecaster(model: str, train: Panel, *, epsilon: float, delta: float,
                    prediction_length: int, season_length: int, batch_size: int,
                    candidates: Optional[list] = None, lr: float, max_steps: int,
                    mean_trials: float = DEFAULT_MEAN_TRIALS,
                    eta: Optional[float] = DEFAULT_ETA, discretization: float = 1e-4,
                    num_samples: int = 100, seed: Optional[int] = None,
                    log: Optional[Callable[[str], None]] = None,
                    search_progress: Optional[bool] = None,
                    rng: Optional[np.random.Generator] = None, **common) -> TuneResult:
    """Private selection of (lr, steps, w) for ``model`` on ``train`` within ``epsilon``
    (module docstring). ``common``: the other keywords of
    :func:`~.training.train_forecaster` (context length, clipping, initial weights, ...);
    the trials run without their own progress bars, the search shows its own
    (``search_progress``: ``None`` a bar on a terminal and lines otherwise, ``False`` none);
    ``rng`` is for tests only (:math:`K` must be secret)."""

    t0 = time.perf_counter()
    say = log or (lambda m: None)
    budget = common.pop("budget", None)  # the whole search is charged, never a trial
    common = {k: v for k, v in common.items() if k not in _SET_HERE}
    h = check_int("prediction_length", prediction_length, minimum=1)
    fit, _ = train_test_split(train, h)  # fit = every training series minus its last h steps
    init_state = common.get("init_state")
    if candidates is None:
        candidates = default_candidates(lr=lr, max_steps=max_steps,
                                        zero_shot=init_state is not None)
    if any(c.zero_shot_weight > 0 for c in candidates) and init_state is None:
        raise ValueError("a candidate with zero_shot_weight > 0 needs public initial weights")
    t_max = max(c.max_steps for c in candidates)
    context_length = common.get("context_length")
    estimator_kwargs = common.get("estimator_kwargs") or {}
    prepared = prepare_estimator(model, freq=fit.freq, prediction_length=h,
                                 context_length=context_length, batch_size=batch_size,
                                 **estimator_kwargs)
    scheme = make_scheme(fit, prepared, batch_size, top_level=common.get("top_level", "wor"),
                         num_series=common.get("dataset_size"))
    plan = plan_tuning(scheme, epsilon=epsilon, delta=delta, max_steps=t_max,
                       mean_trials=mean_trials, eta=eta, discretization=discretization)
    say(f"private selection: {len(candidates)} candidates, mean {mean_trials:g} trials; every "
        f"trial at sigma={plan.sigma:.4g} (one untuned run would spend epsilon="
        f"{plan.trial_epsilon:.3g} at this noise), score noise {plan.score_sigma:.4g}·C; "
        f"the whole search: epsilon={plan.epsilon:.4g} at delta={delta:g}")
    expected = planned_trial(scheme, plan.sigma, t_max, plan.score_sigma, discretization)
    n_public = scheme.num_series
    counter = [0]

    def train_and_score(cand: TuneCandidate):
        counter[0] += 1
        trial_seed = None if seed is None else seed + 7919 * counter[0]
        res = train_forecaster(
            model, fit, epsilon=None, delta=delta, noise_multiplier=plan.sigma, lr=cand.lr,
            max_steps=cand.max_steps, prediction_length=h, batch_size=batch_size,
            # w = 1 forecasts with the public model alone (TuneResult.create_predictor)
            zero_shot_weight=cand.zero_shot_weight if cand.zero_shot_weight < 1 else 0.0,
            seed=trial_seed, discretization=discretization, log=None, progress=False, **common)
        _check_prefix(res, scheme, plan)
        released = TuneResult(res, cand, math.nan, plan, candidates, 0.0, init_state, model,
                              fit.freq, h, context_length)
        forecasts = list(released.create_predictor().predict(fit.to_gluonts(),
                                                             num_samples=num_samples))
        losses = validation_losses(forecasts, fit, train, h, season_length)
        noise = np.random.default_rng(trial_seed)  # OS entropy unless seeded (NOT PRIVATE)
        score = (float(np.sum(losses))
                 + float(noise.normal(0.0, plan.score_sigma * SCORE_CLIP))) / n_public
        return score, expected, res

    search = PrivateSelection(candidates, train_and_score, mean_trials=mean_trials, eta=eta,
                              delta=delta, maximize=False, expected_trial=expected,
                              progress=search_progress, rng=rng,
                              discretization=discretization, budget=budget)
    outcome = search.run()
    return TuneResult(outcome.output, outcome.config, float(outcome.score), plan, candidates,
                      time.perf_counter() - t0, init_state, model, fit.freq, h, context_length)
