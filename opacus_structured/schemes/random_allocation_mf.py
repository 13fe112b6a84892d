"""Matrix-factorization (correlated-noise) training under random allocation (balls-in-bins).

Semantics: every example draws one bin ``i ∈ {0..b-1}`` uniformly and independently, once, and
takes part in steps ``i, b+i, …, (k-1)b+i`` of the ``N = k·b``-step run (the sampler is
:class:`~opacus_structured.samplers.balls_in_bins.BallsInBinsBatchSampler`; batch sizes are
``Binomial(n, 1/b)``). The clipped-gradient sums are released through a lower-triangular,
non-negative strategy matrix ``C`` (``--strategy``). Relation: add/remove one example.

Pricing (Schuchardt & Kalinin, "Sampling-Free Privacy Accounting for Matrix Mechanisms under Random Allocation"): the Lemma 2.8 dominating pair of the whole run, by

* ``renyi``: the Rényi dynamic program (Algorithms 1–3) + Canonne–Kamath–Steinke conversion
  (:mod:`opacus_structured.accounting.random_allocation_mf`);
* ``conditional``: conditional composition (Algorithm 4, Lemma 4.1) with a PLD
  (:mod:`opacus_structured.accounting.conditional_composition`);
* ``best``: the smaller ε of the two (each is a valid upper bound).

The accounting unit is the whole planned run: ``steps < N`` is priced as the full run
(post-processing); ``steps > N`` raises (bins are not redrawn, so runs do not compose).
:meth:`pld` raises: the guarantee is not a PLD alone (Rényi gives RDP; conditional composition
adds the bad-event mass δ_E), so :meth:`epsilon` and :meth:`delta` are overridden.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import ClassVar, Optional

import numpy as np

from .._validation import check_int, check_open_unit, check_positive
from ..accounting import conditional_composition as cc_lib
from ..accounting import pld as pld_lib
from ..accounting import random_allocation_mf as ra_lib
from ..accounting import strategies as st
from ..accounting.strategies import toeplitz_matrix
from .base import Scheme, register_scheme

__all__ = ["RandomAllocationMFScheme", "strategy_matrix", "STRATEGY_CHOICES", "METHODS"]

STRATEGY_CHOICES = ("identity", "bandmf", "blt", "bandinvmf", "bsr", "bisr")
METHODS = ("renyi", "conditional", "best")
_CC_BAD_EVENT_GRID = (0.5, 0.1, 0.9)  # fractions of a target δ tried by delta()


@functools.lru_cache(maxsize=16)
def _strategy_cached(strategy: str, n: int, bands: int) -> np.ndarray:
    if strategy == "identity":
        return np.eye(n)
    names = {"bandmf": "optimal-banded", "bandinvmf": "banded-inverse", "bsr": "banded-sqrt",
             "bisr": "bisr", "blt": "blt"}
    return st.strategy_matrix(names[strategy], n, bands)


def strategy_matrix(strategy: str, n: int, bands: int) -> np.ndarray:
    """The ``n × n`` strategy matrix of a ``--strategy`` choice (see :data:`STRATEGY_CHOICES`).

    Built by :mod:`opacus_structured.optim.strategies` (unit-norm first column: σ is in units
    of the single-participation sensitivity).
    """
    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"strategy must be one of {STRATEGY_CHOICES}, got {strategy!r}")
    return _strategy_cached(strategy, check_int("n", n, minimum=1),
                            check_int("bands", bands, minimum=1)).copy()


def _auto_bands(G: np.ndarray, max_cost: float) -> int:
    """Largest effective bandwidth ≤ the true one whose DP reaches order 12 within max_cost."""
    b = G.shape[0]
    p = ra_lib.cyclic_bandwidth(G)
    while p > 1:
        Gp, _ = ra_lib._truncate(G, p)
        w, wrap = ra_lib._dp_plan(b, p, Gp)
        if ra_lib.dp_cost(b, w, 12, wrap=wrap) <= max_cost:
            return p
        p -= 1
    return 1


@functools.lru_cache(maxsize=8)
def _renyi_inputs(strategy: str, bands: int, epochs: int, batches_per_epoch: int,
                  renyi_bands: Optional[int], max_cost: float) -> tuple[np.ndarray, int]:
    means = ra_lib.mixture_means(strategy_matrix(strategy, epochs * batches_per_epoch, bands),
                                 epochs, batches_per_epoch)
    means.setflags(write=False)
    if renyi_bands is None:
        renyi_bands = _auto_bands(ra_lib.gram_matrix(means), max_cost)
    return means, renyi_bands


@register_scheme
@dataclasses.dataclass(frozen=True)
class RandomAllocationMFScheme(Scheme):
    """Matrix mechanism ``C`` under random allocation with ``epochs`` × ``batches_per_epoch``.

    Args:
        strategy: one of :data:`STRATEGY_CHOICES`.
        bands: band count of the strategy (BandMF/BSR: of ``C``; BandInvMF/BISR: of ``C^{-1}``;
            BLT: the number of buffers; ignored for ``identity``).
        epochs: ``k`` ≥ 1.
        batches_per_epoch: ``b`` ≥ 1.
        method: ``"renyi"``, ``"conditional"`` or ``"best"``.
        renyi_bands: effective bandwidth of the Rényi DP; ``None`` = the exact bandwidth when
            affordable, else the largest affordable (τ upper bound). An explicit value that is
            too expensive raises ``ValueError`` with the estimated cost.
        max_dp_cost: cost ceiling of the DP (element operations).
    """

    name: ClassVar[str] = "random-allocation-mf"
    summary: ClassVar[str] = ("matrix mechanism (identity/BandMF/BandInvMF/BSR/BISR/BLT) under "
                              "random allocation (balls-in-bins), Rényi DP / conditional "
                              "composition (Schuchardt & Kalinin); add/remove")
    unit: ClassVar[str] = "epoch"
    prices_correlated_noise: ClassVar[bool] = True

    strategy: str = "identity"
    bands: int = 1
    epochs: int = 1
    batches_per_epoch: int = 1
    method: str = "best"
    renyi_bands: Optional[int] = None
    max_dp_cost: float = ra_lib.DEFAULT_MAX_DP_COST

    def __post_init__(self):
        if self.strategy not in STRATEGY_CHOICES:
            raise ValueError(f"strategy must be one of {STRATEGY_CHOICES}, got "
                             f"{self.strategy!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        object.__setattr__(self, "bands", check_int("bands", self.bands, minimum=1))
        object.__setattr__(self, "epochs", check_int("epochs", self.epochs, minimum=1))
        object.__setattr__(self, "batches_per_epoch",
                           check_int("batches_per_epoch", self.batches_per_epoch, minimum=1))
        if self.renyi_bands is not None:
            object.__setattr__(self, "renyi_bands",
                               check_int("renyi_bands", self.renyi_bands, minimum=1))
        object.__setattr__(self, "max_dp_cost", check_positive("max_dp_cost", self.max_dp_cost))

    # ---- structure -----------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self.epochs * self.batches_per_epoch

    def steps_per_epoch(self) -> int:
        """Steps per epoch ``b`` (the accounting unit is the whole run, see compositions)."""
        return self.batches_per_epoch

    def compositions(self, steps: int) -> int:
        """1 for ``0 < steps ≤ k·b`` (a partial run is priced as the full run), 0 for none."""
        steps = check_int("steps", steps, minimum=0)
        if steps > self.num_steps:
            raise ValueError(f"steps must be <= epochs * batches_per_epoch = {self.num_steps} "
                             f"(bins are reused; plan more epochs), got {steps}")
        return 1 if steps else 0

    def expected_sample_rate(self) -> float:
        return 1.0 / self.batches_per_epoch

    def strategy_matrix(self) -> np.ndarray:
        return strategy_matrix(self.strategy, self.num_steps,
                               1 if self.strategy == "identity" else self.bands)

    def check_noise_correlation(self, coefficients) -> None:
        """The optimizer must stream exactly this scheme's ``C``: a banded Toeplitz strategy
        whose first column equals ``coefficients`` (dense-``C`` strategies cannot be streamed
        by the banded optimizer); raise otherwise."""
        C = self.strategy_matrix()
        n = C.shape[0]
        if hasattr(coefficients, "buf_decay"):  # BufferedToeplitz: its first n coefficients
            coefficients = coefficients.coefficients(n)
        c = np.asarray([float(v) for v in coefficients])
        col = np.zeros(n)
        col[:min(n, c.size)] = c[:n]

        if not np.allclose(C, toeplitz_matrix(col, n), rtol=1e-9, atol=1e-12):
            raise ValueError(f"the optimizer's noise_correlation {c.tolist()[:4]}... does not "
                             f"generate this scheme's strategy matrix ({self.strategy!r}, "
                             f"bands={self.bands}, N={n}); pass the first column of "
                             f"scheme.strategy_matrix() (banded Toeplitz strategies) or, for "
                             f"'blt', blt_strategy(N, bands).normalized(N)")

    def means(self) -> np.ndarray:
        """Lemma 2.8 mixture means (``b × N``)."""
        return self._renyi_inputs()[0].copy()

    def _renyi_inputs(self) -> tuple[np.ndarray, int]:
        """(read-only means, Rényi bandwidth), computed once per setting: a calibration prices
        the same scheme at ~17 σ."""
        return _renyi_inputs(self.strategy, 1 if self.strategy == "identity" else self.bands,
                             self.epochs, self.batches_per_epoch, self.renyi_bands,
                             self.max_dp_cost)

    # ---- pricing -------------------------------------------------------------------------
    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        raise ValueError(
            "random-allocation-mf has no stand-alone PLD: the Rényi accountant yields RDP and "
            "conditional composition adds a bad-event mass δ_E to its PLD; use "
            "scheme.epsilon()/scheme.delta() (or "
            "accounting.conditional_composition.conditional_composition_pld for the PLD part)")

    def renyi(self, noise_multiplier: float) -> ra_lib.RenyiBound:
        """Rényi bounds of both directions (Algorithm 3)."""
        means, bands = self._renyi_inputs()
        return ra_lib.renyi_accountant(means=means, noise_multiplier=noise_multiplier,
                                       bands=bands, max_cost=self.max_dp_cost)

    def epsilon(self, noise_multiplier, steps, delta, *,
                discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None,
                progress: Optional[cc_lib.ProgressCallback] = None):
        """ε of the whole run (the smaller of the two accountants for ``method="best"``).

        ``best`` prices the cheap Rényi bound first and skips conditional composition when a
        certified lower bound on its result (``conditional_composition_epsilon_lower_bound`` of
        :mod:`opacus_structured.accounting.conditional_composition`) already reaches the Rényi ε: the minimum, hence the reported ε, is then unchanged.
        ``progress(stage, done, total)``: optional callback of the conditional-composition
        stages (``"lower bound"``, ``"step pairs (remove|add)"``, ``"PLD composition"``).
        """
        sigma = check_positive("noise_multiplier", noise_multiplier)
        delta = check_open_unit("delta", delta)
        self.check_sample_rate(sample_rate)
        if self.compositions(steps) == 0:
            return 0.0
        out = np.inf
        if self.method in ("renyi", "best"):
            out = min(out, self.renyi(sigma).epsilon(delta))
        if self.method in ("conditional", "best"):
            means = self.means()
            cache: dict = {}
            if self.method == "best" and np.isfinite(out):
                lower = cc_lib.conditional_composition_epsilon_lower_bound(
                    means, sigma, delta, target=out, cache=cache, progress=progress)
                if lower >= out:
                    return float(out)
            out = min(out, cc_lib.conditional_composition_epsilon(
                means, sigma, delta, discretization=discretization, cache=cache,
                progress=progress))
        return float(out)

    def delta(self, noise_multiplier, steps, epsilon, *,
              discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None,
              progress: Optional[cc_lib.ProgressCallback] = None):
        """δ at ``epsilon`` (``best``: the smaller; conditional composition is skipped when a
        certified lower bound on its δ already reaches the Rényi δ, as in :meth:`epsilon`)."""
        sigma = check_positive("noise_multiplier", noise_multiplier)
        self.check_sample_rate(sample_rate)
        if self.compositions(steps) == 0:
            return 0.0
        out = 1.0
        if self.method in ("renyi", "best"):
            out = min(out, self.renyi(sigma).delta(float(epsilon)))
        if self.method in ("conditional", "best"):
            # δ_E must be fixed in advance: try a few masses relative to the Rényi δ (or 1e-5)
            means = self.means()
            cache: dict = {}
            ref = out if out < 1.0 else 1e-5
            for frac in _CC_BAD_EVENT_GRID:
                if self.method == "best" and cc_lib.conditional_composition_delta_lower_bound(
                        means, sigma, float(epsilon), bad_event_mass=frac * ref, target=out,
                        cache=cache, progress=progress) >= out:
                    continue
                out = min(out, cc_lib.conditional_composition_delta(
                    means, sigma, float(epsilon), bad_event_mass=frac * ref,
                    discretization=discretization, cache=cache, progress=progress))
        return float(out)

    # ---- from a training run / streaming ---------------------------------------------------
    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: Optional[int] = None, bands: Optional[int] = None,
                      strategy: Optional[str] = None, method: str = "best",
                      renyi_bands: Optional[int] = None,
                      max_dp_cost: float = ra_lib.DEFAULT_MAX_DP_COST
                      ) -> "RandomAllocationMFScheme":
        """``steps_per_epoch`` bins reused for ``epochs`` epochs (required: the whole planned
        run is priced at once). ``strategy`` defaults to ``"bandmf"`` with ``bands`` bands, or
        ``"identity"`` (DP-SGD) when ``bands`` is 1 or not given."""
        check_int("dataset_size", dataset_size, minimum=1)
        k = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        if epochs is None:
            raise ValueError("random-allocation-mf needs epochs (the planned number of epochs "
                             "over the same bins: the whole run is priced at once)")
        bands = 1 if bands is None else check_int("bands", bands, minimum=1)
        if strategy is None:
            strategy = "identity" if bands == 1 else "bandmf"
        return cls(strategy=strategy, bands=bands, epochs=epochs, batches_per_epoch=k,
                   method=method, renyi_bands=renyi_bands, max_dp_cost=max_dp_cost)

    def noise_correlation(self, steps: Optional[int] = None):
        """What ``CorrelatedNoiseDPOptimizer(noise_correlation=...)`` needs to stream exactly
        :meth:`strategy_matrix`: the banded first column (``identity``, ``bandmf``, ``bsr``) or
        the :class:`~opacus_structured.accounting.strategies.BufferedToeplitz` (``blt``).
        ``bandinvmf`` / ``bisr`` have a dense ``C`` the optimizer cannot stream: raises.
        ``steps`` (a run's planned length) is not used: ``C`` is fixed by the scheme's epochs
        and bins."""
        if self.strategy == "identity":
            return np.array([1.0])
        if self.strategy in ("bandmf", "bsr"):
            return self.strategy_matrix()[: self.bands, 0].copy()
        if self.strategy == "blt":
            return st.blt_strategy(self.num_steps, self.bands).normalized(self.num_steps)
        raise ValueError(f"strategy {self.strategy!r} has a dense C (banded C^-1) that the "
                         f"streaming correlated-noise optimizer cannot generate; train with "
                         f"'identity', 'bandmf', 'bsr' or 'blt'")

    # ---- sampler / CLI -------------------------------------------------------------------
    def batch_distribution(self) -> tuple:
        """Balls-in-bins with ``batches_per_epoch`` bins reused for ``epochs`` epochs (the
        strategy and method only change the pricing)."""
        return ("balls-in-bins", self.batches_per_epoch, self.epochs)

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--strategy", choices=STRATEGY_CHOICES, default="identity",
                            help="strategy matrix C (default identity = DP-SGD)")
        parser.add_argument("--bands", type=int, default=1, metavar="p",
                            help="bands of the strategy (BandMF/BSR: C; BandInvMF/BISR: C^-1; "
                                 "BLT: number of buffers)")
        parser.add_argument("--epochs", type=int, default=1, metavar="k",
                            help="epochs over the same bins (default 1)")
        parser.add_argument("--batches-per-epoch", type=int, required=True, metavar="b",
                            help="batches (bins) per epoch")
        parser.add_argument("--method", choices=METHODS, default="best",
                            help="renyi, conditional (composition) or best of both")
        parser.add_argument("--renyi-bands", type=int, default=None,
                            help="effective bandwidth of the Rényi DP (default: auto)")

    @classmethod
    def from_cli_args(cls, args):
        return cls(strategy=args.strategy, bands=args.bands, epochs=args.epochs,
                   batches_per_epoch=args.batches_per_epoch, method=args.method,
                   renyi_bands=args.renyi_bands)
