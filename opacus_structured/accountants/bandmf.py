"""Opacus accountants for BandMF with cyclic Poisson (``"bandmf-cyclic-poisson"``) and DP-SGD
with balls-in-bins (``"balls-in-bins"``); the math is in :mod:`opacus_structured.accounting.bandmf`.

Both price a configured scheme: ``BandMFCyclicPoissonAccountant(scheme)``, or
``CorrelatedNoisePrivacyEngine(scheme=scheme)`` which builds it. Opacus' registry creates
accountants without arguments: ``PrivacyEngine(accountant="balls-in-bins")`` holds an *unbound*
accountant that refuses to price; follow it with ``opacus_structured.make_private(engine, ...)``
/ ``make_private_with_epsilon`` (which build the scheme from the DataLoader), or register a
configured one with :func:`~opacus_structured.accountants.base.register_scheme_accountant`.
"""

from __future__ import annotations

from typing import Optional

from ..accounting import pld as pld_lib
from ..schemes.balls_in_bins import BallsInBinsScheme
from ..schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from .base import SchemeAccountant
from .whole_run import WholeRunAccountant

__all__ = ["BandMFCyclicPoissonAccountant", "BallsInBinsAccountant"]


class BandMFCyclicPoissonAccountant(SchemeAccountant):
    """BandMF + cyclic Poisson: ``ceil(steps/b)`` Poisson-subsampled Gaussians (``q = b·B/|D|``)."""

    mechanism_name = "bandmf-cyclic-poisson"
    scheme_class = BandMFCyclicPoissonScheme

    def __init__(self, scheme: Optional[BandMFCyclicPoissonScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__(scheme, discretization=discretization)  # None: unbound (see base)


class BallsInBinsAccountant(WholeRunAccountant):
    """DP-SGD with balls-in-bins (fixed bins): the whole run, at its smallest σ, priced by
    :meth:`BallsInBinsScheme.epsilon` (min of pld-accounting's PLD and the Rényi accountant)."""

    mechanism_name = "balls-in-bins"
    scheme_class = BallsInBinsScheme

    def __init__(self, scheme: Optional[BallsInBinsScheme] = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        super().__init__(scheme, discretization=discretization)  # None: unbound (see base)
