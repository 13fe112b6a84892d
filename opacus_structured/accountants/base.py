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
import sys
import warnings
import weakref
from typing import ClassVar, Optional

from opacus.accountants.accountant import IAccountant
from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from .._validation import check_open_unit, check_positive
from ..accounting import numerics
from ..accounting import pld as pld_lib
from ..accounting.numerics import NumericalPrecisionError
from ..accounting.resource_guard import ResourceBudgetError
from ..samplers import verification
from ..schemes import registry
from ..schemes.base import Scheme, below_precision, best_route
from . import parameter_guard
from .ledger import LedgerError, ReleaseLedger
from .release_guard import ClipNormLedger, guard_optimizer

__all__ = ["SchemeAccountant", "register_scheme_accountant",
           "accountant_class_for", "AccountantNotAttachedError", "UnboundAccountantError",
           "LedgerError", "data_loader_of_make_private"]


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


def data_loader_of_make_private(max_depth: int = 4):
    """The DataLoader that Opacus' ``PrivacyEngine.make_private`` is about to return, when the
    caller (up to ``max_depth`` frames up) is ``make_private``; else ``None``.

    Opacus builds the accountant's step hook inside ``make_private`` right after preparing the
    DataLoader (``data_loader = self._prepare_data_loader(...)``; ``optimizer.attach_step_hook(
    self.accountant.get_optimizer_hook_fn(sample_rate=...))``) but passes the hook factory only
    the rate. Reading that local is how a stock ``PrivacyEngine`` lets the accountant check the
    sampler; ``tests/test_wiring_soundness.py`` pins the Opacus behaviour it relies on.
    """
    from torch.utils.data import DataLoader

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_code.co_name == "make_private":
            loader = frame.f_locals.get("data_loader")
            return loader if isinstance(loader, DataLoader) else None
    return None


def _optimizer_and_module_of_make_private(max_depth: int = 4):
    """``(optimizer, module)`` of the enclosing Opacus ``make_private`` (its locals right
    before ``attach_step_hook``: the DP optimizer and the wrapped module), else ``(None, None)``.
    Used to install :func:`~opacus_structured.accountants.release_guard.guard_optimizer`."""
    from opacus.optimizers import DPOptimizer

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            break
        if frame.f_code.co_name == "make_private":
            optimizer = frame.f_locals.get("optimizer")
            if isinstance(optimizer, DPOptimizer):
                return optimizer, frame.f_locals.get("module")
            break
    return None, None


def _check_covered(module, optimizer) -> None:
    """:func:`~opacus_structured.accountants.parameter_guard.check_coverage` inside Opacus'
    ``make_private``, which has already hooked the module for per-sample gradients: on a
    refusal the hooks are removed again, so the user's module is left as it was given."""
    try:
        parameter_guard.check_coverage(module, optimizer, where="make_private")
    except parameter_guard.UncoveredParametersError:
        close = getattr(module, "_close", None)
        if callable(close) and module is not parameter_guard.unwrap_module(module):
            close()
        raise


def accountant_class_for(scheme: Scheme) -> type:
    """The :class:`SchemeAccountant` subclass registered for ``type(scheme)`` (or a base class
    of it) in :mod:`opacus_structured.schemes.registry`; :class:`SchemeAccountant` itself when
    none is."""
    return registry.accountant_class_for(scheme) or SchemeAccountant


class SchemeAccountant(IAccountant):
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
        self._clip_norms = ClipNormLedger()  # one clip norm for clipping and noise (issue 29.9)

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

    # ---- attachment to a training run ----------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether an optimizer step hook (or ``DPCallback``) feeds this accountant."""
        return self._attached

    def attach(self, data_loader=None) -> None:
        """Declare that an optimizer's steps will be recorded here, drawn from ``data_loader``.

        With a loader, its batch sampler must implement :attr:`scheme` (see
        :func:`~opacus_structured.samplers.verification.check_data_loader`; raises
        ``ValueError`` naming the fix otherwise) and its draws are checked at every hooked step.
        Without one, the first hooked step looks for the sampler of this scheme that drew since
        now and raises if none did. Called by :meth:`get_optimizer_hook_fn` (with the loader of
        Opacus' ``make_private``), ``CorrelatedNoisePrivacyEngine`` and ``DPCallback``.
        """
        self._require_bound("be attached to an optimizer")
        source = None
        exact = True
        if data_loader is not None:
            source = verification.check_data_loader(self.scheme, data_loader)
            exact = verification.sees_trained_batch(data_loader, source)
            if not exact and not self.scheme.accepts_new_stream:
                raise ValueError(
                    f"the DataLoader has num_workers={data_loader.num_workers}: it draws batches "
                    f"ahead of training, so the accountant cannot see which draw each noisy step "
                    f"trains on, and scheme {self.scheme.name!r} "
                    f"(release policy {self.scheme.release_policy!r}) is priced by the draws "
                    f"released. Train on the DataLoader opacus_structured.make_private returns "
                    f"(a LedgerDataLoader, exact with any num_workers) or use num_workers=0")
        self._attached = True
        self._hooked_steps = 0
        self._attach_tick = verification.draw_clock()
        self._discover = data_loader is None
        self._draw_source = None if source is None else weakref.ref(source)
        self._draws_at_attach = 0 if source is None else source.batches_drawn
        self._exact_cursor = exact
        self._ledger.bind(source)

    def get_optimizer_hook_fn(self, sample_rate: float, *, data_loader=None):
        """Opacus' step hook, plus the DataLoader checks of :meth:`attach`.

        ``data_loader`` defaults to the loader of the enclosing Opacus ``make_private`` call.
        Raises :class:`UnboundAccountantError` for an unbound accountant. Inside Opacus'
        ``make_private`` it also refuses a module with trainable parameters that the DP
        optimizer does not step (:class:`~opacus_structured.accountants.parameter_guard.
        UncoveredParametersError`) and guards the module's parameters against other optimizers
        (:mod:`~opacus_structured.accountants.parameter_guard`).
        """
        self._require_bound("be attached to an optimizer")
        if data_loader is None:
            data_loader = data_loader_of_make_private()
        optimizer, module = _optimizer_and_module_of_make_private()
        if optimizer is not None and module is not None:  # every trainable parameter is in it
            _check_covered(module, optimizer)
        self.attach(data_loader)
        if optimizer is not None:  # Opacus' make_private: guard before the first step
            guard_optimizer(optimizer, module)
            if module is not None:  # no other optimizer steps the module's parameters
                parameter_guard.guard_parameters(module, optimizer, where="make_private")

        def hook_fn(optim):
            self.release(optim, sample_rate=sample_rate * optim.accumulated_iterations,
                         batches=optim.accumulated_iterations)

        return hook_fn

    def release(self, optimizer, *, sample_rate: float, batches: int = 1) -> None:
        """Price one noisy step the optimizer is about to apply (the step hook's body).

        The step is matched to the sampler draw it trained on by the privacy ledger
        (:mod:`~opacus_structured.accountants.ledger`), which raises :class:`LedgerError` when
        the released sequence is not one the scheme prices and, for schemes priced by the draws
        (``release_policy == "span"``), prices skipped draws as released.
        """
        padding = 0
        self._clip_norms.check(optimizer, step=len(self) + 1)
        checked = self._discover or not (self._exact_cursor and self._ledger.source is not None)
        if checked:
            self.check_draws()  # finds the sampler (discovery), or counts draws
        if self._exact_cursor and self._ledger.source is not None:
            padding = self._ledger.take(self.scheme, batches=batches, priced_steps=len(self),
                                        optimizer=optimizer)
        else:  # Opacus' own sampler, or a prefetching loader: the draw count is checked
            self._ledger.count_release(optimizer)
        sigma = optimizer.noise_multiplier
        if padding:
            self.step(noise_multiplier=sigma, sample_rate=sample_rate, num_steps=padding)
        if not checked:  # after the ledger's finer checks; subclasses' bookkeeping runs here
            self.check_draws()
        self.step(noise_multiplier=sigma, sample_rate=sample_rate)
        self._ledger.note_priced()
        self._hooked_steps += 1

    def check_draws(self) -> None:
        """Before pricing a hooked step: the scheme's sampler must have drawn a batch for it.

        Raises ``RuntimeError`` when no sampler of this scheme drew since :meth:`attach` (the
        loader trained on is not the scheme's) or fewer batches than steps were drawn (the
        loader checked at ``make_private`` is not the loader trained on).
        """
        if self._discover:
            drawn = [s for s in verification.live_samplers_drawn_since(self._attach_tick)
                     if verification.scheme_accepts(self.scheme, getattr(s, "scheme", None))]
            if not drawn:
                raise RuntimeError(
                    f"the optimizer is stepping, but no sampler of scheme {self.scheme.name!r} "
                    f"({self.scheme!r}) drew a batch since the accountant was attached: the "
                    f"DataLoader trained on does not use scheme.sampler(...), so the epsilon "
                    f"would not describe this training. Build the DataLoader with "
                    f"batch_sampler=scheme.sampler(...) (and poisson_sampling=False in "
                    f"make_private), or pass data_loader= to get_optimizer_hook_fn")
            self._discover = False
            self._draw_source = weakref.ref(drawn[0])
            self._draws_at_attach = 0  # it had not drawn for this run before attach
            self._ledger.bind(drawn[0])
        source = self._draw_source() if self._draw_source is not None else None
        if source is None:
            return
        drawn = source.batches_drawn - self._draws_at_attach
        if drawn < self._hooked_steps + 1:
            raise RuntimeError(
                f"step {self._hooked_steps + 1} is being priced but the scheme's sampler drew "
                f"only {drawn} batch(es) since make_private: the training loop iterates another "
                f"DataLoader than the one make_private returned (use the returned loader)")

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
        self._require_bound("record a step")
        noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        sample_rate = check_positive("sample_rate", sample_rate)
        self.scheme.check_sample_rate(sample_rate)
        self._check_run_length(len(self) + int(num_steps))
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            last = self.history[-1]
            self.history[-1] = (last[0], last[1], last[2] + num_steps)
        else:
            self.history.append((noise_multiplier, sample_rate, num_steps))

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

    def _require_observed(self) -> None:
        """Refuse to report for an unbound accountant, and for one that no step hook feeds and
        that saw no step."""
        self._require_bound("report a privacy guarantee")
        self._ledger.check_optimizer()
        if not self._attached and not self.history:
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
        return self._composed(d)

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        """ε(δ) for all steps recorded so far (``kwargs`` from Opacus are ignored).

        Raises :class:`AccountantNotAttachedError` if the accountant saw nothing (see module).
        """
        self._require_observed()
        delta = check_open_unit("delta", delta)
        d = self.discretization if discretization is None else check_positive(
            "discretization", discretization)
        try:
            if self.scheme.unit == "step":  # before composing: a floor no grid can beat
                numerics.check_a_priori(len(self), delta)
            try:
                value = pld_lib.epsilon_for_delta(self._composed(d), delta)
            except ResourceBudgetError as exc:
                return self._epsilon_over_budget(exc, delta, d)
        except NumericalPrecisionError as exc:
            return self._epsilon_below_precision(exc, delta, d)
        # the smallest certified route (monotone in δ across the PLD's round-off floor)
        return best_route(value, self.scheme.certified_alternatives(self.history, delta))

    def _epsilon_below_precision(self, error: NumericalPrecisionError, delta: float,
                                 discretization: float) -> float:
        """δ below the PLD route's round-off floor (:mod:`~opacus_structured.accounting.
        numerics`): the scheme's best certified route for the whole history
        (:meth:`Scheme.certified_alternatives`, the RDP bound for Poisson), with a warning
        naming it; otherwise ``error`` (names δ, the floor and the fixes)."""
        value = below_precision(error, self.scheme.certified_alternatives(self.history, delta))
        warnings.warn(f"{type(self).__name__}: epsilon priced by route {value.route!r}: "
                      f"{value.note}", stacklevel=3)
        return value

    def _epsilon_over_budget(self, error: ResourceBudgetError, delta: float,
                             discretization: float) -> float:
        """Over the memory budget: the scheme's sound cheaper route (an RDP bound for Poisson,
        a coarser pessimistic grid otherwise; :meth:`Scheme.epsilon_over_budget`) when the
        history has one noise multiplier and rate, with a warning naming the route and its
        looseness; otherwise (or when no route fits) ``error``, one line naming the budget."""
        settings = {(sigma, q) for sigma, q, n in self.history if n}
        if len(settings) != 1:
            raise error
        ((sigma, q),) = settings
        value = self.scheme.epsilon_over_budget(error, sigma, len(self), delta,
                                                discretization=discretization, sample_rate=q)
        warnings.warn(f"{type(self).__name__}: epsilon priced by route {value.route!r}: "
                      f"{value.note}", stacklevel=3)
        return value

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        """δ(ε) for all steps recorded so far."""
        self._require_observed()
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        d = self.discretization if discretization is None else discretization
        return float(pld_lib.delta_for_epsilon(self._composed(d), float(epsilon)))

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
        if self.sampling_constants is not None:
            destination["sampling_constants"] = dict(self.sampling_constants)
        return destination

    def load_state_dict(self, state_dict):
        """Restore a :meth:`state_dict`; raises if it was taken under another scheme. An unbound
        accountant is bound to the checkpoint's scheme (if it is of this class's scheme type)."""
        saved = Scheme.from_dict(state_dict["scheme"]) if "scheme" in state_dict else None
        saved_steps = sum(int(n) for _, _, n in state_dict.get("history", []))
        if self._hooked_steps and saved_steps < len(self):
            raise ValueError(
                f"the state holds {saved_steps} priced step(s) but this accountant has already "
                f"priced {len(self)} step(s) of a live run: loading it would drop "
                f"{len(self) - saved_steps} released step(s) from the epsilon. Load a state only "
                f"into a fresh accountant (a resumed run), or one taken at this step or later")
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
        if resolved is None:
            raise ValueError(
                f"checkpoint was taken with scheme {saved!r} but this accountant prices "
                f"{self.scheme!r}; build the accountant from the same scheme")
        for _, rate, steps in state_dict.get("history", []):
            if steps:  # a template's checkpoint resumed under a concrete scheme: same rates
                resolved.check_sample_rate(rate)
        super().load_state_dict(state_dict)
        self.scheme = resolved
        self.discretization = float(state_dict.get("discretization", self.discretization))
        self._clip_norms.load_state_dict(state_dict.get("clip_norm"))
        if state_dict.get("sampling_constants") is not None:
            self.sampling_constants = dict(state_dict["sampling_constants"])
        self.history = [tuple(h) for h in self.history]
        self._cache.clear()
        if state_dict.get("ledger") is not None:
            self._ledger.load_state_dict(state_dict["ledger"])
        else:
            self._ledger.unverified_history = saved_steps > 0

    def __repr__(self):
        return (f"{type(self).__name__}(scheme={self.scheme!r}, steps={len(self)}, "
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
