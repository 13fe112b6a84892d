"""BandMF with b-min-sep sampling, priced by Monte Carlo (``bminsep-mc``).

Semantics (Dong & Ganesh, arXiv:2602.09338, Algorithms 1–2, Appendix D): every example is an
independent Markov chain; when *available* it joins the batch with probability
``p = B̄ / (|D| − (b−1) B̄)`` and is then barred for the next ``b − 1`` steps, so no example is
in two batches less than ``b`` steps apart; batch sizes vary (or are truncated/padded to
``B_max``). Warm start (Algorithm 2) starts every chain in its stationary law, so the expected
batch size is ``B̄`` at every step. Noise: BandMF with a ``bands``-banded Toeplitz ``C``
(``bands ≤ b``), clip norm 1, zero-out adjacency.

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

Pricing: there is no closed form; ε is a **Monte Carlo estimate** from the dynamic program of
Theorem 5.1 (:mod:`opacus_structured.accounting.bminsep_mc`), reported as the KL
high-confidence upper estimate that holds with probability ``≥ 1 − q`` (:attr:`bound` is
``"monte-carlo"``). :meth:`epsilon` returns a :class:`MonteCarloEpsilon` (a float that prints
its label); :meth:`estimate` returns the full :class:`MonteCarloEstimate`. For a certified
guarantee use Algorithm 5 (:meth:`certify`, ``opacus-structured bminsep-mc certify``).
:meth:`pld` raises: a Monte Carlo scheme has no PLD.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Optional

from .._validation import check_int, check_open_unit, check_positive, check_probability
from ..accounting import pld as pld_lib
from ..accounting import strategies
from ..accounting.bminsep_mc import BandedStrategy, BandMFMonteCarlo, bminsep_sampling_prob
from ..accounting.bounds import BoundKind
from ..accounting.certification import CertifiedCalibration
from ..accounting.monte_carlo import MonteCarloEpsilon, MonteCarloEstimate, MonteCarloSamples
from ..runners.monte_carlo import (
    certify_noise_multiplier,
    collect_privacy_losses,
    fresh_monte_carlo_seed,
)
from .base import Scheme, register_scheme

__all__ = ["BMinSepMonteCarloScheme", "STRATEGY_CHOICES"]

#: ``--strategy`` choices (names of :func:`opacus_structured.accounting.strategies.
#: strategy_coefficients`): banded Toeplitz, non-negative, ``‖c‖ = 1``.
STRATEGY_CHOICES = ("optimal-banded", "banded-sqrt", "max-error")


@functools.lru_cache(maxsize=8)
def _samples(scheme: "BMinSepMonteCarloScheme", noise_multiplier: float,
             steps: int) -> MonteCarloSamples:
    return collect_privacy_losses(scheme.mechanism(noise_multiplier, steps), scheme.samples,
                                  seed=scheme.seed, workers=scheme.workers,
                                  device=scheme.device, progress=scheme.progress)


@register_scheme
@dataclasses.dataclass(frozen=True)
class BMinSepMonteCarloScheme(Scheme):
    """b-min-sep sampling + BandMF, Monte Carlo accounting (arXiv:2602.09338 §5, App. A, D).

    Args:
        bands: number of bands ``L`` of ``C``.
        dataset_size: ``|D|`` (public).
        batch_size: expected batch size ``B̄`` (sets ``p``; needs ``b·B̄ ≤ |D|``).
        samples: Monte Carlo samples per direction.
        min_sep: ``b`` (default ``bands``; must be ``≥ bands``).
        warm_start: Algorithm 2 (else Algorithm 1, cold start).
        truncate: ``B_max`` for the truncated + padded variant (Appendix D), or ``None``.
        max_user_examples: ``k_u`` (multi-attribution, Theorem 6.1; cold start, no truncation).
        sampling_probability: the interim rate ``p`` of Algorithm 3; required with
            ``max_user_examples > 1`` and not allowed otherwise (then ``p`` follows from
            ``batch_size``, see :attr:`sampling_prob`).
        strategy: see :data:`STRATEGY_CHOICES`; ``C`` is pure Toeplitz with ``‖c‖ = 1``.
        seed: Monte Carlo seed; ``None`` (default) draws a fresh one from OS entropy at
            construction, stored in the scheme (``describe()``, ``to_dict()``, the
            accountant's ``state_dict``) for audit and so that the scheme prices consistently.
            Do not rebuild the scheme with new seeds until an estimate or a certification
            looks good: picking among seeds voids the confidence (multiple testing).
        failure_probability: ``q`` of the upper estimate.
        workers: processes (``None``: all cores). device: ``None`` (numpy) or a torch device.
    """

    name = "bminsep-mc"
    summary = "BandMF + b-min-sep sampling, MONTE CARLO estimate (holds w.p. 1-q; not a bound)"

    bands: int = 1
    dataset_size: int = 1
    batch_size: float = 1.0
    samples: int = 100_000
    min_sep: Optional[int] = None
    warm_start: bool = False
    truncate: Optional[int] = None
    max_user_examples: int = 1
    sampling_probability: Optional[float] = None
    strategy: str = "optimal-banded"
    seed: Optional[int] = None
    failure_probability: float = 1e-3
    workers: Optional[int] = None
    device: Optional[str] = None
    progress: bool = False

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("bands", check_int("bands", self.bands, minimum=1))
        set_("dataset_size", check_int("dataset_size", self.dataset_size, minimum=1))
        set_("batch_size", check_positive("batch_size", self.batch_size))
        set_("samples", check_int("samples", self.samples, minimum=1))
        b = self.bands if self.min_sep is None else check_int("min_sep", self.min_sep,
                                                              minimum=self.bands)
        set_("min_sep", b)
        k_u = check_int("max_user_examples", self.max_user_examples, minimum=1)
        set_("max_user_examples", k_u)
        if self.truncate is not None:
            set_("truncate", check_int("truncate", self.truncate, minimum=1))
        if k_u == 1:
            if self.sampling_probability is not None:
                raise ValueError("sampling_probability is only for max_user_examples > 1 "
                                 "(with one example per user p follows from batch_size)")
            bminsep_sampling_prob(self.dataset_size, self.batch_size, b)  # feasibility check
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
        check_open_unit("failure_probability", self.failure_probability)
        set_("seed", fresh_monte_carlo_seed() if self.seed is None
             else check_int("seed", self.seed, minimum=0))
        if self.workers is not None:
            set_("workers", check_int("workers", self.workers, minimum=1))

    # ---- the mechanism ---------------------------------------------------------------------
    @property
    def sampling_prob(self) -> float:
        """The conditional rate ``p`` (not ``p0 = B̄/|D|``); with multi-attribution the given
        interim rate of Algorithm 3."""
        if self.sampling_probability is not None:
            return self.sampling_probability
        return bminsep_sampling_prob(self.dataset_size, self.batch_size, self.min_sep)

    @property
    def bound(self) -> str:
        return BoundKind.MONTE_CARLO

    def mechanism(self, noise_multiplier: float, steps: int) -> BandMFMonteCarlo:
        steps = check_int("steps", steps, minimum=1)
        c = strategies.strategy_coefficients(self.strategy, steps, self.bands)
        return BandMFMonteCarlo(
            BandedStrategy.toeplitz(c, steps), check_positive("noise_multiplier", noise_multiplier),
            "bminsep", self.sampling_prob, self.min_sep, warm_start=self.warm_start,
            truncated_batch_size=self.truncate,
            dataset_size=self.dataset_size if self.truncate is not None else None,
            max_user_examples=self.max_user_examples)

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        raise ValueError(
            "bminsep-mc is priced by Monte Carlo and has no privacy loss distribution: use "
            "scheme.estimate(noise_multiplier, steps, delta) (a MonteCarloEstimate that holds "
            "with probability 1 - q) or scheme.certify(...) (Algorithm 5)")

    def estimate(self, noise_multiplier: float, steps: int, delta: float) -> MonteCarloEstimate:
        """Monte Carlo ε at ``delta`` (holds with probability ``≥ 1 − q``; not a bound)."""
        delta = check_open_unit("delta", delta)
        return _samples(self, float(noise_multiplier), int(steps)).estimate(
            delta, self.failure_probability)

    def epsilon(self, noise_multiplier, steps, delta, *,
                discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        """High-confidence upper ε estimate as a labelled :class:`MonteCarloEpsilon`."""
        steps = check_int("steps", steps, minimum=0)
        if steps == 0:
            return MonteCarloEpsilon(MonteCarloEstimate(0.0, check_open_unit("delta", delta), 0.0,
                                                        0.0, 0.0, 0, self.failure_probability))
        return MonteCarloEpsilon(self.estimate(noise_multiplier, steps, delta))

    def delta(self, noise_multiplier, steps, epsilon, *,
              discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        """Upper confidence δ at ``epsilon`` (holds w.p. ``≥ 1 − q``); see
        :meth:`MonteCarloSamples.estimate_delta` for the full record."""
        steps = check_int("steps", steps, minimum=0)
        if steps == 0:
            return 0.0
        rec = _samples(self, float(noise_multiplier), steps).estimate_delta(
            epsilon, self.failure_probability)
        return rec["delta_upper"]

    def certify(self, epsilon: float, delta: float, steps: int, *, sigma_min: float,
                **kwargs) -> CertifiedCalibration:
        """Algorithm 5 σ calibration (Theorem A.1); ``kwargs`` go to
        :func:`~opacus_structured.runners.monte_carlo.certify_noise_multiplier`."""
        kwargs.setdefault("workers", self.workers or 1)
        kwargs.setdefault("device", self.device)
        kwargs.setdefault("seed", self.seed)
        return certify_noise_multiplier(self.mechanism(1.0, steps), epsilon, delta,
                                        sigma_min=sigma_min, **kwargs)

    # ---- command line --------------------------------------------------------------------
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--bands", type=int, required=True, metavar="b",
                            help="bands of C and (default) the min separation b")
        parser.add_argument("--dataset-size", type=int, required=True, metavar="N")
        parser.add_argument("--batch-size", type=float, required=True, metavar="B",
                            help="expected batch size (b * B <= N)")
        parser.add_argument("--samples", type=int, default=100_000, metavar="S",
                            help="Monte Carlo samples per direction (default %(default)s)")
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
        parser.add_argument("--strategy", choices=STRATEGY_CHOICES, default="optimal-banded")
        parser.add_argument("--seed", type=int, default=None,
                            help="Monte Carlo seed (default: fresh OS entropy; the seed used "
                                 "is printed/recorded for audit). Never re-run a failed check "
                                 "or a disappointing estimate with another seed: choosing "
                                 "among seeds voids the confidence (multiple testing)")
        parser.add_argument("--confidence-failure", type=float, default=1e-3, metavar="q",
                            help="failure probability q of the Monte Carlo upper estimate")
        parser.add_argument("--workers", type=int, default=None)
        parser.add_argument("--device", default=None, help="torch device (e.g. cuda)")

    @classmethod
    def from_cli_args(cls, args):
        return cls(bands=args.bands, dataset_size=args.dataset_size, batch_size=args.batch_size,
                   samples=args.samples, min_sep=args.min_sep, warm_start=args.warm_start,
                   truncate=args.truncate, max_user_examples=args.max_user_examples,
                   sampling_probability=args.sampling_prob, strategy=args.strategy,
                   seed=args.seed,
                   failure_probability=args.confidence_failure, workers=args.workers,
                   device=args.device)

    def describe(self):
        d = dataclasses.asdict(self)
        d["sampling_prob"] = self.sampling_prob
        d["bound"] = BoundKind.MONTE_CARLO
        return d
