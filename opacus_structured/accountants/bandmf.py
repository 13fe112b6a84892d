"""Opacus accountants for BandMF with cyclic Poisson (``"bandmf-cyclic-poisson"``) and DP-SGD
with balls-in-bins (``"balls-in-bins"``); the math is in :mod:`opacus_structured.accounting.bandmf`.

Both need a configured scheme: ``BandMFCyclicPoissonAccountant(scheme)``, or
``CorrelatedNoisePrivacyEngine(scheme=scheme)`` which builds it. Opacus' registry creates
accountants without arguments, so for ``make_private_with_epsilon`` register a configured one with
:func:`~opacus_structured.accountants.base.register_scheme_accountant`.
"""

from __future__ import annotations

from ..accounting import pld as pld_lib
from ..schemes.balls_in_bins import BallsInBinsScheme
from ..schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from .base import SchemeAccountant, WholeRunAccountant

__all__ = ["BandMFCyclicPoissonAccountant", "BallsInBinsAccountant"]


class BandMFCyclicPoissonAccountant(SchemeAccountant):
    """BandMF + cyclic Poisson: ``ceil(steps/b)`` Poisson-subsampled Gaussians (``q = b·B/|D|``)."""

    mechanism_name = "bandmf-cyclic-poisson"
    scheme_class = BandMFCyclicPoissonScheme

    def __init__(self, scheme: BandMFCyclicPoissonScheme = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        if not isinstance(scheme, BandMFCyclicPoissonScheme):
            raise ValueError(f"BandMFCyclicPoissonAccountant needs a BandMFCyclicPoissonScheme, "
                             f"got {scheme!r}")
        super().__init__(scheme, discretization=discretization)


class BallsInBinsAccountant(WholeRunAccountant):
    """DP-SGD with balls-in-bins (fixed bins): the whole run, at its smallest σ, priced by
    :meth:`BallsInBinsScheme.epsilon` (min of pld-accounting's PLD and the Rényi accountant)."""

    mechanism_name = "balls-in-bins"
    scheme_class = BallsInBinsScheme

    def __init__(self, scheme: BallsInBinsScheme = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        if not isinstance(scheme, BallsInBinsScheme):
            raise ValueError(f"BallsInBinsAccountant needs a BallsInBinsScheme, got {scheme!r}")
        super().__init__(scheme, discretization=discretization)
