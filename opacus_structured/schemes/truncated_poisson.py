"""Truncated Poisson sampling: fixed-shape batches priced by Ganesh (2025), Theorems 3.1/3.3/3.4.

Semantics (what :class:`TruncatedPoissonScheme`'s sampler draws): at every step each of the
``dataset_size`` = n examples joins independently with probability ``sample_rate`` = p; if more
than ``max_batch_size`` = B joined, a uniformly random size-B subset of them is kept; the batch
is padded to exactly B rows with masked (zero-gradient) slots. The clipped per-example gradients
of the real rows are summed, N(0, σ²C²) noise is added, and the result is divided by a fixed
public constant. See :mod:`opacus_structured.accounting.truncated_poisson` for the pairs.

Analyses (``analysis``):

* ``"tight"`` — the dominating pair of Theorem 3.1 (add/remove, restricted to :math:`|D| = n`),
  3.3 (zero-out) or 3.4 (replace-one), priced as the public mixture of two PLDs (Section 3.4).
  A sound upper bound; never above dp_accounting's ``TruncatedSubsampledGaussianDpEvent``.
* ``"baseline"`` — Chua et al. (2024): untruncated Poisson's (ε, δ) becomes
  (ε, δ + e^ε η), η = Pr[any of the T batches is truncated]. Valid but much looser; offered for
  comparison. It is not a per-step PLD, so :meth:`TruncatedPoissonScheme.pld` refuses it.

Epoch: ``epoch_steps`` batches (default ``floor(1/p)``, Opacus' convention), so the rate
Opacus' optimizer hook reports is ``1/epoch_steps`` (:meth:`expected_sample_rate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Optional

from .._validation import check_int, check_open_unit, check_positive
from ..accounting import pld as pld_lib
from ..accounting import truncated_poisson as tp
from .base import Scheme, register_scheme

__all__ = ["TruncatedPoissonScheme", "ANALYSES"]

ANALYSES = ("tight", "baseline")


@register_scheme
@dataclasses.dataclass(frozen=True)
class TruncatedPoissonScheme(Scheme):
    """Poisson sampling at rate p truncated to at most B examples, padded to B (fixed shape).

    Args:
        dataset_size: n, the (public, fixed) number of examples; the add/remove guarantee is for
            datasets of exactly this size (Definition 2.1, ``AR,n``).
        sample_rate: Poisson inclusion probability p in (0, 1].
        max_batch_size: B, integer in [1, n]; every batch has exactly B rows.
        relation: ``"add-remove"`` (Theorem 3.1), ``"zero-out"`` (3.3) or ``"replace-one"`` (3.4).
        analysis: ``"tight"`` (the theorems) or ``"baseline"`` ((ε, δ + e^ε η), Chua et al.).
        epoch_steps: batches per epoch (the sampler's ``len``); default ``floor(1/p)``.
    """

    name = "truncated-poisson"
    summary = ("Poisson sampling truncated to a max batch size B and padded to B "
               "(fixed shape), Ganesh 2025 Thm 3.1/3.3/3.4")

    dataset_size: int
    sample_rate: float
    max_batch_size: int
    relation: str = "add-remove"
    analysis: str = "tight"
    epoch_steps: Optional[int] = None

    def __post_init__(self):
        n, p, b = tp.check_parameters(self.dataset_size, self.sample_rate, self.max_batch_size)
        object.__setattr__(self, "dataset_size", n)
        object.__setattr__(self, "sample_rate", p)
        object.__setattr__(self, "max_batch_size", b)
        tp.check_relation(self.relation)
        if self.analysis not in ANALYSES:
            raise ValueError(f"analysis must be one of {ANALYSES}, got {self.analysis!r}")
        if self.epoch_steps is not None:
            object.__setattr__(self, "epoch_steps",
                               check_int("epoch_steps", self.epoch_steps, minimum=1))

    # ---- derived quantities ----------------------------------------------------------------
    @property
    def truncation_weight(self) -> float:
        """w₂ = Pr[Bin(n-1, p) ≥ B], the weight of the sensitivity-2 branch."""
        return tp.truncation_weight(self.dataset_size, self.sample_rate, self.max_batch_size)

    @property
    def conditional_sampling_probability(self) -> float:
        """q of Theorem 3.1 (closed form of Section 3.4)."""
        return tp.conditional_sampling_probability(self.dataset_size, self.sample_rate,
                                                   self.max_batch_size)

    @property
    def inclusion_probability(self) -> float:
        """Pr[a given example is in a batch] = E[min(Bin(n,p), B)] / n."""
        return tp.inclusion_probability(self.dataset_size, self.sample_rate, self.max_batch_size)

    def steps_per_epoch(self) -> int:
        if self.epoch_steps is not None:
            return self.epoch_steps
        return max(1, math.floor(1.0 / self.sample_rate + 1e-9))

    def expected_sample_rate(self) -> float:
        """``1/len(sampler)``: what Opacus' hook reports when our sampler drives the loader."""
        return 1.0 / self.steps_per_epoch()

    # ---- pricing -----------------------------------------------------------------------------
    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        """PLD of one step (tight analysis only; the baseline is not a per-step PLD)."""
        self.check_sample_rate(sample_rate)
        if self.analysis != "tight":
            raise ValueError("analysis='baseline' has no per-step PLD (its delta term depends on "
                             "the total number of steps); use epsilon()/delta() or the "
                             "accountant, or analysis='tight'")
        return tp.truncated_poisson_pld(self.dataset_size, self.sample_rate, self.max_batch_size,
                                        noise_multiplier, self.relation,
                                        discretization=discretization)

    def poisson_pld(self, noise_multiplier, *, discretization=pld_lib.DEFAULT_DISCRETIZATION):
        """PLD of one step of *untruncated* Poisson sampling under the same relation."""
        return tp.poisson_pld(self.sample_rate, noise_multiplier, self.relation,
                              discretization=discretization)

    def eta(self, steps: int) -> float:
        """η: probability that any of ``steps`` batches is truncated (baseline)."""
        return tp.truncation_eta(self.dataset_size, self.sample_rate, self.max_batch_size, steps)

    def infinite_epsilon_reason(self, noise_multiplier: float, steps: int,
                                delta: float) -> str | None:
        """Why ε(δ) is infinite, in one sentence (``None``: no scheme-specific reason; the
        command line then gives the generic one)."""
        if self.analysis != "baseline":
            return None
        eta = self.eta(steps)
        if eta >= delta:
            return (f"the baseline analysis spends delta on truncation: it needs delta > eta, "
                    f"but the probability that any of the {steps} batches is truncated is "
                    f"eta = {eta:.3g} >= delta = {delta:g}; use --analysis tight, a larger "
                    f"--max-batch-size or a larger --delta")
        return (f"the baseline analysis needs delta > e^eps * eta for Poisson's eps(delta - "
                f"e^eps * eta), which has no solution: eta = {eta:.3g} (probability that any "
                f"of the {steps} batches is truncated) is too close to delta = {delta:g}; use "
                f"--analysis tight, a larger --max-batch-size or a larger --delta")

    def _baseline_poisson(self, segments, discretization):
        return pld_lib.compose((self.poisson_pld(s, discretization=discretization), int(k))
                               for s, k in segments if k)

    def epsilon_for_segments(self, segments, delta, *,
                             discretization=pld_lib.DEFAULT_DISCRETIZATION) -> float:
        """ε(δ) for ``[(noise_multiplier, steps), ...]`` under this scheme's analysis."""
        delta = check_open_unit("delta", delta)
        segments = [(check_positive("noise_multiplier", s), check_int("steps", k, minimum=0))
                    for s, k in segments]
        if self.analysis == "baseline":
            total = sum(k for _, k in segments)
            return tp.baseline_epsilon(self._baseline_poisson(segments, discretization),
                                       self.eta(total), delta)
        composed = pld_lib.compose((self.pld(s, discretization=discretization), k)
                                   for s, k in segments if k)
        return pld_lib.epsilon_for_delta(composed, delta)

    def delta_for_segments(self, segments, epsilon, *,
                           discretization=pld_lib.DEFAULT_DISCRETIZATION) -> float:
        """δ(ε) for ``[(noise_multiplier, steps), ...]`` under this scheme's analysis."""
        segments = [(check_positive("noise_multiplier", s), check_int("steps", k, minimum=0))
                    for s, k in segments]
        if self.analysis == "baseline":
            total = sum(k for _, k in segments)
            return tp.baseline_delta(self._baseline_poisson(segments, discretization),
                                     self.eta(total), epsilon)
        composed = pld_lib.compose((self.pld(s, discretization=discretization), k)
                                   for s, k in segments if k)
        return float(pld_lib.delta_for_epsilon(composed, epsilon))

    def epsilon(self, noise_multiplier, steps, delta, *,
                discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        self.check_sample_rate(sample_rate)
        return self.epsilon_for_segments([(noise_multiplier, steps)], delta,
                                         discretization=discretization)

    def delta(self, noise_multiplier, steps, epsilon, *,
              discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        self.check_sample_rate(sample_rate)
        return self.delta_for_segments([(noise_multiplier, steps)], epsilon,
                                       discretization=discretization)

    # ---- sampler -----------------------------------------------------------------------------
    def sampler_for_dataset(self, num_examples: int, *, generator=None):
        """Refused, naming the two samplers to pass instead: the unpadded one (``pad=False``:
        at most B real rows per batch, the same mechanism since the optimizer divides by a
        fixed public batch size; a stock ``training_step`` runs unchanged) or the padded
        fixed-shape one (``PaddedDataset`` + ``masked_loss`` in ``training_step``)."""
        raise ValueError(
            f"scheme {self.name!r} needs its sampler chosen: pass DPCallback(sampler=lambda "
            f"dataset, generator: scheme.sampler(len(dataset), generator=generator, pad=False)) "
            f"for unpadded batches of at most max_batch_size={self.max_batch_size} real rows "
            f"(the same mechanism and epsilon; no change to training_step), or, for batches of "
            f"exactly B rows, truncated_poisson_data_loader(...) (PaddedDataset; training_step "
            f"must weight the per-sample loss with masked_loss)")

    def batch_distribution(self) -> tuple:
        """Poisson at rate p truncated to ``max_batch_size``, ``steps_per_epoch()`` batches per
        epoch (the relation and the analysis only change the pricing)."""
        return ("truncated-poisson", self.dataset_size, self.sample_rate, self.max_batch_size,
                self.steps_per_epoch())

    # ---- from a training run ------------------------------------------------------------------
    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: Optional[int] = None, max_batch_size: Optional[int] = None,
                      relation: str = "add-remove",
                      analysis: str = "tight") -> "TruncatedPoissonScheme":
        """Poisson at ``p = 1/steps_per_epoch`` (Opacus' rate for a loader of that length)
        truncated to ``max_batch_size`` (required: no DataLoader carries it), with
        ``steps_per_epoch`` batches per epoch. ``epochs`` is not needed."""
        n = check_int("dataset_size", dataset_size, minimum=1)
        k = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        if max_batch_size is None:
            raise ValueError(
                f"truncated-poisson needs max_batch_size (the truncated, fixed batch size B, an "
                f"integer in [1, {n}]): the expected batch is {n / k:.6g}, and B a little above "
                f"it costs little privacy (`opacus-structured advise` suggests one: the smallest "
                f"B whose epsilon is within 1% of Poisson's)")
        return cls(dataset_size=n, sample_rate=1.0 / k, max_batch_size=max_batch_size,
                   relation=relation, analysis=analysis, epoch_steps=k)

    # ---- command line --------------------------------------------------------------------------
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dataset-size", type=int, required=True, metavar="n",
                            help="number of examples n (fixed and public)")
        parser.add_argument("--sample-rate", type=float, required=True, metavar="p",
                            help="Poisson inclusion probability p, in (0, 1]")
        parser.add_argument("--max-batch-size", type=int, required=True, metavar="B",
                            help="truncated (and padded) batch size B, in [1, n]")
        parser.add_argument("--relation", choices=tp.RELATIONS, default="add-remove",
                            help="neighbouring relation (Thm 3.1 / 3.3 / 3.4); "
                                 "default add-remove")
        parser.add_argument("--analysis", choices=ANALYSES, default="tight",
                            help="tight: Ganesh 2025 dominating pair; baseline: Poisson "
                                 "(eps, delta + e^eps eta) of Chua et al. 2024")
        parser.add_argument("--epoch-steps", type=int, default=None, metavar="K",
                            help="batches per epoch (default floor(1/p))")

    @classmethod
    def from_cli_args(cls, args):
        return cls(dataset_size=args.dataset_size, sample_rate=args.sample_rate,
                   max_batch_size=args.max_batch_size, relation=args.relation,
                   analysis=args.analysis, epoch_steps=args.epoch_steps)
