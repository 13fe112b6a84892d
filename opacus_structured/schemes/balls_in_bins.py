"""DP-SGD with balls-in-bins sampling (bins fixed for the whole run), priced by pld-accounting.

Semantics: see :class:`~opacus_structured.samplers.balls_in_bins.BallsInBinsBatchSampler`
(one uniform bin per example, reused for ``epochs`` epochs of ``num_bins`` steps each).
Relation: add/remove one example.

Pricing (:func:`opacus_structured.accounting.bandmf.balls_in_bins_pld`): with ``C = I`` the
``E``-epoch balls-in-bins pair equals the 1-of-``T`` random-allocation pair at ``σ/√E`` (the
mixture means are orthogonal with norm ``√E``; Lemma 2.8, Schuchardt & Kalinin, with C = I),
priced by Feldman & Shenfeld's random-allocation PLD (``pld-accounting``, dominating bound).
That PLD's FFT add direction can be very loose for small ``σ/√E`` (a large atom at its largest
loss: ε = 14.79 at σ/√E = 0.577, T = 20, δ = 1e-5, where the package's own adaptive ε range
is 5.41), so :meth:`BallsInBinsScheme.epsilon` / :meth:`~BallsInBinsScheme.delta` also price the
same run with the Rényi accountant of Schuchardt & Kalinin (``random-allocation-mf`` with
``C = I``, exact for ``p = 1``) and report the smaller ε (each is a valid upper bound).
The accounting unit is the whole planned run: a partial run is rounded up (post-processing),
and more steps than ``epochs·num_bins`` raise, because composing independent epochs would
under-report (the bins are not redrawn).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import ClassVar, Optional

from .._validation import check_int
from ..accounting import bandmf as bandmf_lib
from ..accounting import pld as pld_lib
from .base import Scheme, register_scheme
from .random_allocation_mf import RandomAllocationMFScheme

__all__ = ["BallsInBinsScheme"]


@register_scheme
@dataclasses.dataclass(frozen=True)
class BallsInBinsScheme(Scheme):
    """Balls-in-bins DP-SGD: ``num_bins`` steps per epoch, ``epochs`` epochs with fixed bins."""

    name: ClassVar[str] = "balls-in-bins"
    summary: ClassVar[str] = ("DP-SGD with balls-in-bins (random allocation, bins reused every "
                              "epoch), priced by pld-accounting; add/remove")
    unit: ClassVar[str] = "epoch"  # one unit = the whole planned run

    num_bins: int = 1
    epochs: int = 1

    def __post_init__(self):
        object.__setattr__(self, "num_bins", check_int("num_bins", self.num_bins, minimum=1))
        object.__setattr__(self, "epochs", check_int("epochs", self.epochs, minimum=1))

    def steps_per_epoch(self) -> int:
        """Steps per data epoch: ``num_bins``."""
        return self.num_bins

    def steps_per_unit(self) -> int:
        """Steps per accounting unit: the whole planned run (``epochs · num_bins``)."""
        return self.num_bins * self.epochs

    def compositions(self, steps: int) -> int:
        """1 for any ``0 < steps ≤ epochs·num_bins`` (the run is one unit); more raises."""
        steps = check_int("steps", steps, minimum=0)
        if steps > self.num_bins * self.epochs:
            raise ValueError(f"steps must be <= epochs * num_bins = {self.num_bins * self.epochs}"
                             f" for balls-in-bins (bins are reused; plan more epochs), got "
                             f"{steps}")
        return 1 if steps else 0

    def expected_sample_rate(self) -> float:
        return 1.0 / self.num_bins

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        self.check_sample_rate(sample_rate)
        return bandmf_lib.balls_in_bins_pld(noise_multiplier, num_bins=self.num_bins,
                                            epochs=self.epochs, discretization=discretization)

    def renyi_scheme(self):
        """The same run as ``random-allocation-mf`` with ``C = I`` (Rényi accountant)."""
        return RandomAllocationMFScheme(strategy="identity", epochs=self.epochs,
                                        batches_per_epoch=self.num_bins, method="renyi")

    def epsilon(self, noise_multiplier, steps, delta, *,
                discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None) -> float:
        """min(ε of the pld-accounting PLD, ε of the Rényi accountant): both are upper bounds."""
        eps = super().epsilon(noise_multiplier, steps, delta, discretization=discretization,
                              sample_rate=sample_rate)
        if self.compositions(steps) == 0:
            return eps
        return min(eps, self.renyi_scheme().epsilon(noise_multiplier, steps, delta,
                                                    discretization=discretization))

    def delta(self, noise_multiplier, steps, epsilon, *,
              discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None) -> float:
        """min(δ of the pld-accounting PLD, δ of the Rényi accountant)."""
        d = super().delta(noise_multiplier, steps, epsilon, discretization=discretization,
                          sample_rate=sample_rate)
        if self.compositions(steps) == 0:
            return d
        return min(d, self.renyi_scheme().delta(noise_multiplier, steps, epsilon,
                                                discretization=discretization))

    def batch_distribution(self) -> tuple:
        """Balls-in-bins with ``num_bins`` bins reused for ``epochs`` epochs."""
        return ("balls-in-bins", self.num_bins, self.epochs)

    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: Optional[int] = None) -> "BallsInBinsScheme":
        """``steps_per_epoch`` bins reused for ``epochs`` epochs (required: the whole planned
        run is priced at once, and training beyond it raises)."""
        check_int("dataset_size", dataset_size, minimum=1)
        if epochs is None:
            raise ValueError("balls-in-bins needs epochs (the planned number of epochs over the "
                             "same bins: the whole run is priced at once)")
        return cls(num_bins=check_int("steps_per_epoch", steps_per_epoch, minimum=1),
                   epochs=epochs)

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--num-bins", type=int, required=True, metavar="T",
                            help="steps (bins) per epoch")
        parser.add_argument("--epochs", type=int, default=1,
                            help="planned epochs with the same bins (default 1)")

    @classmethod
    def from_cli_args(cls, args):
        return cls(num_bins=args.num_bins, epochs=args.epochs)
