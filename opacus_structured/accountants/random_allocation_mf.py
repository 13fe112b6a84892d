"""Opacus accountant for matrix mechanisms under random allocation (``"random-allocation-mf"``).

Prices the whole planned run with :class:`~opacus_structured.schemes.random_allocation_mf.
RandomAllocationMFScheme` (Rényi DP / conditional composition, Schuchardt & Kalinin). The run
must use one noise multiplier (a mix raises: the strategy's correlated noise does not compose
step by step).
"""

from __future__ import annotations

from typing import Optional

from ..accounting import pld as pld_lib
from ..schemes.random_allocation_mf import RandomAllocationMFScheme
from .whole_run import WholeRunAccountant

__all__ = ["RandomAllocationMFAccountant"]


class RandomAllocationMFAccountant(WholeRunAccountant):
    """``RandomAllocationMFAccountant(RandomAllocationMFScheme(...))``. Without a scheme (as
    Opacus' registry builds it for ``PrivacyEngine(accountant="random-allocation-mf")``) it is
    unbound and refuses to price: use ``opacus_structured.make_private(engine, ...)``, or
    register a configured one with :func:`~opacus_structured.accountants.base.
    register_scheme_accountant`."""

    mechanism_name = "random-allocation-mf"
    mixed_sigma = "raise"
    scheme_class = RandomAllocationMFScheme

    def phase_refusal(self):
        return ("is priced by the Rényi accountant or conditional composition, which have no "
                "stand-alone PLD")

    def __init__(self, scheme: Optional[RandomAllocationMFScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__(scheme, discretization=discretization)  # None: unbound (see base)
