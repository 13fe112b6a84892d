"""Opacus ``IAccountant`` adapter over a :class:`~opacus_structured.schemes.Scheme`.

The adapter only records steps and delegates pricing to the scheme (opacus' own accountants are
~100 lines for the same reason). History entries have Opacus' format
``(noise_multiplier, sample_rate, num_steps)`` with run-length merging, so Opacus'
``get_noise_multiplier`` / ``make_private_with_epsilon`` (which set
``accountant.history = [(sigma, sample_rate, steps)]`` on a fresh instance) work unchanged.

``SchemeAccountant(scheme)`` returns the accountant class registered for the scheme's type
(``scheme_class``), e.g. a ``BallsInBinsScheme`` gets a ``BallsInBinsAccountant``: code that only
knows "some scheme" (callbacks, examples, user scripts) always gets the pricing that scheme
needs, never the generic one by accident.

**The batches are the scheme's, or training stops.** When Opacus' ``make_private`` (or our
``CorrelatedNoisePrivacyEngine``, or ``DPCallback``) attaches the accountant to the optimizer,
the accountant checks the DataLoader that ``make_private`` returns: its batch sampler must
implement this scheme with these parameters (not only the rate) over a dataset of the loader's
size (:func:`~opacus_structured.samplers.verification.check_data_loader`). Opacus'
``DPDataLoader`` substituted by ``poisson_sampling=True``, a shuffled or sequential loader, a
sampler of another scheme or dataset size all raise there, naming the fix. At every step the
hook then checks, cheaply, that the sampler has drawn a batch for every priced step (the loader
checked is the loader trained on) and that the rate Opacus reports matches the scheme
(gradient accumulation multiplies it); a scheme that prices a whole planned run
(balls-in-bins, random allocation) raises at the first step beyond that run.

**Unbound accountants (Opacus' registry).** Opacus builds accountants by name without
arguments (``PrivacyEngine(accountant="truncated-poisson")``, ``make_private_with_epsilon``).
Every scheme accountant is therefore constructible *unbound* (``scheme=None``, no class default):
it prices nothing, and :meth:`~SchemeAccountant.get_optimizer_hook_fn`,
:meth:`~SchemeAccountant.step`, :meth:`~SchemeAccountant.get_epsilon` and
:meth:`~SchemeAccountant.get_delta` raise :class:`UnboundAccountantError` naming
``opacus_structured.make_private(engine, ...)``, which builds the scheme from the DataLoader and
installs a bound accountant of the same class. An unbound accountant never returns an ε.

**No ε from an accountant that saw nothing.** An accountant that was never attached to an
optimizer's step hook and has recorded no step — e.g. one assigned to ``engine.accountant``
*after* ``make_private``, whose hook still feeds the old accountant — raises on
:meth:`~SchemeAccountant.get_epsilon` instead of returning 0. Offline use (``step()`` by hand,
Opacus' ``get_noise_multiplier`` setting ``history``) is unaffected.

**Opacus' API, and the one difference.** ``get_epsilon(delta)``, ``step``, ``history``,
``__len__``, ``mechanism``, ``get_optimizer_hook_fn``, ``state_dict`` / ``load_state_dict`` are
Opacus' ``IAccountant`` contract. Opacus' ``IAccountant`` has no ``get_privacy_spent``; only its
``RDPAccountant`` does, returning ``(epsilon, best_alpha)``: the Rényi order α that gave the
smallest ε. Our accountants compose privacy loss distributions, which have no Rényi order, so
:meth:`SchemeAccountant.get_privacy_spent` keeps the call (``get_privacy_spent(delta=...,
alphas=None)``) and the two-element result but returns ``(epsilon, bound_kind)``: ε as a
``float`` and the :class:`~opacus_structured.accounting.bounds.BoundKind` saying whether it is a
guarantee (``"tight"``, ``"upper"``) — code that unpacks ``eps, best_alpha = ...`` keeps
working; code that formats ``best_alpha`` as a number must use ``get_epsilon``. ``alphas``
(Rényi orders to search) has no meaning here and raises ``ValueError`` unless ``None``. With no
step recorded Opacus returns ``(0, 0)``; ours returns ``(0.0, bound_kind)`` once attached and
raises :class:`AccountantNotAttachedError` before (see above). The Monte Carlo accountant
(``bminsep-mc``) returns ``(MonteCarloEstimate, BoundKind.MONTE_CARLO)``.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional

from opacus.accountants.accountant import IAccountant
from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from .._validation import check_nonnegative, check_open_unit, check_positive
from .._warnings import warn
from ..accounting import numerics
from ..accounting import pld as pld_lib
from ..accounting.numerics import NumericalPrecisionError
from ..accounting.resource_guard import ResourceBudgetError
from ..schemes import registry
from ..schemes.base import Scheme, below_precision, best_route
from . import budget_guard
from .attachment import (  # noqa: F401  (re-exported: their historical home)
    AttachmentMixin,
    _optimizer_and_module_of_make_private,
    data_loader_of_make_private,
)
from .ledger import LedgerError, ReleaseLedger
from .observed_release import ObservedReleaseMixin
from .phases import PhasesMixin
from .release_guard import ClipNormLedger

__all__ = ["SchemeAccountant", "register_scheme_accountant",
           "accountant_class_for", "AccountantNotAttachedError", "UnboundAccountantError",
           "LedgerError", "data_loader_of_make_private", "NoNoiseWarning"]


class NoNoiseWarning(UserWarning):
    """A step was recorded with ``noise_multiplier=0`` (Opacus' habit for debugging runs,
    e.g. its ``test_dl_seed_no_noise``): the run has no privacy guarantee, and ε is reported as
    ``inf``. Shown once per accountant."""


def _check_no_alphas(alphas, owner: str) -> None:
    """``get_privacy_spent(alphas=...)``: Rényi orders mean nothing to a PLD accountant."""
    if alphas is not None:
        raise ValueError(f"alphas are the Renyi orders Opacus' RDPAccountant searches; "
                         f"{owner} composes privacy loss distributions and has none: call "
                         f"get_privacy_spent(delta=...) without alphas, or get_epsilon(delta)")


class AccountantNotAttachedError(RuntimeError):
    """``get_epsilon`` on an accountant that no optimizer step hook feeds and that recorded
    nothing: its 0 would describe no training that happened."""


class UnboundAccountantError(ValueError):
    """An accountant built without a scheme (as Opacus' registry builds it by name) was asked
    to price, or to be attached to an optimizer."""


def accountant_class_for(scheme: Scheme) -> type:
    """The :class:`SchemeAccountant` subclass registered for ``type(scheme)`` (or a base class
    of it) in :mod:`opacus_structured.schemes.registry`; :class:`SchemeAccountant` itself when
    none is."""
    return registry.accountant_class_for(scheme) or SchemeAccountant


class SchemeAccountant(AttachmentMixin, ObservedReleaseMixin, PhasesMixin, IAccountant):
    """Prices the steps Opacus reports with a batching scheme's dominating pairs.

    Args:
        scheme: the batching scheme; ``None`` uses the class default (``default_scheme``). A
            registered subclass (``scheme_class`` set) without a default is then *unbound*
            (see the module docstring); ``SchemeAccountant()`` itself needs a scheme.
        discretization: privacy-loss discretisation interval (pessimistic). 1e-4 by default;
            1e-3 is ~10× faster and ~1e-3 looser.

    ``len(accountant)`` is the number of optimizer steps recorded.
    """

    #: Scheme used when constructed without one (Opacus' registry calls ``cls()``).
    default_scheme: ClassVar[Optional[Scheme]] = None
    #: Registry / mechanism name.
    mechanism_name: ClassVar[str] = ""
    #: The Scheme subclass this accountant prices; ``SchemeAccountant(scheme)`` dispatches to it.
    scheme_class: ClassVar[Optional[type]] = None
    #: Where the sampling rate and the normaliser came from (declared public constants or
    #: the data; :func:`opacus_structured.samplers.public_sizes.sampling_constants`), set by
    #: ``make_private``, ``DPCallback`` and the forecasting trainer; kept in the state.
    sampling_constants: Optional[dict] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        scheme_class = cls.__dict__.get("scheme_class")
        if scheme_class is not None:
            registry.register_accountant(scheme_class, cls)

    def __new__(cls, scheme: Optional[Scheme] = None, *args, **kwargs):
        if cls is SchemeAccountant and scheme is not None:
            cls = accountant_class_for(scheme)
        return super().__new__(cls)

    def __init__(self, scheme: Optional[Scheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__()
        self.history: list[tuple[float, Optional[float], int]] = []
        self.scheme = scheme if scheme is not None else self.default_scheme
        if self.scheme is None and type(self).scheme_class is None:
            raise ValueError(f"{type(self).__name__} needs a scheme")
        if self.scheme is not None and type(self).scheme_class is not None \
                and not isinstance(self.scheme, type(self).scheme_class):
            raise ValueError(f"{type(self).__name__} needs a {type(self).scheme_class.__name__}, "
                             f"got {self.scheme!r}")
        self.discretization = check_positive("discretization", discretization)
        self._cache: dict = {}
        self._attached = False      # an optimizer step hook feeds this accountant
        self._draw_source = None    # weakref to the sampler whose draws are checked
        self._draws_at_attach = 0   # its batches_drawn when attached
        self._hooked_steps = 0      # steps recorded through the hook since attached
        self._attach_tick = 0       # draw clock when attached (discovery without a loader)
        self._discover = False      # find the drawing sampler at the first step
        self._ledger = ReleaseLedger()  # which draw each released step trained on
        self._exact_cursor = True   # the ledger sees the batch each step trains on
        self._loader_workers = 0    # num_workers of the loader attached
        self._clip_norms = ClipNormLedger()  # one clip norm for clipping and noise (issue 29.9)
        self._init_observed()  # steps priced from the rows they summed (issue 39)
        self._init_phases()  # earlier phases of a run resumed under another scheme (issue 46)

    # ---- unbound accountants (built by name by Opacus' registry) --------------------------
    @property
    def is_bound(self) -> bool:
        """Whether this accountant has a scheme to price (``False``: built by name, unbound)."""
        return self.scheme is not None

    def _require_bound(self, what: str) -> None:
        if self.scheme is not None:
            return
        name = self.mechanism() or type(self).__name__
        raise UnboundAccountantError(
            f"the {name!r} accountant ({type(self).__name__}) was built without a scheme (as "
            f"Opacus' registry builds accountants by name), so it cannot {what}: it does not "
            f"know the dataset size, the batch sampler or the planned run. Use "
            f"opacus_structured.make_private(engine, module=..., optimizer=..., data_loader=..., "
            f"noise_multiplier=..., max_grad_norm=...) or "
            f"opacus_structured.make_private_with_epsilon(engine, ..., target_epsilon=..., "
            f"target_delta=..., epochs=...) instead of engine.make_private / "
            f"engine.make_private_with_epsilon: they build the scheme from the DataLoader and "
            f"install a bound {type(self).__name__}. Or set engine.accountant = "
            f"{type(self).__name__}(scheme) before engine.make_private(..., "
            f"poisson_sampling=False)")

    @classmethod
    def mechanism(cls) -> str:
        return cls.mechanism_name

    @property
    def bound(self) -> str:
        """Whether ε is a tight guarantee, an upper bound, or a (labelled) lower bound."""
        self._require_bound("say what kind of bound it reports")
        return self.scheme.bound

    # ---- recording -----------------------------------------------------------------------
    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1):
        """Record ``num_steps`` steps. ``noise_multiplier=0`` is recorded too (a debugging run
        without noise): ε is then ``inf`` and one :class:`NoNoiseWarning` says so."""
        self._require_bound("record a step")
        noise_multiplier = check_nonnegative("noise_multiplier", noise_multiplier)
        if noise_multiplier == 0.0:
            self._note_no_noise()
        sample_rate = check_positive("sample_rate", sample_rate)
        self.scheme.check_sample_rate(sample_rate)
        self._check_run_length(len(self) + int(num_steps))
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            last = self.history[-1]
            self.history[-1] = (last[0], last[1], last[2] + num_steps)
        else:
            self.history.append((noise_multiplier, sample_rate, num_steps))

    def reprice_step(self, index: int, noise_multiplier: float) -> None:
        """Price step ``index`` of the current phase's history at ``noise_multiplier`` instead
        (another module released the same draw: :mod:`~opacus_structured.accountants.
        co_release`); neighbouring entries with the same (σ, rate) merge again."""
        expanded, start = [], 0
        for sigma, rate, n in self.history:
            n = int(n)
            if start <= index < start + n:
                before, after = index - start, start + n - index - 1
                expanded += [(sigma, rate, before)] if before else []
                expanded.append((float(noise_multiplier), rate, 1))
                expanded += [(sigma, rate, after)] if after else []
            else:
                expanded.append((sigma, rate, n))
            start += n
        if not 0 <= index < start:
            raise IndexError(f"step {index} is not in this accountant's {start} steps")
        merged: list = []
        for sigma, rate, n in expanded:
            if merged and merged[-1][:2] == (sigma, rate):
                merged[-1] = (sigma, rate, merged[-1][2] + n)
            else:
                merged.append((sigma, rate, n))
        self.history = merged
        self._cache.clear()
        if float(noise_multiplier) == 0.0:
            self._note_no_noise()
        budget_guard.repriced(self)  # a dataset budget charging this run re-prices it now

    def _note_no_noise(self) -> None:
        """One :class:`NoNoiseWarning` per accountant, at the first step without noise."""
        if getattr(self, "_no_noise_warned", False):
            return
        self._no_noise_warned = True
        warn(f"{type(self).__name__}: a step was taken with noise_multiplier=0: the gradients "
             f"are released without noise, so this run has no privacy guarantee and "
             f"get_epsilon reports inf. Use noise_multiplier > 0 for a private run",
             NoNoiseWarning)

    @property
    def without_noise(self) -> bool:
        """Whether a step was recorded with ``noise_multiplier=0`` (then ε is ``inf``)."""
        return any(float(sigma) == 0.0 and n for sigma, _, n in self.history)

    def _check_run_length(self, steps: int) -> None:
        """Schemes priced as one planned run raise when training goes beyond it."""
        if self.scheme.unit == "step":
            return
        try:
            self.scheme.compositions(steps)
        except ValueError as err:
            raise ValueError(
                f"step {steps} goes beyond the run that scheme {self.scheme.name!r} prices "
                f"({err}); the epsilon would not cover it. Stop training, or plan a longer run "
                f"(a scheme with more epochs) from the start") from None

    def _accountant_for(self, scheme: Scheme) -> "SchemeAccountant":
        """A fresh accountant of ``scheme``'s registered class (an earlier phase's pricer)."""
        return accountant_class_for(scheme)(scheme, discretization=self.discretization)

    def _require_observed(self) -> None:
        """Refuse to report for an unbound accountant, and for one that no step hook feeds and
        that saw no step."""
        self._require_bound("report a privacy guarantee")
        self._ledger.check_optimizer()
        if not self._attached and not self.history and not self.phases:
            raise AccountantNotAttachedError(
                f"{type(self).__name__} has recorded no step and is not attached to an "
                f"optimizer: its epsilon would describe no training. If you assigned "
                f"engine.accountant after make_private, the optimizer's step hook still feeds "
                f"the previous accountant: assign it before make_private")

    def __len__(self) -> int:
        return sum(int(n) for _, _, n in self.history)

    # ---- pricing -------------------------------------------------------------------------
    def _composed(self, discretization: float):
        key = (tuple(self.history), discretization)
        if key not in self._cache:
            self._cache.clear()
            if self.scheme.unit == "step":
                parts = []
                for sigma, q, n in self.history:
                    if n:
                        parts.append((self.scheme.pld(sigma, sample_rate=q,
                                                      discretization=discretization), int(n)))
                self._cache[key] = pld_lib.compose(parts)
            else:
                self._cache[key] = self._composed_epochs(discretization)
        return self._cache[key]

    def _composed_epochs(self, discretization: float):
        # Multi-step units (an epoch, a BandMF cycle, a whole balls-in-bins run): chunk the
        # history into ``steps_per_unit`` steps, each unit priced at the smallest noise
        # multiplier used in it (more noise is post-processing: never under-reports).
        per_unit = self.scheme.steps_per_unit()
        self.scheme.compositions(len(self))  # validates (e.g. no more steps than planned)
        sigmas: list[float] = []
        rates: list[Optional[float]] = []
        for sigma, q, n in self.history:
            sigmas.extend([sigma] * int(n))
            rates.extend([q] * int(n))
        parts: dict[tuple, int] = {}
        for start in range(0, len(sigmas), per_unit):
            s = min(sigmas[start:start + per_unit])
            parts[(s, rates[start])] = parts.get((s, rates[start]), 0) + 1
        return pld_lib.compose(
            (self.scheme.pld(s, sample_rate=q, discretization=discretization), n)
            for (s, q), n in parts.items())

    def composed_pld(self, discretization: Optional[float] = None):
        """The pessimistic PLD of every step recorded so far, composed (``None``: no step);
        what :meth:`get_epsilon` prices. Composing it with another run's
        (:func:`~opacus_structured.accounting.pld.compose`) prices both runs as one release
        (e.g. DP fine-tuning from the weights of an earlier DP run on the same data)."""
        self._require_observed()
        d = self.discretization if discretization is None else check_positive(
            "discretization", discretization)
        if self.without_noise:
            raise ValueError(f"{type(self).__name__} recorded steps with noise_multiplier=0: "
                             f"their privacy loss is unbounded and has no PLD (epsilon is inf)")
        if self.phases:
            return self._phases_composed(d)
        return self._with_unamplified(self._composed(d), d)

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        """ε(δ) for all steps recorded so far (``kwargs`` from Opacus are ignored).

        Raises :class:`AccountantNotAttachedError` if the accountant saw nothing (see module).
        """
        self._require_observed()
        delta = check_open_unit("delta", delta)
        d = self.discretization if discretization is None else check_positive(
            "discretization", discretization)
        if self.without_noise:
            return math.inf
        if self.phases:
            return self._phases_epsilon(delta, d)
        if self.unamplified:
            return self._epsilon_with_unamplified(delta, d)
        try:
            if self.scheme.unit == "step":  # before composing: a floor no grid can beat
                numerics.check_a_priori(len(self), delta)
            try:
                value = pld_lib.epsilon_for_delta(self._composed(d), delta)
            except ResourceBudgetError as exc:
                return self._epsilon_over_budget(exc, delta, d)
        except NumericalPrecisionError as exc:
            return self._epsilon_below_precision(exc, delta, d)
        if self.unamplified:  # the scheme's other routes price its history alone
            return value
        # the smallest certified route (monotone in δ across the PLD's round-off floor)
        return best_route(value, self.scheme.certified_alternatives_below(self.history, delta,
                                                                          float(value)))

    def _epsilon_below_precision(self, error: NumericalPrecisionError, delta: float,
                                 discretization: float) -> float:
        """δ below the PLD route's round-off floor (:mod:`~opacus_structured.accounting.
        numerics`): the scheme's best certified route for the whole history
        (:meth:`Scheme.certified_alternatives`, the RDP bound for Poisson), with a warning
        naming it; otherwise ``error`` (names δ, the floor and the fixes)."""
        if self.unamplified:
            raise error
        value = below_precision(error, self.scheme.certified_alternatives(self.history, delta))
        warn(f"{type(self).__name__}: epsilon priced by route {value.route!r}: "
             f"{value.note}")
        return value

    def _epsilon_over_budget(self, error: ResourceBudgetError, delta: float,
                             discretization: float) -> float:
        """Over the memory budget: the scheme's sound cheaper route (an RDP bound for Poisson,
        a coarser pessimistic grid otherwise; :meth:`Scheme.epsilon_over_budget`) when the
        history has one noise multiplier and rate, with a warning naming the route and its
        looseness; otherwise (or when no route fits) ``error``, one line naming the budget."""
        settings = {(sigma, q) for sigma, q, n in self.history if n}
        if len(settings) != 1 or self.unamplified:
            raise error
        ((sigma, q),) = settings
        value = self.scheme.epsilon_over_budget(error, sigma, len(self), delta,
                                                discretization=discretization, sample_rate=q)
        warn(f"{type(self).__name__}: epsilon priced by route {value.route!r}: "
             f"{value.note}")
        return value

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        """δ(ε) for all steps recorded so far."""
        self._require_observed()
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        if self.without_noise:
            return 1.0
        d = self.discretization if discretization is None else discretization
        if self.phases:
            return float(self._phases_delta(epsilon, d))
        return float(pld_lib.delta_for_epsilon(self._with_unamplified(self._composed(d), d),
                                               float(epsilon)))

    def get_privacy_spent(self, *, delta: float, alphas=None) -> tuple[float, str]:
        """``(epsilon, bound_kind)``: Opacus' ``RDPAccountant.get_privacy_spent`` call and
        two-element result, with the bound kind (whether ε is a guarantee) in place of the Rényi
        order, which a PLD accountant does not have (module docstring). ``alphas`` must be
        ``None``."""
        _check_no_alphas(alphas, type(self).__name__)
        return self.get_epsilon(delta), self.bound

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self, destination=None):
        """Opacus' state (history, mechanism) plus the scheme and the discretisation."""
        destination = super().state_dict(destination)
        if self.scheme is not None:  # an unbound accountant has only Opacus' state
            destination["scheme"] = self.scheme.to_dict()
        destination["discretization"] = self.discretization
        destination["ledger"] = self._ledger.state_dict()
        destination["clip_norm"] = self._clip_norms.state_dict()
        observed = self._observed_state()
        if observed is not None:
            destination["observed"] = observed
        if self.sampling_constants is not None:
            destination["sampling_constants"] = dict(self.sampling_constants)
        phases = self._phases_state()
        if phases is not None:
            destination["phases"] = phases
        return destination

    def load_state_dict(self, state_dict):
        """Restore a :meth:`state_dict`. A state taken under another scheme (another batch size,
        rate, ...: a phase schedule) starts a new phase, composed with the earlier ones
        (:mod:`~opacus_structured.accountants.phases`). An unbound accountant is bound to the
        checkpoint's scheme (if it is of this class's scheme type)."""
        saved = Scheme.from_dict(state_dict["scheme"]) if "scheme" in state_dict else None
        saved_steps = sum(int(n) for _, _, n in state_dict.get("history", []))
        if self._hooked_steps and saved_steps < len(self):
            self._keep_live_history(state_dict, saved_steps)
            return
        if self.scheme is None:
            if saved is None:
                raise UnboundAccountantError(
                    f"{type(self).__name__} is unbound and the checkpoint holds no scheme: "
                    f"build the accountant with the scheme the run was priced with")
            if not isinstance(saved, type(self).scheme_class):
                raise ValueError(f"checkpoint was taken with scheme {saved!r}, which "
                                 f"{type(self).__name__} does not price")
            self.scheme = saved
        resolved = self.scheme if saved is None else self.scheme.checkpoint_scheme(saved)
        if resolved is None:  # another batch size, rate, ...: a new phase (accountants/phases)
            self._start_phase(state_dict, saved)
            return
        for _, rate, steps in state_dict.get("history", []):
            if steps:  # a template's checkpoint resumed under a concrete scheme: same rates
                resolved.check_sample_rate(rate)
        super().load_state_dict(state_dict)
        self.scheme = resolved
        self.discretization = float(state_dict.get("discretization", self.discretization))
        self._clip_norms.load_state_dict(state_dict.get("clip_norm"))
        self._load_observed_state(state_dict.get("observed"))
        if state_dict.get("sampling_constants") is not None:
            self.sampling_constants = dict(state_dict["sampling_constants"])
        self.history = [tuple(h) for h in self.history]
        self._cache.clear()
        self.phases = [dict(p) for p in state_dict.get("phases", [])]
        self._phase_cache.clear()
        if state_dict.get("ledger") is not None:
            self._ledger.load_state_dict(state_dict["ledger"])
        else:
            self._ledger.unverified_history = saved_steps > 0

    def _keep_live_history(self, state_dict, saved_steps: int) -> None:
        """A state older than this live run (Opacus' ``load_checkpoint`` of the best epoch's
        checkpoint at the end of training): the weights it comes with may be loaded, but the
        releases since it happened, and choosing that checkpoint looked at all of them. The
        live history is kept (nothing is dropped from ε); a state of another run raises."""
        saved = state_dict.get("ledger") or {}
        live = self._ledger
        same = (saved.get("fingerprint") is None or live.fingerprint is None
                or saved.get("fingerprint") == live.fingerprint)
        if not same:
            raise ValueError(
                f"the state holds {saved_steps} priced step(s) of another run (sampler stream "
                f"{saved.get('fingerprint')}, this run {live.fingerprint}) but this accountant "
                f"has already priced {len(self)} step(s): loading it would drop released steps "
                f"from the epsilon. Load it into a fresh accountant")
        warn(
            f"{type(self).__name__}: a state of step {saved_steps} was loaded after "
            f"{len(self)} priced steps (an earlier checkpoint, e.g. the best epoch): the "
            f"accountant keeps its {len(self)} steps, since every one of them was released "
            f"and choosing the checkpoint looked at them; training continues on new draws")

    def __repr__(self):
        phases = f", earlier_phases={len(self.phases)}" if self.phases else ""
        return (f"{type(self).__name__}(scheme={self.scheme!r}, steps={len(self)}{phases}, "
                f"discretization={self.discretization})")


def register_scheme_accountant(name: str, scheme: Scheme,
                               base: type[SchemeAccountant] = SchemeAccountant,
                               force: bool = False) -> type[SchemeAccountant]:
    """Register an accountant for a *configured* scheme with Opacus' registry.

    Opacus creates accountants by name without arguments (``make_private_with_epsilon``); this
    makes ``PrivacyEngine(accountant=name)`` and ``make_private_with_epsilon`` price ``scheme``.
    """
    if name in _ACCOUNTANTS and not force:
        existing = _ACCOUNTANTS[name]
        if getattr(existing, "default_scheme", None) == scheme:
            return existing
        raise ValueError(f"accountant name {name!r} is already registered; pick another name "
                         f"or pass force=True")
    cls = type(f"{base.__name__}_{name.replace('-', '_')}", (base,),
               {"default_scheme": scheme, "mechanism_name": name})
    register_accountant(name, cls, force=True)
    return cls
