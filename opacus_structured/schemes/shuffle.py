r"""Shuffled fixed-size batches as a scheme (``shuffle``): what ``DataLoader(shuffle=True)`` and
Opacus' ``make_private(poisson_sampling=False)`` train with.

Semantics: every epoch draws a uniformly random permutation of the ``dataset_size`` = n
examples (a fresh one per epoch) and cuts it into consecutive batches of ``batch_size`` = B;
the last batch has ``n mod B`` examples, or is dropped with ``drop_last`` (torch's
``BatchSampler`` semantics: ``ceil(n/B)`` steps per epoch, ``floor(n/B)`` with ``drop_last``).
Every example is in at most one batch per epoch. A sequential loader (``SequentialSampler``,
the same order every epoch) is covered by the same bound, which does not use the randomness.

Relation and pricing: :mod:`opacus_structured.accounting.shuffle` — ``"zero-out"`` (default;
add/remove with the example's slot kept, sensitivity 1) or ``"replace-one"`` (substitution,
sensitivity 2); no amplification: :math:`E` epochs are :math:`\mu`-GDP with
:math:`\mu = \Delta\sqrt E/\sigma` (``bound="upper"``, a guarantee; exact closed form). The unit
is an epoch and a partial epoch is priced as a full one. ``bound="lower"`` gives instead the
lower bound of Chua et al. (ICML 2024, NeurIPS 2024) — labelled :attr:`BoundKind.LOWER`, never
a guarantee (the accountant, calibration and training refuse it) — to show what shuffling costs
at least, next to Poisson subsampling at :math:`q = 1/K` (:meth:`ShuffleScheme.compare`).

Without ``dataset_size`` / ``batch_size`` the scheme is a *template* (what
``PrivacyEngine(accountant="shuffle")`` builds by name): it takes the steps per epoch from the
rate Opacus' hook reports, :math:`K = 1/q` (``1/len(data_loader)``), and the accountant binds
the concrete scheme from the DataLoader it is attached to.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Optional

from dp_accounting.pld import privacy_loss_distribution as dp_pld

from .._validation import check_int, check_open_unit, check_positive
from ..accounting import pld as pld_lib
from ..accounting import shuffle as sh
from ..accounting.gaussian import gdp_delta, gdp_epsilon, gdp_mu
from ..accounting.resource_guard import PricedEpsilon
from .base import BoundKind, Scheme, register_scheme
from .poisson import PoissonScheme

__all__ = ["ShuffleScheme", "shuffle_steps_per_epoch"]

BOUNDS = ("upper", "lower")


def shuffle_steps_per_epoch(dataset_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches per epoch of torch's ``BatchSampler``: ``ceil(n/B)``, ``floor(n/B)`` with
    ``drop_last``."""
    n = check_int("dataset_size", dataset_size, minimum=1)
    b = check_int("batch_size", batch_size, minimum=1)
    return n // b if drop_last else -(-n // b)


@register_scheme
@dataclasses.dataclass(frozen=True)
class ShuffleScheme(Scheme):
    """A fresh random permutation per epoch, cut into batches of ``batch_size`` (module doc).

    Args:
        dataset_size: n >= 1 (public); ``None`` with ``batch_size=None``: a template that takes
            the steps per epoch from Opacus' hook.
        batch_size: B in [1, n] (``drop_last`` needs at least one full batch).
        drop_last: drop the last partial batch (torch's ``drop_last``).
        relation: ``"zero-out"`` (sensitivity 1) or ``"replace-one"`` (sensitivity 2).
        bound: ``"upper"`` (the guarantee) or ``"lower"`` (Chua et al.'s lower bound, labelled,
            never a guarantee).
    """

    name = "shuffle"
    summary = ("shuffled fixed-size batches (DataLoader(shuffle=True)), no amplification: "
               "mu = sqrt(E)/sigma per relation; Chua et al. 2024 lower bound")
    unit = "epoch"

    dataset_size: Optional[int] = None
    batch_size: Optional[int] = None
    drop_last: bool = False
    relation: str = "zero-out"
    bound: str = "upper"

    def __post_init__(self):
        if (self.dataset_size is None) != (self.batch_size is None):
            raise ValueError("give both dataset_size and batch_size, or neither (a template "
                             "whose epoch length comes from Opacus' hook)")
        if not isinstance(self.drop_last, bool):
            raise ValueError(f"drop_last must be a bool, got {self.drop_last!r}")
        if self.dataset_size is not None:
            n = check_int("dataset_size", self.dataset_size, minimum=1)
            b = check_int("batch_size", self.batch_size, minimum=1, maximum=n)
            object.__setattr__(self, "dataset_size", n)
            object.__setattr__(self, "batch_size", b)
        if self.relation not in sh.RELATIONS:
            raise ValueError(f"relation must be one of {sh.RELATIONS}, got {self.relation!r}")
        if self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {self.bound!r}")
        object.__setattr__(self, "bound", BoundKind(self.bound))

    # ---- the epoch ------------------------------------------------------------------------
    def is_template(self) -> bool:
        """True without a dataset size: the epoch length comes from Opacus' hook."""
        return self.dataset_size is None

    def template_options(self) -> dict[str, Any]:
        return {"relation": self.relation, "bound": self.bound.value}

    @property
    def accepts_new_stream(self) -> bool:
        """A new pass (a new permutation) is priced as a new epoch by the shuffle accountant,
        so a run may continue on a new stream."""
        return True

    def steps_per_epoch(self) -> int:
        if self.is_template():
            raise NotImplementedError("a ShuffleScheme template has no epoch length (it comes "
                                      "from Opacus' hook: 1/sample_rate)")
        return shuffle_steps_per_epoch(self.dataset_size, self.batch_size, self.drop_last)

    def expected_sample_rate(self) -> Optional[float]:
        return None if self.is_template() else 1.0 / self.steps_per_epoch()

    def steps_per_epoch_at(self, sample_rate: Optional[float]) -> int:
        """Noisy steps per epoch: the scheme's own, or for a template ``1/sample_rate`` (the
        rate Opacus reports; with gradient accumulation of ``k`` batches per step the rate is
        ``k/len(loader)``, which must divide the epoch into whole steps)."""
        if not self.is_template():
            self.check_sample_rate(sample_rate)
            return self.steps_per_epoch()
        if sample_rate is None:
            raise ValueError("a ShuffleScheme template needs the sample_rate Opacus' hook "
                             "reports (1/len(data_loader)) to know the epoch length; or give "
                             "dataset_size and batch_size")
        q = check_positive("sample_rate", sample_rate)
        k = round(1.0 / q)
        if k < 1 or not math.isclose(k * q, 1.0, rel_tol=1e-6):
            raise ValueError(
                f"sample_rate={q:.6g} is not 1/(steps per epoch): 1/q = {1.0 / q:.6g} is not an "
                f"integer (gradient accumulation that does not divide the epoch? a noisy step "
                f"could then hold an example twice); accumulate a divisor of len(data_loader) "
                f"batches per step")
        return k

    def epochs(self, steps: int, sample_rate: Optional[float] = None) -> int:
        """Epochs begun after ``steps`` steps: ``ceil(steps/K)`` (a partial epoch counts)."""
        steps = check_int("steps", steps, minimum=0)
        return -(-steps // self.steps_per_epoch_at(sample_rate))

    def compositions(self, steps: int) -> int:
        return self.epochs(steps)

    def implemented_by(self, sampler_scheme) -> bool:
        """Any shuffling sampler for a template; else one drawing the same batches (n, B,
        drop_last; the relation and bound are pricing choices)."""
        if not isinstance(sampler_scheme, ShuffleScheme):
            return False
        return self.is_template() or \
            sampler_scheme.batch_distribution() == self.batch_distribution()

    def batch_distribution(self) -> tuple:
        return (self.name, self.dataset_size, self.batch_size, self.drop_last)

    def checkpoint_scheme(self, saved: Scheme) -> Optional[Scheme]:
        """A template adopts the saved concrete scheme of the same relation and bound; a saved
        template resumes under this concrete scheme (its history's rates are then checked)."""
        if saved == self:
            return self
        if not isinstance(saved, ShuffleScheme) or \
                (saved.relation, saved.bound) != (self.relation, self.bound):
            return None
        if self.is_template():
            return saved
        if saved.is_template():
            return self
        return None

    # ---- pricing --------------------------------------------------------------------------
    @property
    def sensitivity(self) -> float:
        """Δ of one epoch's release, in units of the clip norm (1 zero-out, 2 replace-one)."""
        return sh.SENSITIVITY[self.relation]

    def mu(self, noise_multiplier: float, steps: int, sample_rate: Optional[float] = None):
        """μ = Δ√E/σ after ``steps`` steps (``E = ceil(steps/K)``)."""
        sigma = check_positive("noise_multiplier", noise_multiplier)
        return self.sensitivity * math.sqrt(self.epochs(steps, sample_rate)) / sigma

    def _require_upper(self, what: str) -> None:
        if self.bound != BoundKind.UPPER:
            raise ValueError(f"ShuffleScheme(bound='lower') is an optimistic lower bound, never "
                             f"a guarantee: it cannot {what}; use bound='upper'")

    def pld(self, noise_multiplier, *, sample_rate=None,
            discretization=pld_lib.DEFAULT_DISCRETIZATION):
        """Pessimistic PLD of one epoch: the Gaussian mechanism with sensitivity Δ
        (dp_accounting's ``from_gaussian_mechanism``). Upper bound only."""
        self._require_upper("give a PLD to compose")
        if not self.is_template():
            self.check_sample_rate(sample_rate)
        sigma = check_positive("noise_multiplier", noise_multiplier)
        return dp_pld.from_gaussian_mechanism(
            standard_deviation=sigma, sensitivity=self.sensitivity, pessimistic_estimate=True,
            value_discretization_interval=check_positive("discretization", discretization))

    def epsilon(self, noise_multiplier, steps, delta, *,
                discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        r"""ε(δ) after ``steps`` steps. ``bound="upper"``: exact μ-GDP closed form,
        :math:`\mu = \Delta\sqrt{E}/\sigma` (route ``"closed-form"``; ``discretization`` unused).
        ``bound="lower"``: Chua et al.'s lower bound
        (:func:`~opacus_structured.accounting.shuffle.epsilon_lower_bound`, optimistic PLD at
        ``max(discretization, 1e-3)``), labelled by :attr:`bound`, NOT a guarantee."""
        noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        delta = check_open_unit("delta", delta)
        d = check_positive("discretization", discretization)
        epochs = self.epochs(steps, sample_rate)
        if self.bound == BoundKind.LOWER:
            return sh.epsilon_lower_bound(noise_multiplier, self.steps_per_epoch_at(sample_rate),
                                          epochs, delta, self.relation,
                                          discretization=max(d, 1e-3)) if epochs else 0.0
        mu = self.mu(noise_multiplier, steps, sample_rate)
        return PricedEpsilon(gdp_epsilon(delta, mu), "closed-form",
                             f"exact mu-GDP closed form, mu = {self.sensitivity:g} sqrt(E)/sigma "
                             f"over E = {epochs} epoch(s) (no amplification, no discretisation)",
                             mu=mu)

    def delta(self, noise_multiplier, steps, epsilon, *,
              discretization=pld_lib.DEFAULT_DISCRETIZATION, sample_rate=None):
        """δ(ε): exact μ-GDP (upper) or Chua et al.'s lower bound (``bound="lower"``)."""
        noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        check_positive("discretization", discretization)
        epochs = self.epochs(steps, sample_rate)
        if self.bound == BoundKind.LOWER:
            return sh.multi_epoch_delta_lower_bound(
                noise_multiplier, self.steps_per_epoch_at(sample_rate), epochs, epsilon,
                self.relation, discretization=max(discretization, 1e-3))
        return gdp_delta(epsilon, self.mu(noise_multiplier, steps, sample_rate))

    def noise_for_epsilon(self, target_epsilon: float, steps: int, delta: float) -> float:
        r"""Smallest σ with ε(δ) ≤ ``target_epsilon`` after ``steps`` steps, by inversion
        (:math:`\sigma = \Delta\sqrt E/\mu^*`, :math:`\mu^*` = ``gdp_mu``), raised until the
        closed form confirms the target (never under-reports). Upper bound only."""
        self._require_upper("be calibrated")
        target_epsilon = check_positive("target_epsilon", target_epsilon)
        delta = check_open_unit("delta", delta)
        epochs = self.epochs(check_int("steps", steps, minimum=1))
        mu = gdp_mu(target_epsilon, delta)
        if not mu > 0:
            raise ValueError(f"no noise multiplier reaches epsilon={target_epsilon:g} at "
                             f"delta={delta:g}")
        sigma = self.sensitivity * math.sqrt(epochs) / mu
        bump = 1e-12
        for _ in range(64):
            if float(self.epsilon(sigma, steps, delta)) <= target_epsilon:
                return sigma
            sigma = math.nextafter(sigma * (1.0 + bump), math.inf)
            bump *= 2.0
        raise ValueError(f"could not confirm sigma={sigma:g} for epsilon={target_epsilon:g}")

    def compare(self, noise_multiplier: float, steps: int, delta: float, *,
                sample_rate: Optional[float] = None, discretization: float = 1e-3) -> dict:
        """The price of shuffling: ``{"upper": guarantee, "lower": Chua et al.'s lower bound
        (not a guarantee), "poisson": Poisson subsampling's ε at q = 1/K over the same steps
        (what Opacus prints for this loader, valid only for Poisson batches)}``."""
        upper = dataclasses.replace(self, bound="upper")
        lower = dataclasses.replace(self, bound="lower")
        k = self.steps_per_epoch_at(sample_rate)
        poisson = PoissonScheme(sample_rate=1.0 / k).epsilon(
            noise_multiplier, steps, delta, discretization=discretization)
        return {"upper": float(upper.epsilon(noise_multiplier, steps, delta,
                                             sample_rate=sample_rate)),
                "lower": float(lower.epsilon(noise_multiplier, steps, delta,
                                             sample_rate=sample_rate,
                                             discretization=discretization)),
                "poisson": float(poisson), "epochs": self.epochs(steps, sample_rate),
                "steps_per_epoch": k}

    # ---- from a training run / the command line ----------------------------------------------
    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: Optional[int] = None, batch_size: Optional[int] = None,
                      drop_last: bool = False, relation: str = "zero-out",
                      bound: str = "upper") -> "ShuffleScheme":
        """The scheme of a loader over ``dataset_size`` examples with ``steps_per_epoch`` batches
        (``len(data_loader)``) of ``batch_size`` (default the smallest B giving that many
        batches); ``epochs`` is not needed (each epoch is priced on its own)."""
        n = check_int("dataset_size", dataset_size, minimum=1)
        k = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        b = -(-n // k) if batch_size is None else check_int("batch_size", batch_size,
                                                             minimum=1)
        scheme = cls(dataset_size=n, batch_size=min(b, n), drop_last=bool(drop_last),
                     relation=relation, bound=bound)
        if scheme.steps_per_epoch() != k:
            raise ValueError(f"batch_size={b} gives {scheme.steps_per_epoch()} batches per "
                             f"epoch over {n} examples (drop_last={drop_last}), but the "
                             f"DataLoader has {k}")
        return scheme

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dataset-size", type=int, required=True, metavar="n",
                            help="number of examples n (public)")
        parser.add_argument("--batch-size", type=int, required=True, metavar="B",
                            help="fixed batch size B, in [1, n]")
        parser.add_argument("--drop-last", action="store_true",
                            help="drop the last partial batch (floor(n/B) steps per epoch)")
        parser.add_argument("--relation", choices=sh.RELATIONS, default="zero-out",
                            help="zero-out (sensitivity 1, default) or replace-one (2)")
        parser.add_argument("--bound", choices=BOUNDS, default="upper",
                            help="upper: the guarantee (mu = sqrt(E)/sigma); lower: Chua et "
                                 "al. 2024's lower bound (NOT a guarantee)")

    @classmethod
    def from_cli_args(cls, args):
        return cls(dataset_size=args.dataset_size, batch_size=args.batch_size,
                   drop_last=bool(args.drop_last), relation=args.relation, bound=args.bound)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (the bound kind as its string): checkpoints load with
        ``torch.load(weights_only=True)``."""
        return {"scheme": self.name, **self.describe()}

    def describe(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["bound"] = self.bound.value
        return out
