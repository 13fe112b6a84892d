"""BandMF with b-min-sep sampling, priced by Monte Carlo (``bminsep-mc``).

Semantics (Dong & Ganesh, arXiv:2602.09338, Algorithms 1–2, Appendix D): every example is an
independent Markov chain; when *available* it joins the batch with probability
``p = B̄ / (|D| − (b−1) B̄)`` and is then barred for the next ``b − 1`` steps, so no example is
in two batches less than ``b`` steps apart; batch sizes vary (or are truncated/padded to
``B_max``). Warm start (Algorithm 2) starts every chain in its stationary law, so the expected
batch size is ``B̄`` at every step. Noise: BandMF with a ``bands``-banded Toeplitz ``C``
(``bands ≤ b``), clip norm 1, zero-out adjacency.

**The noise a training run streams.** The ``"optimal-banded"`` strategy is optimised for a run
length ``n``: its coefficients differ for every ``n``. Priced without a ``horizon``, ``steps``
steps are a run of exactly ``steps`` steps with ``C`` optimised for ``steps`` (what
``opacus-structured bminsep-mc epsilon --steps N`` computes). A training run streams one ``C``
from its first step, so its scheme fixes it: ``horizon`` = the run's planned steps, and the
accountant then prices, after ``t`` steps, the first ``t`` rows of exactly that ``C`` (after
``t > horizon`` steps, the same banded Toeplitz ``C`` continued). The optimizer must stream
:meth:`~BMinSepMonteCarloScheme.noise_correlation`; :meth:`~BMinSepMonteCarloScheme.
check_noise_correlation` refuses any other ``c`` (independent noise included, unless the scheme
has one band), so ``DPCallback`` and the engine never print an ε for noise the scheme does not
price.

Multi-attribution (``max_user_examples = k_u > 1``, Algorithm 3, §6): users own up to ``k_u``
examples (contribution bounding is the caller's preprocessing); each iteration takes an interim
Poisson sample at rate ``p`` and excludes the user-sharing neighbourhoods of the interim samples
of the last ``b − 1`` iterations, so a user appears in at most one iteration in any ``b``
consecutive ones, possibly with several examples. Adjacency is user-level (fixed graph). The
expected batch size is not analytic in ``p``, so ``p`` is given explicitly
(``sampling_probability``, found by burn-in and binary search, §6.2) and ``batch_size`` is only
the informational target. Priced by Theorem 6.1 (``x_i ~ Binom(k_u, p)`` when available), cold
start only: a burn-in warm start is post-processing of the cold-start run and is accounted as
cold start, so ``warm_start=True`` is rejected.

**A description, not a run.** The scheme holds what describes the mechanism — its batches
(:meth:`batch_distribution`) and its noise (``bands``, ``strategy``) — and nothing about how its
ε is estimated. The number of samples, the seed, the confidence ``1 − q``, the workers, the
device and the progress bar are a run's
:class:`~opacus_structured.accounting.monte_carlo.MonteCarloSettings`, passed to :meth:`estimate`,
:meth:`epsilon`, :meth:`delta`, :meth:`certify` and to the accountant
(:class:`~opacus_structured.accountants.bminsep_mc.BMinSepMonteCarloAccountant`), whose
``state_dict`` records them with the seed used.

Pricing: there is no closed form; ε is a **Monte Carlo estimate** from the dynamic program of
Theorem 5.1 (:mod:`opacus_structured.accounting.bminsep_mc`), reported as the KL
high-confidence upper estimate that holds with probability ``≥ 1 − q`` (:attr:`bound` is
``BoundKind.MONTE_CARLO``). :meth:`epsilon` returns a :class:`MonteCarloEpsilon` (a float that
prints its label); :meth:`estimate` returns the full :class:`MonteCarloEstimate`. For a
certified guarantee use Algorithm 5 (:meth:`certify`, ``opacus-structured bminsep-mc
certify``). :meth:`pld` raises: a Monte Carlo scheme has no PLD.

Sampler: ``scheme.sampler(dataset_size)`` builds the b-min-sep sampler of Algorithm 1 / 2 (with
truncation and padding when ``truncate`` is set), ``scheme.sampler(user_sets)`` the
multi-attribution sampler of Algorithm 3; either carries this scheme. Two schemes that differ
only in their noise (``bands``, ``strategy``) draw the same batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from typing import Any, Optional

import numpy as np

from .._validation import check_int, check_open_unit, check_positive, check_probability
from ..accounting import pld as pld_lib
from ..accounting import strategies
from ..accounting.bminsep_mc import (
    BandedStrategy,
    BandMFMonteCarlo,
    bminsep_sampling_prob,
    bminsep_stationary_rate,
)
from ..accounting.bounds import BoundKind
from ..accounting.certification import CertifiedCalibration
from ..accounting.monte_carlo import (
    MonteCarloEpsilon,
    MonteCarloEstimate,
    MonteCarloSamples,
    MonteCarloSettings,
)
from .base import Scheme, register_scheme
from .registry import runner_for

__all__ = ["BMinSepMonteCarloScheme", "STRATEGY_CHOICES"]

#: ``--strategy`` choices (names of :func:`opacus_structured.accounting.strategies.
#: strategy_coefficients`): banded Toeplitz, non-negative, ``‖c‖ = 1``.
STRATEGY_CHOICES = ("optimal-banded", "banded-sqrt", "max-error")


def _run_settings(settings: Optional[MonteCarloSettings]) -> MonteCarloSettings:
    """The settings of one run: ``settings`` (default :class:`MonteCarloSettings`) with a
    concrete seed (fresh OS entropy when it has none)."""
    run = MonteCarloSettings() if settings is None else settings
    if not isinstance(run, MonteCarloSettings):
        raise ValueError(f"settings must be a MonteCarloSettings, got {type(run).__name__}")
    return run.resolved()


@functools.lru_cache(maxsize=8)
def _samples(scheme: "BMinSepMonteCarloScheme", settings: MonteCarloSettings,
             noise_multiplier: float, steps: int) -> MonteCarloSamples:
    return runner_for(scheme).collect(scheme.mechanism(noise_multiplier, steps), settings)


@register_scheme
@dataclasses.dataclass(frozen=True)
class BMinSepMonteCarloScheme(Scheme):
    """b-min-sep sampling + BandMF, Monte Carlo accounting (arXiv:2602.09338 §5, App. A, D).

    Args:
        bands: number of bands ``L`` of ``C``.
        dataset_size: ``|D|`` (public).
        batch_size: expected batch size ``B̄`` (sets ``p``; needs ``b·B̄ ≤ |D|``).
        min_sep: ``b`` (default ``bands``; must be ``≥ bands``).
        warm_start: Algorithm 2 (else Algorithm 1, cold start).
        truncate: ``B_max`` for the truncated + padded variant (Appendix D), or ``None``.
        max_user_examples: ``k_u`` (multi-attribution, Theorem 6.1; cold start, no truncation).
        sampling_probability: the conditional rate ``p``. Required with
            ``max_user_examples > 1`` (the interim rate of Algorithm 3); with one example per
            user it follows from ``batch_size`` (see :attr:`sampling_prob`) and, if given, must
            agree with it (to 1e-9 relative; it is then used as given, e.g. by a sampler built
            from ``p``, :meth:`from_sampling_probability`).
        strategy: see :data:`STRATEGY_CHOICES`; ``C`` is pure Toeplitz with ``‖c‖ = 1``.
        horizon: the number of steps ``C`` is optimised for (the training run's planned
            optimizer steps, ``≥ bands``), or ``None``: each pricing call optimises ``C`` for
            its own ``steps``. Needed to train with ``"optimal-banded"`` and ``bands > 1``
            (see :meth:`noise_correlation`); the other strategies do not depend on it.

    How ε is estimated (samples, seed, confidence, workers, device) is not part of the scheme:
    pass a :class:`~opacus_structured.accounting.monte_carlo.MonteCarloSettings` to the pricing
    methods or to the accountant.
    """

    name = "bminsep-mc"
    summary = "BandMF + b-min-sep sampling, MONTE CARLO estimate (holds w.p. 1-q; not a bound)"

    bands: int = 1
    dataset_size: int = 1
    batch_size: float = 1.0
    min_sep: Optional[int] = None
    warm_start: bool = False
    truncate: Optional[int] = None
    max_user_examples: int = 1
    sampling_probability: Optional[float] = None
    strategy: str = "optimal-banded"
    horizon: Optional[int] = None

    #: Prices the banded Toeplitz correlated noise of :meth:`noise_correlation` (and only it).
    prices_correlated_noise = True

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("bands", check_int("bands", self.bands, minimum=1))
        set_("dataset_size", check_int("dataset_size", self.dataset_size, minimum=1))
        set_("batch_size", check_positive("batch_size", self.batch_size))
        b = self.bands if self.min_sep is None else check_int("min_sep", self.min_sep,
                                                              minimum=self.bands)
        set_("min_sep", b)
        k_u = check_int("max_user_examples", self.max_user_examples, minimum=1)
        set_("max_user_examples", k_u)
        if self.truncate is not None:
            set_("truncate", check_int("truncate", self.truncate, minimum=1))
        if k_u == 1:
            p = bminsep_sampling_prob(self.dataset_size, self.batch_size, b)  # feasibility
            if self.sampling_probability is not None:
                given = check_probability("sampling_probability", self.sampling_probability)
                if not math.isclose(given, p, rel_tol=1e-9, abs_tol=0.0):
                    raise ValueError(
                        f"sampling_probability={given!r} contradicts batch_size="
                        f"{self.batch_size!r}: with one example per user p = batch_size / "
                        f"(dataset_size - (min_sep - 1) * batch_size) = {p!r}; give "
                        f"batch_size alone (sampling_probability is required only with "
                        f"max_user_examples > 1)")
                set_("sampling_probability", given)
        else:
            if self.sampling_probability is None:
                raise ValueError(
                    "max_user_examples > 1 needs sampling_probability (--sampling-prob): the "
                    "expected batch size of Algorithm 3 is not analytic in p; find p by burn-in "
                    "and binary search (paper §6.2)")
            set_("sampling_probability",
                 check_probability("sampling_probability", self.sampling_probability))
            if self.warm_start:
                raise ValueError("max_user_examples > 1 has no closed-form warm start: burn in "
                                 "the sampler and account as cold start (drop --warm-start; "
                                 "Theorem 6.1, paper §6.2)")
            if self.truncate is not None:
                raise ValueError("truncate is not supported with max_user_examples > 1")
        if self.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"strategy must be one of {STRATEGY_CHOICES}, got {self.strategy!r}")
        if self.horizon is not None:
            set_("horizon", check_int("horizon", self.horizon, minimum=self.bands))

    @classmethod
    def from_sampling_probability(cls, dataset_size: int, sampling_probability: float,
                                  min_sep: int, *, warm_start: bool = False,
                                  truncate: Optional[int] = None, max_user_examples: int = 1,
                                  bands: int = 1, strategy: str = "optimal-banded",
                                  horizon: Optional[int] = None) -> "BMinSepMonteCarloScheme":
        """The scheme of a sampler given by its conditional rate ``p`` (what the samplers of
        :mod:`opacus_structured.samplers.bminsep` take). ``batch_size`` becomes the stationary
        expected batch size ``|D|·p/(1 + (b−1)p)`` (``|D|·p``, the interim sample, with
        multi-attribution, where it is informational); ``p`` is kept exactly. ``bands``,
        ``strategy`` and ``horizon`` describe the noise and default to independent noise (one
        band)."""
        n = check_int("dataset_size", dataset_size, minimum=1)
        p = check_probability("sampling_probability", sampling_probability)
        b = check_int("min_sep", min_sep, minimum=1)
        k_u = check_int("max_user_examples", max_user_examples, minimum=1)
        rate = bminsep_stationary_rate(p, b) if k_u == 1 else p
        return cls(bands=bands, dataset_size=n, batch_size=n * rate, min_sep=b,
                   warm_start=warm_start, truncate=truncate, max_user_examples=k_u,
                   sampling_probability=p, strategy=strategy, horizon=horizon)

    # ---- the mechanism ---------------------------------------------------------------------
    @property
    def sampling_prob(self) -> float:
        """The conditional rate ``p`` (not ``p0 = B̄/|D|``): ``sampling_probability`` when
        given (the interim rate of Algorithm 3 with multi-attribution), else from
        ``batch_size``."""
        if self.sampling_probability is not None:
            return self.sampling_probability
        return bminsep_sampling_prob(self.dataset_size, self.batch_size, self.min_sep)

    @property
    def bound(self) -> BoundKind:
        return BoundKind.MONTE_CARLO

    def _coefficients(self, steps: int):
        """First column of ``C`` for a run of ``steps`` steps: optimised for ``horizon`` when
        set, else for ``steps``."""
        if self.bands == 1:
            return np.ones(1)
        n = self.horizon if self.horizon is not None else steps
        if self.strategy != "optimal-banded":  # the coefficients do not depend on n
            n = max(n, self.bands)
        return strategies.strategy_coefficients(self.strategy, n, self.bands)

    def noise_correlation(self, steps: Optional[int] = None) -> list:
        """The first-column coefficients ``c`` an optimizer must stream
        (:class:`~opacus_structured.optim.CorrelatedNoiseDPOptimizer`'s ``noise_correlation``)
        for this scheme's ε to hold.

        ``"optimal-banded"`` with ``bands > 1`` needs ``horizon`` (a ``ValueError`` names it
        otherwise): its ``c`` depends on the run length, and the accountant must price from the
        first step the ``C`` the optimizer streams. ``steps`` (a run's planned length, what
        :func:`opacus_structured.make_private` passes) is only checked: ``C`` is the scheme's,
        and a run longer than ``horizon`` continues the same banded Toeplitz ``C``, which is
        what the accountant prices.
        """
        if steps is not None:
            check_int("steps", steps, minimum=1)
        if self.horizon is None and self.strategy == "optimal-banded" and self.bands > 1:
            raise ValueError(
                f"bminsep-mc with strategy='optimal-banded' and bands={self.bands} optimises C "
                f"for the run length: build the scheme with horizon=<the run's planned "
                f"optimizer steps> (--horizon) so the accountant prices, from the first step, "
                f"the C the optimizer streams")
        return [float(v) for v in self._coefficients(1 if steps is None else steps)]

    def check_noise_correlation(self, coefficients) -> None:
        """Raise ``ValueError`` unless ``coefficients`` are exactly :meth:`noise_correlation`
        (to 1e-9): the Monte Carlo prices one ``C``, and any other (independent noise when
        ``bands > 1`` included) is a different mechanism."""
        if hasattr(coefficients, "buf_decay"):
            raise ValueError("a BLT strategy has a dense C; bminsep-mc prices a banded "
                             "Toeplitz C (price BLT with random-allocation-mf)")
        c = strategies.validate_coefficients(coefficients, name="noise_correlation")
        want = np.asarray(self.noise_correlation())
        if c.size != want.size or not np.allclose(c, want, rtol=1e-9, atol=1e-12):
            raise ValueError(
                f"the optimizer's noise_correlation {np.round(c, 6).tolist()[:4]} (bands "
                f"{c.size}) is not the C this scheme prices ({self.strategy!r}, bands="
                f"{self.bands}, horizon={self.horizon}: {np.round(want, 6).tolist()[:4]}); "
                f"pass scheme.noise_correlation() to the optimizer")

    def mechanism(self, noise_multiplier: float, steps: int) -> BandMFMonteCarlo:
        steps = check_int("steps", steps, minimum=1)
        c = self._coefficients(steps)
        return BandMFMonteCarlo(
            BandedStrategy.toeplitz(c, steps), check_positive("noise_multiplier", noise_multiplier),
            "bminsep", self.sampling_prob, self.min_sep, warm_start=self.warm_start,
            truncated_batch_size=self.truncate,
            dataset_size=self.dataset_size if self.truncate is not None else None,
            max_user_examples=self.max_user_examples)

    @property
    def release_policy(self) -> str:
        """``"exact"`` for correlated noise, else ``"span"``: the Monte Carlo prices the whole
        run of b-min-sep draws, whose steps are not independent (see :class:`Scheme`)."""
        return "exact" if self.correlated_noise else "span"

    def batch_distribution(self) -> tuple:
        """b-min-sep with rate ``p``, separation ``b``, start, truncation and ``k_u`` over
        ``dataset_size`` examples (``bands`` and ``strategy`` only change the pricing)."""
        return ("b-min-sep", self.dataset_size, self.sampling_prob, self.min_sep,
                self.warm_start, self.truncate, self.max_user_examples)

    def implemented_by(self, sampler_scheme) -> bool:
        """Any sampler drawing this scheme's batches (same :meth:`batch_distribution`),
        whatever noise its own scheme names: the noise is priced by this scheme."""
        return (isinstance(sampler_scheme, BMinSepMonteCarloScheme)
                and sampler_scheme.batch_distribution() == self.batch_distribution())

    def sampler_for_dataset(self, num_examples: int, *, generator=None):
        """``sampler(num_examples)``; with multi-attribution a ``ValueError``: Algorithm 3 needs
        every example's users, so build it with ``scheme.sampler(user_sets)``."""
        if self.max_user_examples > 1:
            raise ValueError(f"scheme {self.name!r} with max_user_examples > 1 samples users: "
                             f"pass each example's users, scheme.sampler(user_sets, ...), as the "
                             f"DataLoader's batch_sampler")
        return self.sampler(num_examples, generator=generator)

    # ---- pricing (Monte Carlo) ------------------------------------------------------------
    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        raise ValueError(
            "bminsep-mc is priced by Monte Carlo and has no privacy loss distribution: use "
            "scheme.estimate(noise_multiplier, steps, delta, settings=...) (a "
            "MonteCarloEstimate that holds with probability 1 - q) or scheme.certify(...) "
            "(Algorithm 5)")

    def estimate(self, noise_multiplier: float, steps: int, delta: float, *,
                 settings: Optional[MonteCarloSettings] = None) -> MonteCarloEstimate:
        """Monte Carlo ε at ``delta`` (holds with probability ``≥ 1 − q``; not a bound).

        ``settings`` (default :class:`~opacus_structured.accounting.monte_carlo.
        MonteCarloSettings`) says how the run is made; without a seed each call draws a fresh
        one, returned as ``result.seed``. Calls with the same settings and seed reuse their
        samples.
        """
        delta = check_open_unit("delta", delta)
        run = _run_settings(settings)
        return _samples(self, run, float(noise_multiplier), int(steps)).estimate(
            delta, run.failure_probability)

    def epsilon(self, noise_multiplier, steps, delta, *,
                settings: Optional[MonteCarloSettings] = None,
                discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        """High-confidence upper ε estimate as a labelled :class:`MonteCarloEpsilon`
        (``discretization`` and ``sample_rate`` do not apply)."""
        steps = check_int("steps", steps, minimum=0)
        if steps == 0:
            q = (MonteCarloSettings() if settings is None else settings).failure_probability
            return MonteCarloEpsilon(MonteCarloEstimate(0.0, check_open_unit("delta", delta), 0.0,
                                                        0.0, 0.0, 0, q))
        return MonteCarloEpsilon(self.estimate(noise_multiplier, steps, delta, settings=settings))

    def delta(self, noise_multiplier, steps, epsilon, *,
              settings: Optional[MonteCarloSettings] = None,
              discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        """Upper confidence δ at ``epsilon`` (holds w.p. ``≥ 1 − q``); see
        :meth:`MonteCarloSamples.estimate_delta` for the full record."""
        steps = check_int("steps", steps, minimum=0)
        if steps == 0:
            return 0.0
        run = _run_settings(settings)
        rec = _samples(self, run, float(noise_multiplier), steps).estimate_delta(
            epsilon, run.failure_probability)
        return rec["delta_upper"]

    def certify(self, epsilon: float, delta: float, steps: int, *, sigma_min: float,
                settings: Optional[MonteCarloSettings] = None,
                **kwargs) -> CertifiedCalibration:
        """Algorithm 5 σ calibration (Theorem A.1); ``kwargs`` go to
        :func:`~opacus_structured.runners.monte_carlo.certify_noise_multiplier`.

        ``settings`` gives the seed (``None``: fresh, or the one recorded in ``directory``),
        the device, the shard size, the workers (default 1) and the executor; its ``samples`` and
        ``failure_probability`` do not apply (Algorithm 5 derives both from ``δ``).
        """
        run = MonteCarloSettings() if settings is None else settings
        if not isinstance(run, MonteCarloSettings):
            raise ValueError(f"settings must be a MonteCarloSettings, got {type(run).__name__}")
        kwargs.setdefault("workers", run.workers or 1)
        kwargs.setdefault("device", run.device)
        kwargs.setdefault("seed", run.seed)
        kwargs.setdefault("shard_size", run.shard_size)
        return runner_for(self).certify(self.mechanism(1.0, steps), epsilon, delta,
                                        sigma_min=sigma_min, settings=run, **kwargs)

    # ---- command line --------------------------------------------------------------------
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """The scheme's flags and the run's (:meth:`MonteCarloSettings.add_cli_arguments`)."""
        parser.add_argument("--bands", type=int, required=True, metavar="b",
                            help="bands of C and (default) the min separation b")
        parser.add_argument("--dataset-size", type=int, required=True, metavar="N",
                            help="number of examples |D| (public)")
        parser.add_argument("--batch-size", type=float, required=True, metavar="B",
                            help="expected batch size (b * B <= N)")
        parser.add_argument("--min-sep", type=int, default=None,
                            help="min separation b >= bands (default: --bands)")
        parser.add_argument("--warm-start", action="store_true",
                            help="Algorithm 2 (stationary start)")
        parser.add_argument("--truncate", type=int, default=None, metavar="B_max",
                            help="truncated + padded batches of size B_max (Appendix D)")
        parser.add_argument("--max-user-examples", type=int, default=1, metavar="k_u",
                            help="multi-attribution: at most k_u examples per user (Algorithm 3, "
                                 "Theorem 6.1; cold start; needs --sampling-prob)")
        parser.add_argument("--sampling-prob", type=float, default=None, metavar="p",
                            help="interim sampling rate p of Algorithm 3 (only with "
                                 "--max-user-examples > 1)")
        parser.add_argument("--strategy", choices=STRATEGY_CHOICES, default="optimal-banded",
                            help="banded Toeplitz noise strategy C (default %(default)s)")
        parser.add_argument("--horizon", type=int, default=None, metavar="N",
                            help="steps C is optimised for (a training run's planned steps; "
                                 "default: each --steps)")
        MonteCarloSettings.add_cli_arguments(parser)

    @classmethod
    def from_cli_args(cls, args):
        """The scheme only; the run's flags are :meth:`pricing_options_from_cli_args`."""
        return cls(bands=args.bands, dataset_size=args.dataset_size, batch_size=args.batch_size,
                   min_sep=args.min_sep, warm_start=args.warm_start, truncate=args.truncate,
                   max_user_examples=args.max_user_examples,
                   sampling_probability=args.sampling_prob, strategy=args.strategy,
                   horizon=getattr(args, "horizon", None))

    @classmethod
    def pricing_options_from_cli_args(cls, args) -> dict[str, Any]:
        """Keyword arguments of :meth:`epsilon` / :meth:`delta` from the run's flags:
        ``{"settings": MonteCarloSettings.from_cli_args(args)}``."""
        return {"settings": MonteCarloSettings.from_cli_args(args)}

    def describe(self):
        d = dataclasses.asdict(self)
        d["sampling_prob"] = self.sampling_prob
        d["bound"] = BoundKind.MONTE_CARLO
        return d
