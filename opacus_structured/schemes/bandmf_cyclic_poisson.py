"""BandMF (banded matrix factorization, correlated noise) with cyclic Poisson sampling.

Semantics (Choquette-Choo et al. 2023, "Amplified banded matrix factorization", Theorem 4):
the dataset of ``|D|`` examples is split once into ``b``
groups (``b`` = number of bands of ``C``); step ``i`` (0-indexed) Poisson-samples group
``i mod b`` with rate ``q = b·B/|D|`` (expected batch ``B``); noise is correlated with a
``b``-banded lower-triangular non-negative Toeplitz strategy ``C`` (unit max column norm,
:mod:`opacus_structured.optim.strategies`) by
:class:`~opacus_structured.optim.correlated_noise.CorrelatedNoiseDPOptimizer`.

Pricing: one accounting unit is one cycle of ``b`` steps, during which an example has one
Poisson(q) participation opportunity whose signal (a column of ``C``) touches rows disjoint from
other cycles' participations; so ``n`` steps are ``ceil(n/b)`` composed Poisson-subsampled
Gaussians at noise multiplier ``σ / max_j‖C[:, j]‖`` (Thm. 4 there). Relation: add/remove one
example. With ``b = 1`` and ``identity`` this is exactly Poisson DP-SGD at ``q = B/|D|``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import ClassVar, Optional

import numpy as np

from .._validation import check_int, check_positive
from ..accounting import bandmf as bandmf_lib
from ..accounting import pld as pld_lib
from ..accounting.strategies import strategy_coefficients, validate_coefficients
from .base import Scheme, register_scheme

__all__ = ["BandMFCyclicPoissonScheme", "BANDED_STRATEGIES", "default_steps_per_epoch"]

#: Strategies with a banded (Toeplitz) C and unit max column norm: the ones this scheme prices.
BANDED_STRATEGIES = ("optimal-banded", "identity", "banded-sqrt")


def default_steps_per_epoch(dataset_size: int, batch_size: float) -> int:
    """Batches per data epoch of the cyclic Poisson sampler: ``max(1, round(|D|/B))``."""
    return max(1, round(dataset_size / batch_size))


@register_scheme
@dataclasses.dataclass(frozen=True)
class BandMFCyclicPoissonScheme(Scheme):
    """BandMF with ``bands`` bands and cyclic Poisson sampling (see module docstring).

    Args:
        dataset_size: ``|D|`` (public).
        batch_size: expected batch size ``B`` (``b·B ≤ |D|`` so that ``q ≤ 1``).
        bands: number of bands ``b`` of ``C`` = cycle length of the sampler.
        strategy: one of :data:`BANDED_STRATEGIES` (all have max column norm 1).
        partition: ``"equal"`` (equal split of a random permutation) or ``"independent"``
            (uniform independent group per example); both priced the same (worst-case group).
    """

    name: ClassVar[str] = "bandmf-cyclic-poisson"
    summary: ClassVar[str] = ("BandMF correlated noise with cyclic Poisson sampling "
                              "(Choquette-Choo et al. 2023), add/remove")
    unit: ClassVar[str] = "epoch"  # accounting unit = one cycle of `bands` steps (steps_per_unit)
    prices_correlated_noise: ClassVar[bool] = True

    dataset_size: int = 1
    batch_size: float = 1.0
    bands: int = 1
    strategy: str = "optimal-banded"
    partition: str = "equal"

    def __post_init__(self):
        object.__setattr__(self, "dataset_size",
                           check_int("dataset_size", self.dataset_size, minimum=1))
        object.__setattr__(self, "batch_size", check_positive("batch_size", self.batch_size))
        object.__setattr__(self, "bands", check_int("bands", self.bands, minimum=1))
        if self.strategy not in BANDED_STRATEGIES:
            raise ValueError(f"strategy must be one of {BANDED_STRATEGIES} (banded C, unit "
                             f"column norm) for cyclic Poisson accounting, got {self.strategy!r}")
        if self.partition not in ("equal", "independent"):
            raise ValueError(f"partition must be 'equal' or 'independent', got "
                             f"{self.partition!r}")
        self.sample_rate  # validates b·B ≤ |D|

    @property
    def sample_rate(self) -> float:
        """Per-group Poisson rate ``q = b·B/|D|``."""
        return bandmf_lib.cyclic_poisson_rate(self.dataset_size, self.batch_size, self.bands)

    @property
    def column_norm(self) -> float:
        """``max_j ‖C[:, j]‖₂`` of the strategy: 1 for every strategy in BANDED_STRATEGIES."""
        return 1.0

    def steps_per_epoch(self) -> int:
        """Batches per data epoch of :meth:`sampler`: ``round(|D|/B)``."""
        return default_steps_per_epoch(self.dataset_size, self.batch_size)

    def steps_per_unit(self) -> int:
        """Steps per accounting unit: one cycle = ``bands`` steps."""
        return self.bands

    def compositions(self, steps: int) -> int:
        """``ceil(steps / bands)`` cycles (a partial cycle is rounded up)."""
        return -(-check_int("steps", steps, minimum=0) // self.bands)

    def check_noise_correlation(self, coefficients) -> None:
        """The cyclic-Poisson reduction holds for any non-negative banded Toeplitz ``c`` with at
        most ``bands`` bands and ``‖c‖₂ ≤ 1`` (each participation has sensitivity ≤ 1 and
        participations are ``bands`` steps apart); raise otherwise."""
        if hasattr(coefficients, "buf_decay"):
            raise ValueError("a BLT strategy has a dense C; the cyclic-Poisson BandMF reduction "
                             "needs at most `bands` bands (price BLT with random-allocation-mf)")
        c = validate_coefficients(coefficients, name="noise_correlation")
        if c.size > self.bands:
            raise ValueError(f"the optimizer's noise_correlation has {c.size} bands but the "
                             f"scheme prices at most bands={self.bands}")
        if float(np.linalg.norm(c)) > 1.0 + 1e-9:
            raise ValueError(f"the optimizer's noise_correlation has norm "
                             f"{float(np.linalg.norm(c)):.6g} > 1: the scheme assumes unit "
                             f"sensitivity (use scheme.noise_correlation(steps))")

    def expected_sample_rate(self) -> float:
        """``1/len(sampler)`` that Opacus' hook reports with :meth:`sampler` as batch sampler."""
        return 1.0 / default_steps_per_epoch(self.dataset_size, self.batch_size)

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        self.check_sample_rate(sample_rate)
        return bandmf_lib.bandmf_cyclic_poisson_pld(
            noise_multiplier, self.sample_rate, column_norm=self.column_norm,
            discretization=discretization)

    def noise_correlation(self, steps: Optional[int] = None):
        """Coefficients ``c`` for :class:`CorrelatedNoiseDPOptimizer` over ``steps`` steps (the
        strategy is optimised for the run length: ``steps`` is required)."""
        if steps is None:
            raise ValueError(f"scheme {self.name!r} optimises its strategy for the length of "
                             f"the run: pass the run's steps (make_private: epochs=, or "
                             f"noise_correlation= explicitly)")
        return strategy_coefficients(self.strategy, check_int("steps", steps, minimum=self.bands),
                                     self.bands)

    def batch_distribution(self) -> tuple:
        """Cyclic Poisson over ``bands`` groups (the strategy only changes the pricing)."""
        return ("cyclic-poisson", self.dataset_size, self.batch_size, self.bands, self.partition)

    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: Optional[int] = None, bands: Optional[int] = None,
                      strategy: str = "optimal-banded",
                      partition: str = "equal") -> "BandMFCyclicPoissonScheme":
        """``bands`` groups (required) of ``dataset_size`` examples, expected batch
        ``dataset_size/steps_per_epoch`` (so :meth:`steps_per_epoch` is ``steps_per_epoch``).
        ``epochs`` does not change the pricing (the strategy's length does: see
        :meth:`noise_correlation`)."""
        n = check_int("dataset_size", dataset_size, minimum=1)
        k = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        if bands is None:
            raise ValueError(f"bandmf-cyclic-poisson needs bands (the number of bands b of the "
                             f"strategy C = the cycle length, an integer in [1, {k}])")
        return cls(dataset_size=n, batch_size=n / k, bands=bands, strategy=strategy,
                   partition=partition)

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--bands", type=int, required=True, metavar="b",
                            help="number of bands of C (= cycle length), >= 1")
        parser.add_argument("--dataset-size", type=int, required=True, metavar="N",
                            help="dataset size |D|")
        parser.add_argument("--batch-size", type=float, required=True, metavar="B",
                            help="expected batch size (bands * B <= |D|)")
        parser.add_argument("--strategy", default="optimal-banded", choices=BANDED_STRATEGIES,
                            help="strategy matrix family (default optimal-banded)")
        parser.add_argument("--partition", default="equal", choices=("equal", "independent"),
                            help="how the data is split into the b cyclic groups: equal (equal "
                                 "split of a random permutation, default) or independent (each "
                                 "example joins a uniformly random group)")

    @classmethod
    def from_cli_args(cls, args):
        return cls(dataset_size=args.dataset_size, batch_size=args.batch_size, bands=args.bands,
                   strategy=args.strategy, partition=args.partition)
