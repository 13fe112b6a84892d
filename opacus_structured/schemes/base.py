"""Batching schemes: frozen descriptions of *what happens* in one training step.

Following dp_accounting's split of ``DpEvent`` (what happened) from accountants (how it is
priced), a :class:`Scheme` is a validated, frozen dataclass holding every public parameter of
a batching procedure and neighbouring relation. It is the single source of truth from which

* the accountant prices a step (:meth:`Scheme.pld`, built from the theorem functions in
  :mod:`opacus_structured.accounting`),
* the matching sampler is built (``scheme.sampler(...)`` where a scheme has one), and
* the CLI reads its flags (:meth:`Scheme.add_cli_arguments` / :meth:`Scheme.from_cli_args`),

so sampler, accountant and command line cannot disagree about a parameter.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import math
from typing import Any, ClassVar

from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

from .._validation import check_int, check_open_unit, check_positive
from ..accounting import numerics
from ..accounting import pld as pld_lib
from ..accounting.bounds import BoundKind
from ..accounting.numerics import NumericalPrecisionError
from ..accounting.resource_guard import MAX_DISCRETIZATION, PricedEpsilon, ResourceBudgetError
from .registry import SCHEMES, get_scheme_class, register_scheme, sampler_factory_for

__all__ = ["Scheme", "SCHEMES", "register_scheme", "get_scheme_class", "BoundKind",
           "best_route", "below_precision"]


def best_route(pld_value, alternatives):
    """The smallest of a certified PLD ε and the certified ``alternatives`` (each a sound upper
    bound, so their minimum is one); an alternative that wins says by how much in its note."""
    best = min(alternatives, key=float, default=None)
    if best is None or not float(best) < float(pld_value):
        return pld_value
    return PricedEpsilon(float(best), best.route,
                         f"{best.note}; below the certified PLD value {float(pld_value):.6g} on "
                         f"this grid", **best.details, pld_epsilon=float(pld_value))


def below_precision(error, alternatives):
    """The smallest certified alternative, its note naming the PLD round-off floor that ruled
    the PLD out; ``error`` re-raised when there is none."""
    best = min(alternatives, key=float, default=None)
    if best is None:
        raise error
    return PricedEpsilon(
        float(best), best.route,
        f"{best.note}; certified at this delta, the PLD route is not: its FFT round-off after "
        f"{error.compositions:,} compositions is about {error.floor:.2g} in delta, and a "
        f"certified PLD epsilon needs delta >= {numerics.CERTIFY_FACTOR:g} x that",
        **best.details, pld_roundoff=error.floor, compositions=error.compositions)


def noise_bands(coefficients) -> float:
    """Bands of an optimizer's ``noise_correlation``: ``len(c)`` for banded Toeplitz
    coefficients, ``inf`` for a dense strategy (a ``BufferedToeplitz``)."""
    if hasattr(coefficients, "buf_decay"):
        return math.inf
    return len([float(v) for v in coefficients])


@dataclasses.dataclass(frozen=True)
class Scheme(abc.ABC):
    """Base class of batching schemes (subclasses are frozen dataclasses).

    Subclasses set ``name`` (CLI and registry name), ``summary`` (one line for
    ``opacus-structured schemes``) and implement :meth:`pld`.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: The accounting unit composed by :meth:`compositions` ("step" or "epoch").
    unit: ClassVar[str] = "step"
    #: True only for matrix-mechanism schemes whose pricing covers correlated (multi-band)
    #: noise; callbacks refuse a correlated-noise optimizer under any other scheme.
    prices_correlated_noise: ClassVar[bool] = False

    # ---- what a training loop may release (the privacy ledger) ----------------------------
    @property
    def correlated_noise(self) -> bool:
        """Whether the noise this scheme prices is correlated across steps (a strategy other
        than ``"identity"``): then a step's noise depends on its position in the run."""
        strategy = getattr(self, "strategy", None)
        return self.prices_correlated_noise and strategy not in (None, "identity")

    @property
    def release_policy(self) -> str:
        """How the accountant prices a run whose noisy steps are not exactly the sampler's
        draws in order (:mod:`opacus_structured.accountants.ledger`):

        * ``"independent"`` — every step is its own subsampled mechanism (per-step unit,
          independent noise): a draw that was never released costs nothing; the released steps
          are priced, one each;
        * ``"span"`` — independent noise, units of several steps (an epoch, a cycle, a planned
          run): releasing a subset of the draws is post-processing of releasing them all, so
          every draw up to the last released one is priced;
        * ``"exact"`` — correlated noise: a step's noise is tied to its position, so the released
          steps must be the sampler's draws in order, with none skipped; anything else raises.

        In every policy a draw is released at most once, in increasing order.
        """
        if self.correlated_noise:
            return "exact"
        return "independent" if self.unit == "step" else "span"

    @property
    def accepts_new_stream(self) -> bool:
        """Whether a run may continue on a *new* sampler stream (another seed, a sampler that
        cannot restore its state, e.g. Opacus' own) after a resume: true when every step is an
        independent mechanism (``release_policy == "independent"``); schemes whose accountant
        prices each new pass on its own (``shuffle``) override it."""
        return self.release_policy == "independent"

    def check_noise_correlation(self, coefficients) -> None:
        """Raise ``ValueError`` unless this scheme's ε is valid for an optimizer adding
        correlated noise with first-column coefficients ``coefficients`` (``[1]`` = DP-SGD).

        Default: only independent noise (``len(c) == 1``) unless :attr:`prices_correlated_noise`;
        matrix-mechanism schemes override this to check the strategy they price.
        """
        bands = noise_bands(coefficients)
        if bands > 1 and not self.prices_correlated_noise:
            raise ValueError(
                f"the optimizer adds correlated noise ({bands} bands) but scheme {self.name!r} "
                f"prices independent Gaussian noise per step, which would give a wrong epsilon; "
                f"use a matrix-mechanism scheme (e.g. 'bandmf-cyclic-poisson') or a plain "
                f"DPOptimizer")

    # ---- pricing -------------------------------------------------------------------------
    @abc.abstractmethod
    def pld(self, noise_multiplier: float, *, sample_rate: float | None = None,
            discretization: float = pld_lib.DEFAULT_DISCRETIZATION) -> PrivacyLossDistribution:
        """Pessimistic PLD of one accounting unit (see :attr:`unit`) at this noise multiplier.

        ``sample_rate`` is the rate reported by Opacus' optimizer hook; schemes that carry their
        own rate check it with :meth:`check_sample_rate` and otherwise ignore it.
        """

    @property
    def bound(self) -> BoundKind:
        """:class:`BoundKind` of the ε this scheme's :meth:`pld` yields."""
        return BoundKind.UPPER

    def compositions(self, steps: int) -> int:
        """Number of accounting units covering ``steps`` optimizer steps."""
        steps = check_int("steps", steps, minimum=0)
        # A partial unit is post-processing of a full one: round up (never under-report).
        return math.ceil(steps / self.steps_per_unit())

    def steps_per_unit(self) -> int:
        """Optimizer steps covered by one :meth:`pld` (one accounting unit): 1 for per-step
        schemes, :meth:`steps_per_epoch` for per-epoch ones. Schemes whose unit is something
        else (a BandMF cycle, a whole balls-in-bins run) override it; accountants chunk the step
        history by it, so it must be exactly the span of steps one :meth:`pld` prices."""
        return 1 if self.unit == "step" else self.steps_per_epoch()

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (schemes with an epoch notion override this)."""
        raise NotImplementedError(f"scheme {self.name!r} has no notion of an epoch")

    def expected_sample_rate(self) -> float | None:
        """The ``sample_rate`` Opacus' hook reports when this scheme's sampler drives the
        DataLoader (``1 / len(data_loader)``), or ``None`` when the scheme takes it from the hook.
        """
        return None

    def check_sample_rate(self, sample_rate: float | None) -> None:
        """Raise if Opacus' reported ``sample_rate`` contradicts this scheme (wrong loader)."""
        expected = self.expected_sample_rate()
        if sample_rate is None or expected is None:
            return
        if not math.isclose(sample_rate, expected, rel_tol=1e-6, abs_tol=1e-12):
            raise ValueError(
                f"the optimizer hook reports sample_rate={sample_rate:.6g} (1/len(data_loader)) "
                f"but scheme {self.name!r} implies {expected:.6g}: the DataLoader does not use "
                f"this scheme's sampler (or uses gradient accumulation); pass "
                f"scheme.sampler(...) as the DataLoader's batch_sampler")

    def implemented_by(self, sampler_scheme) -> bool:
        """Whether batches drawn by a sampler implementing ``sampler_scheme`` (its ``scheme``
        attribute) are what this scheme prices. Default: the same scheme with the same
        parameters; schemes that take a parameter from Opacus' hook (a rate-less
        ``PoissonScheme``) or whose samplers carry a parameter record override it."""
        return sampler_scheme == self

    def is_template(self) -> bool:
        """Whether this scheme leaves a parameter to the training run (a rate-less
        ``PoissonScheme``, a size-less ``ShuffleScheme``: what an accountant built by name
        holds); ``make_private`` then builds the concrete scheme from the DataLoader, keeping
        :meth:`template_options`. Default ``False``."""
        return False

    def template_options(self) -> dict[str, Any]:
        """Pricing choices of a template that the concrete scheme built from it keeps."""
        return {}

    def checkpoint_scheme(self, saved: "Scheme") -> "Scheme | None":
        """The scheme to price with after loading an accountant checkpoint taken under
        ``saved``, or ``None`` if the two are incompatible. Default: ``self`` if equal. Schemes
        with a template override it: a template adopts the saved concrete scheme, a concrete
        scheme resumes a checkpoint taken under its template (the accountant then checks the
        history's rates against it)."""
        return self if saved == self else None

    def epsilon(self, noise_multiplier: float, steps: int, delta: float, *,
                discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
                sample_rate: float | None = None) -> float:
        """ε(δ) after ``steps`` optimizer steps at a constant noise multiplier.

        The PLD route's ε is certified against its numerical error (:mod:`~opacus_structured.
        accounting.numerics`); where δ is too close to the round-off floor, the scheme's
        :meth:`epsilon_below_precision` route prices it (labelled) or refuses.
        """
        noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        n = self.compositions(steps)
        if n == 0:
            return 0.0
        delta = check_open_unit("delta", delta)
        step = self.pld(noise_multiplier, sample_rate=sample_rate, discretization=discretization)
        try:
            numerics.check_a_priori(n, delta)
            try:
                value = pld_lib.epsilon_for_delta(pld_lib.self_compose(step, n), delta)
            except ResourceBudgetError as exc:
                return self.epsilon_over_budget(exc, noise_multiplier, steps, delta,
                                                discretization=discretization,
                                                sample_rate=sample_rate)
        except NumericalPrecisionError as exc:
            return self.epsilon_below_precision(exc, noise_multiplier, steps, delta,
                                                discretization=discretization,
                                                sample_rate=sample_rate)
        return best_route(value, self.certified_alternatives_below(
            [(noise_multiplier, sample_rate, steps)], delta, float(value)))

    def certified_alternatives_below(self, history, delta: float, below: float) -> list:
        """:meth:`certified_alternatives` for :func:`best_route` against a PLD value
        ``below``: a scheme may leave out a route it proves to be at least ``below`` (it could
        not be chosen) without computing it. Default: every route."""
        return self.certified_alternatives(history, delta)

    def certified_alternatives(self, history, delta: float) -> list:
        """Routes other than the PLD that are certified at every δ for a run described by
        ``history`` (Opacus' ``(noise_multiplier, sample_rate, steps)`` entries), as
        :class:`~opacus_structured.accounting.resource_guard.PricedEpsilon` values.

        ε is the smallest certified value (:func:`best_route`): each route's ε(δ) is
        non-increasing in δ and the PLD route is certified on an interval ``δ ≥ floor``, so
        the minimum stays monotone across the switch. Default: none; Poisson subsampling
        returns its Rényi-DP bound.
        """
        return []

    def epsilon_below_precision(self, error: NumericalPrecisionError, noise_multiplier: float,
                                steps: int, delta: float, *, discretization: float,
                                sample_rate: float | None = None) -> PricedEpsilon:
        """ε when δ is within :data:`~opacus_structured.accounting.numerics.CERTIFY_FACTOR` of
        the PLD route's round-off floor (``error``): the best :meth:`certified_alternatives`
        route, labelled, or ``error`` re-raised (one line naming δ, the floor and the fixes)."""
        return below_precision(error, self.certified_alternatives(
            [(noise_multiplier, sample_rate, steps)], delta))

    def epsilon_over_budget(self, error: ResourceBudgetError, noise_multiplier: float,
                            steps: int, delta: float, *, discretization: float,
                            sample_rate: float | None = None) -> PricedEpsilon:
        r"""ε when the PLD at ``discretization`` would exceed the memory budget (``error``).

        Default route: the same pessimistic PLD on a coarser grid
        :math:`d' = d \cdot r` with :math:`r \ge 1.25\,\text{estimate}/\text{budget}` (the
        composed grid has :math:`\propto 1/d` points), as long as :math:`d' \le`
        :data:`~opacus_structured.accounting.resource_guard.MAX_DISCRETIZATION`. A pessimistic
        discretisation upper-bounds ε at every grid step, so the result is sound; it is looser
        than at ``d`` by the extra rounding (less than one grid step :math:`d'` of privacy loss
        per composition) and labelled ``route="coarse-pld"``. Otherwise ``error`` is re-raised
        (one line naming ``--memory-budget``). Schemes with a cheaper sound route (a closed form,
        an RDP bound) override this.
        """
        ratio = max(error.estimated_bytes / max(error.budget, 1), 1.0)
        coarse = discretization
        for _ in range(8):
            coarse = float(f"{coarse * max(1.25 * ratio, 2.0):.2g}")
            if coarse > MAX_DISCRETIZATION:
                raise error
            step = self.pld(noise_multiplier, sample_rate=sample_rate, discretization=coarse)
            try:
                value = pld_lib.epsilon_for_delta(
                    pld_lib.self_compose(step, self.compositions(steps)), delta)
            except ResourceBudgetError as again:
                ratio = max(again.estimated_bytes / max(again.budget, 1), 1.0)
                continue
            return PricedEpsilon(
                value, "coarse-pld",
                f"pessimistic PLD on a coarser grid (discretization {coarse:g} instead of "
                f"{discretization:g}) to stay within the memory budget: still an upper bound, "
                f"looser by the extra rounding (under one grid step of privacy loss per "
                f"composition); raise --memory-budget for the requested grid",
                discretization_used=coarse, refused_estimate_bytes=error.estimated_bytes,
                memory_budget_bytes=error.budget)
        raise error

    def delta(self, noise_multiplier: float, steps: int, epsilon: float, *,
              discretization: float = pld_lib.DEFAULT_DISCRETIZATION,
              sample_rate: float | None = None) -> float:
        """δ(ε) after ``steps`` optimizer steps at a constant noise multiplier."""
        noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        n = self.compositions(steps)
        step = None if n == 0 else self.pld(
            noise_multiplier, sample_rate=sample_rate, discretization=discretization)
        # Over the memory budget, self_compose raises ResourceBudgetError (a ValueError naming
        # --memory-budget) before allocating; schemes with a closed form override delta().
        return pld_lib.delta_for_epsilon(pld_lib.self_compose(step, n) if step else None,
                                         epsilon)

    def batch_distribution(self) -> tuple:
        """What determines the batches this scheme draws (and nothing about how they are
        priced): two schemes with equal ``batch_distribution()`` are drawn by the same sampler.
        Default: every field. Schemes with pricing-only fields (a neighbouring relation, an
        analysis, a noise strategy) override it, so one sampler can carry any of them."""
        return (self.name, *dataclasses.astuple(self))

    # ---- sampler -------------------------------------------------------------------------
    def sampler(self, data=None, *, generator=None, seed=None, **options):
        """The torch batch sampler implementing exactly this scheme (registered by its sampler
        module with :func:`~opacus_structured.schemes.registry.register_sampler`).

        One signature for every scheme: ``data`` is what the DataLoader's dataset holds — the
        number of examples, or for time-series windows the series lengths. Schemes that fix it
        (``dataset_size`` of truncated Poisson and cyclic Poisson, ``num_series ×
        series_length`` of structured windows) take it as optional and check it when given.
        ``generator`` (a dedicated ``torch.Generator``) or ``seed`` seed the draws; without
        either, OS entropy does. ``options`` are scheme-specific (``steps``, ``pad``).

        Samplers follow one protocol: ``__iter__`` yields lists of dataset indices (or, for
        structured schemes, ``(series, start)`` pairs), ``__len__`` is the number of steps per
        epoch, a ``scheme`` attribute holds this scheme, and ``state_dict()`` /
        ``load_state_dict()`` make a resumed run continue exactly.
        """
        factory = sampler_factory_for(self)
        if factory is None:
            raise NotImplementedError(f"scheme {self.name!r} has no sampler")
        args = () if data is None else (data,)
        return factory(self, *args, generator=generator, seed=seed, **options)

    def sampler_for_dataset(self, num_examples: int, *, generator=None):
        """This scheme's sampler for a map-style dataset of ``num_examples`` examples (what
        callbacks install in a DataLoader). Default: ``sampler(num_examples, generator=...)``;
        schemes that carry their dataset size check it, schemes that need more than the size
        raise ``ValueError`` saying what to pass instead."""
        return self.sampler(num_examples, generator=generator)

    # ---- from a training run -------------------------------------------------------------
    @classmethod
    def from_training(cls, *, dataset_size: int, steps_per_epoch: int,
                      epochs: int | None = None, **options) -> "Scheme":
        """This scheme for a training run described the way Opacus sees it: ``dataset_size``
        examples (``len(dataset)``), ``steps_per_epoch`` batches per epoch (``len(data_loader)``,
        so the expected batch is ``dataset_size / steps_per_epoch``) and, where the scheme needs
        it, the planned ``epochs``; ``options`` are the scheme's own parameters that a
        DataLoader cannot carry (e.g. ``max_batch_size``, ``bands``).

        ``opacus_structured.make_private`` calls it. Default: the scheme cannot be built from
        training parameters (raise, naming the way out).
        """
        raise ValueError(f"scheme {cls.name!r} cannot be built from training parameters; pass "
                         f"a configured scheme object (scheme={cls.__name__}(...))")

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"scheme": self.name, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Scheme":
        data = dict(data)
        name = data.pop("scheme", cls.name)
        klass = get_scheme_class(name) if cls is Scheme else cls
        if name != klass.name:
            raise ValueError(f"state is for scheme {name!r}, not {klass.name!r}")
        return klass(**data)

    # ---- command line --------------------------------------------------------------------
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this scheme's flags to ``parser`` (default: none)."""

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "Scheme":
        """Build the scheme from parsed flags (default: no parameters)."""
        return cls()

    @classmethod
    def pricing_options_from_cli_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        """Keyword arguments of :meth:`epsilon` / :meth:`delta` that the parsed flags set
        besides the scheme (a Monte Carlo run's settings); default none."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Parameters for reports (``--json`` output)."""
        return dataclasses.asdict(self)
