"""BandMF with b-min-sep sampling, priced by Monte Carlo (``bminsep-mc``).

Semantics (Dong & Ganesh, arXiv:2602.09338, Algorithms 1–2, Appendix D): every example is an
independent Markov chain; when *available* it joins the batch with probability
``p = B̄ / (|D| − (b−1) B̄)`` and is then barred for the next ``b − 1`` steps, so no example is
in two batches less than ``b`` steps apart; batch sizes vary (or are truncated/padded to
``B_max``). Warm start (Algorithm 2) starts every chain in its stationary law, so the expected
batch size is ``B̄`` at every step. Noise: BandMF with a ``bands``-banded Toeplitz ``C``
(``bands ≤ b``), clip norm 1, zero-out adjacency.

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
import math
from typing import Optional

import numpy as np

from .._validation import check_int, check_open_unit, check_positive
from ..accounting import pld as pld_lib
from ..accounting.bminsep_mc import BandedStrategy, BandMFMonteCarlo, bminsep_sampling_prob
from ..accounting.monte_carlo import (
    MONTE_CARLO,
    CertifiedCalibration,
    MonteCarloEpsilon,
    MonteCarloEstimate,
    MonteCarloSamples,
    certify_noise_multiplier,
    collect_privacy_losses,
)
from .base import Scheme, register_scheme

__all__ = ["BMinSepMonteCarloScheme", "strategy_coefficients"]

#: ``--strategy`` choices: the optimal banded Toeplitz C of :mod:`opacus_structured.optim`
#: (``"optimal-banded"``), ``"banded-sqrt"``, or the unit-norm truncated max-error coefficients
#: ``Π_{j≤k}(2j−1)/(2j)`` (``"max-error"``, the digest's comparison grid).
STRATEGY_CHOICES = ("optimal-banded", "banded-sqrt", "max-error")


def strategy_coefficients(name: str, n: int, bands: int) -> np.ndarray:
    """Unit-norm first-column coefficients ``c`` of the named banded Toeplitz strategy."""
    bands = check_int("bands", bands, minimum=1)
    if name == "max-error":
        c = np.cumprod([1.0] + [(2 * j - 1) / (2 * j) for j in range(1, bands)])
        return c / np.linalg.norm(c)
    if name in ("optimal-banded", "banded-sqrt"):
        from ..optim import strategies  # lazy: numpy/scipy only

        return np.asarray(strategies.strategy_coefficients(name, n, bands), dtype=np.float64)
    raise ValueError(f"strategy must be one of {STRATEGY_CHOICES}, got {name!r}")


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
        strategy: see :data:`STRATEGY_CHOICES`; ``C`` is pure Toeplitz with ``‖c‖ = 1``.
        seed: Monte Carlo seed. failure_probability: ``q`` of the upper estimate.
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
    strategy: str = "optimal-banded"
    seed: int = 0
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
        bminsep_sampling_prob(self.dataset_size, self.batch_size, b)  # feasibility check
        if self.truncate is not None:
            set_("truncate", check_int("truncate", self.truncate, minimum=1))
        if self.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"strategy must be one of {STRATEGY_CHOICES}, got {self.strategy!r}")
        check_open_unit("failure_probability", self.failure_probability)
        if self.workers is not None:
            set_("workers", check_int("workers", self.workers, minimum=1))

    # ---- the mechanism ---------------------------------------------------------------------
    @property
    def sampling_prob(self) -> float:
        """The conditional rate ``p`` (not ``p0 = B̄/|D|``)."""
        return bminsep_sampling_prob(self.dataset_size, self.batch_size, self.min_sep)

    @property
    def bound(self) -> str:
        return MONTE_CARLO

    def mechanism(self, noise_multiplier: float, steps: int) -> BandMFMonteCarlo:
        steps = check_int("steps", steps, minimum=1)
        c = strategy_coefficients(self.strategy, steps, self.bands)
        return BandMFMonteCarlo(
            BandedStrategy.toeplitz(c, steps), check_positive("noise_multiplier", noise_multiplier),
            "bminsep", self.sampling_prob, self.min_sep, warm_start=self.warm_start,
            truncated_batch_size=self.truncate,
            dataset_size=self.dataset_size if self.truncate is not None else None)

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
        :func:`~opacus_structured.accounting.monte_carlo.certify_noise_multiplier`."""
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
        parser.add_argument("--strategy", choices=STRATEGY_CHOICES, default="optimal-banded")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--confidence-failure", type=float, default=1e-3, metavar="q",
                            help="failure probability q of the Monte Carlo upper estimate")
        parser.add_argument("--workers", type=int, default=None)
        parser.add_argument("--device", default=None, help="torch device (e.g. cuda)")

    @classmethod
    def from_cli_args(cls, args):
        return cls(bands=args.bands, dataset_size=args.dataset_size, batch_size=args.batch_size,
                   samples=args.samples, min_sep=args.min_sep, warm_start=args.warm_start,
                   truncate=args.truncate, strategy=args.strategy, seed=args.seed,
                   failure_probability=args.confidence_failure, workers=args.workers,
                   device=args.device)

    def describe(self):
        d = dataclasses.asdict(self)
        d["sampling_prob"] = self.sampling_prob
        d["bound"] = MONTE_CARLO
        return d
