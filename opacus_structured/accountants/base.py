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

A mismatch between the scheme and what Opacus reports (a different ``sample_rate`` because the
DataLoader does not use the scheme's sampler, or gradient accumulation) raises at the first
step instead of silently producing a wrong ε.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional

from opacus.accountants.accountant import IAccountant
from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from .._validation import check_open_unit, check_positive
from ..accounting import pld as pld_lib
from ..schemes.base import Scheme

__all__ = ["SchemeAccountant", "WholeRunAccountant", "register_scheme_accountant",
           "accountant_class_for"]

#: Scheme class -> the SchemeAccountant subclass that prices it (filled by ``scheme_class``).
_ACCOUNTANT_FOR_SCHEME: dict[type, type] = {}


def accountant_class_for(scheme: Scheme) -> type:
    """The :class:`SchemeAccountant` subclass registered for ``type(scheme)`` (or a base class
    of it); :class:`SchemeAccountant` itself when none is."""
    for klass in type(scheme).__mro__:
        if klass in _ACCOUNTANT_FOR_SCHEME:
            return _ACCOUNTANT_FOR_SCHEME[klass]
    return SchemeAccountant


class SchemeAccountant(IAccountant):
    """Prices the steps Opacus reports with a batching scheme's dominating pairs.

    Args:
        scheme: the batching scheme; ``None`` uses the class default (``default_scheme``).
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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        scheme_class = cls.__dict__.get("scheme_class")
        if scheme_class is not None:
            _ACCOUNTANT_FOR_SCHEME[scheme_class] = cls

    def __new__(cls, scheme: Optional[Scheme] = None, *args, **kwargs):
        if cls is SchemeAccountant and scheme is not None:
            cls = accountant_class_for(scheme)
        return super().__new__(cls)

    def __init__(self, scheme: Optional[Scheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__()
        self.history: list[tuple[float, Optional[float], int]] = []
        self.scheme = scheme if scheme is not None else self.default_scheme
        if self.scheme is None:
            raise ValueError(f"{type(self).__name__} needs a scheme")
        self.discretization = check_positive("discretization", discretization)
        self._cache: dict = {}

    @classmethod
    def mechanism(cls) -> str:
        return cls.mechanism_name

    @property
    def bound(self) -> str:
        """Whether ε is a tight guarantee, an upper bound, or a (labelled) lower bound."""
        return self.scheme.bound

    # ---- recording -----------------------------------------------------------------------
    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1):
        noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        sample_rate = check_positive("sample_rate", sample_rate)
        self.scheme.check_sample_rate(sample_rate)
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            last = self.history[-1]
            self.history[-1] = (last[0], last[1], last[2] + num_steps)
        else:
            self.history.append((noise_multiplier, sample_rate, num_steps))

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

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        """ε(δ) for all steps recorded so far (``kwargs`` from Opacus are ignored)."""
        delta = check_open_unit("delta", delta)
        d = self.discretization if discretization is None else check_positive(
            "discretization", discretization)
        return pld_lib.epsilon_for_delta(self._composed(d), delta)

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        """δ(ε) for all steps recorded so far."""
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        d = self.discretization if discretization is None else discretization
        return float(pld_lib.delta_for_epsilon(self._composed(d), float(epsilon)))

    def get_privacy_spent(self, *, delta: float) -> tuple[float, str]:
        """``(epsilon, bound_kind)``: the bound kind says if ε is a guarantee."""
        return self.get_epsilon(delta), self.bound

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self, destination=None):
        """Opacus' state (history, mechanism) plus the scheme and the discretisation."""
        destination = super().state_dict(destination)
        destination["scheme"] = self.scheme.to_dict()
        destination["discretization"] = self.discretization
        return destination

    def load_state_dict(self, state_dict):
        """Restore a :meth:`state_dict`; raises if it was taken under another scheme."""
        super().load_state_dict(state_dict)
        if "scheme" in state_dict:
            saved = Scheme.from_dict(state_dict["scheme"])
            if saved != self.scheme:
                raise ValueError(
                    f"checkpoint was taken with scheme {saved!r} but this accountant prices "
                    f"{self.scheme!r}; build the accountant from the same scheme")
        self.discretization = float(state_dict.get("discretization", self.discretization))
        self.history = [tuple(h) for h in self.history]
        self._cache.clear()

    def __repr__(self):
        return (f"{type(self).__name__}(scheme={self.scheme!r}, steps={len(self)}, "
                f"discretization={self.discretization})")


class WholeRunAccountant(SchemeAccountant):
    """Prices the whole recorded run with one call to ``scheme.epsilon`` / ``scheme.delta``.

    For schemes whose accounting unit is the planned run (balls-in-bins, random allocation of a
    matrix mechanism). A history with several noise multipliers is priced at the smallest one
    (``mixed_sigma = "min"``: more noise is post-processing, never under-reports) or refused
    (``mixed_sigma = "raise"``).
    """

    mixed_sigma: ClassVar[str] = "min"

    def _sigma_and_steps(self) -> tuple[Optional[float], int]:
        sigmas = sorted({s for s, _, n in self.history if n})
        steps = len(self)
        if not sigmas:
            return None, 0
        if len(sigmas) > 1 and self.mixed_sigma == "raise":
            raise ValueError(f"{self.scheme.name} prices a run with one noise multiplier; the "
                             f"history has {sigmas}")
        return sigmas[0], steps

    def _priced(self, kind: str, value: float, discretization: Optional[float]) -> float:
        # The run is one unit: the price depends on (σ, units), not on the step count, so a
        # callback asking every step does not recompute it.
        sigma, steps = self._sigma_and_steps()
        if sigma is None:
            return 0.0
        d = self.discretization if discretization is None else discretization
        key = (kind, sigma, self.scheme.compositions(steps), value, d)
        if key not in self._cache:
            price = self.scheme.epsilon if kind == "epsilon" else self.scheme.delta
            self._cache[key] = price(sigma, steps, value, discretization=d)
        return self._cache[key]

    def get_epsilon(self, delta: float, *, discretization: Optional[float] = None,
                    **kwargs) -> float:
        return self._priced("epsilon", check_open_unit("delta", delta), discretization)

    def get_delta(self, epsilon: float, *, discretization: Optional[float] = None) -> float:
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        return self._priced("delta", float(epsilon), discretization)


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
