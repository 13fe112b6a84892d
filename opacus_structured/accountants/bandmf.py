"""Opacus accountants for BandMF with cyclic Poisson (``"bandmf-cyclic-poisson"``) and DP-SGD
with balls-in-bins (``"balls-in-bins"``); the math is in :mod:`opacus_structured.accounting.bandmf`.

Both need a configured scheme: ``BandMFCyclicPoissonAccountant(scheme)``, or
``CorrelatedNoisePrivacyEngine(scheme=scheme)`` which builds it. Opacus' registry creates
accountants without arguments, so for ``make_private_with_epsilon`` register a configured one with
:func:`~opacus_structured.accountants.base.register_scheme_accountant`.
"""

from __future__ import annotations

import math

from .._validation import check_open_unit
from ..accounting import pld as pld_lib
from ..schemes.balls_in_bins import BallsInBinsScheme
from ..schemes.bandmf_cyclic_poisson import BandMFCyclicPoissonScheme
from .base import SchemeAccountant

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


class BallsInBinsAccountant(SchemeAccountant):
    """DP-SGD with balls-in-bins (fixed bins), priced by pld-accounting."""

    mechanism_name = "balls-in-bins"
    scheme_class = BallsInBinsScheme

    def __init__(self, scheme: BallsInBinsScheme = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        if not isinstance(scheme, BallsInBinsScheme):
            raise ValueError(f"BallsInBinsAccountant needs a BallsInBinsScheme, got {scheme!r}")
        super().__init__(scheme, discretization=discretization)

    # The run is one accounting unit priced at its smallest σ (more noise is post-processing),
    # by the scheme's min over the pld-accounting PLD and the Rényi accountant.
    def _sigma_steps(self):
        steps = len(self)
        self.scheme.compositions(steps)  # no more steps than planned
        return min((s for s, _, n in self.history if n), default=None), steps

    def get_epsilon(self, delta: float, *, discretization=None, **kwargs) -> float:
        delta = check_open_unit("delta", delta)
        sigma, steps = self._sigma_steps()
        if sigma is None:
            return 0.0
        d = self.discretization if discretization is None else discretization
        return self.scheme.epsilon(sigma, steps, delta, discretization=d)

    def get_delta(self, epsilon: float, *, discretization=None) -> float:
        if math.isnan(epsilon):
            raise ValueError("epsilon must not be NaN")
        sigma, steps = self._sigma_steps()
        if sigma is None:
            return 0.0
        d = self.discretization if discretization is None else discretization
        return self.scheme.delta(sigma, steps, float(epsilon), discretization=d)
