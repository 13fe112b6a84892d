"""Opacus accountant for Poisson-subsampled DP-SGD priced by our PLD core (``"poisson"``)."""

from __future__ import annotations

from typing import Optional

from ..accounting import pld as pld_lib
from ..schemes.poisson import PoissonScheme
from .base import SchemeAccountant

__all__ = ["PoissonAccountant"]


class PoissonAccountant(SchemeAccountant):
    """Drop-in for Opacus' ``"prv"``/``"rdp"`` accountants: ``PrivacyEngine(accountant="poisson")``.

    Without a scheme it prices the ``sample_rate`` Opacus reports at each step; with
    ``PoissonScheme(sample_rate=q)`` it also checks that Opacus reports q.
    """

    default_scheme = PoissonScheme()
    mechanism_name = "poisson"
    scheme_class = PoissonScheme

    def __init__(self, scheme: Optional[PoissonScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        if scheme is not None and not isinstance(scheme, PoissonScheme):
            raise ValueError(f"PoissonAccountant needs a PoissonScheme, got {scheme!r}")
        super().__init__(scheme, discretization=discretization)
