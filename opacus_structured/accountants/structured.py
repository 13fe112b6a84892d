"""Opacus accountant for structured subsampling of time series (mechanism ``"structured"``).

Prices the steps Opacus reports with :class:`~opacus_structured.schemes.structured.StructuredScheme`
(Theorems 4.2/4.4/E.8 tight, E.1/F.1/F.2/G.1 upper, 4.3/F.7/F.8 lower bounds of Schuchardt et
al., ICML 2025). WOR top level is composed per step; deterministic / shuffled top level per
epoch (a partial epoch counts as a full one).

Construction: the scheme is read from the sampler, so they cannot disagree::

    sampler = scheme.sampler(series_lengths, generator=g)
    accountant = StructuredSubsamplingAccountant.from_sampler(sampler)

Opacus' registry (``PrivacyEngine(accountant=name)``, ``make_private_with_epsilon``)
constructs accountants *without arguments*: ``PrivacyEngine(accountant="structured")`` holds an
*unbound* accountant that refuses to price (naming the fix). Follow it with
``opacus_structured.make_private(engine, ...)`` over a
:class:`~opacus_structured.forecasting.windowing.WindowDataset` (the scheme is built from the
series lengths and window geometry), or register a configured accountant with
:meth:`StructuredSubsamplingAccountant.register` (``register("my-run", sampler)`` then
``PrivacyEngine(accountant="my-run")``).
"""

from __future__ import annotations

from typing import Optional

from ..accounting import pld as pld_lib
from ..schemes.structured import StructuredScheme
from .base import SchemeAccountant, register_scheme_accountant

__all__ = ["StructuredSubsamplingAccountant"]


class StructuredSubsamplingAccountant(SchemeAccountant):
    """Structured-subsampling accountant over a :class:`StructuredScheme`.

    Args:
        scheme: the scheme (prefer :meth:`from_sampler`); ``None`` uses the configured scheme of
            a class made by :meth:`register`, else builds an unbound accountant (Opacus'
            registry), which refuses to price.
        discretization: pessimistic privacy-loss discretisation interval.

    ``get_epsilon`` is a guarantee for ``bound="tight"``/``"upper"``; with ``bound="lower"``
    it is an optimistic lower bound (:attr:`bound` says which; :meth:`get_privacy_spent`
    returns it alongside ε).
    """

    mechanism_name = "structured"
    scheme_class = StructuredScheme

    def __init__(self, scheme: Optional[StructuredScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__(scheme, discretization=discretization)

    @classmethod
    def from_sampler(cls, sampler, scheme: Optional[StructuredScheme] = None, *,
                     discretization: float = pld_lib.DEFAULT_DISCRETIZATION
                     ) -> "StructuredSubsamplingAccountant":
        """Accountant for exactly the scheme ``sampler`` implements.

        Raises ValueError if ``sampler`` carries no :class:`StructuredScheme` or if an explicit
        ``scheme`` is passed that differs from the sampler's.
        """
        sampler_scheme = getattr(sampler, "scheme", None)
        if not isinstance(sampler_scheme, StructuredScheme):
            raise ValueError(f"sampler {type(sampler).__name__} carries no StructuredScheme "
                             f"(scheme={sampler_scheme!r}); build it with scheme.sampler(...)")
        if scheme is not None and scheme != sampler_scheme:
            raise ValueError(f"the sampler implements {sampler_scheme!r} but the accountant was "
                             f"asked to price {scheme!r}; pass only the sampler")
        return cls(sampler_scheme, discretization=discretization)

    def check_sampler(self, sampler) -> None:
        """Raise ValueError unless ``sampler`` implements this accountant's scheme."""
        if getattr(sampler, "scheme", None) != self.scheme:
            raise ValueError(f"sampler implements {getattr(sampler, 'scheme', None)!r} but this "
                             f"accountant prices {self.scheme!r}")

    @classmethod
    def register(cls, name: str, sampler_or_scheme, *, force: bool = False):
        """Register a configured accountant class with Opacus' registry under ``name``.

        ``sampler_or_scheme`` is a structured sampler (its ``scheme`` is used) or a scheme.
        Returns the class; ``PrivacyEngine(accountant=name)`` then prices that scheme.
        """
        scheme = getattr(sampler_or_scheme, "scheme", sampler_or_scheme)
        if not isinstance(scheme, StructuredScheme):
            raise ValueError(f"register needs a structured sampler or StructuredScheme, got "
                             f"{type(sampler_or_scheme).__name__}")
        return register_scheme_accountant(name, scheme, base=cls, force=force)
