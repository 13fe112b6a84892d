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
from .base import SchemeAccountant  # noqa: F401

__all__ = ["BandMFCyclicPoissonAccountant", "BallsInBinsAccountant"]


class _UnitAccountant(SchemeAccountant):
    """Chunks the step history into the scheme's accounting units (``steps_per_unit`` steps:
    a cycle, or a whole balls-in-bins run), each priced at the smallest σ used in it (more
    noise is never less private), and composes them."""

    def _composed_epochs(self, discretization: float):
        per_unit = self.scheme.steps_per_unit()
        total = len(self)
        self.scheme.compositions(total)  # validates (balls-in-bins: no more than planned)
        sigmas, rates = [], []
        for sigma, q, n in self.history:
            sigmas.extend([sigma] * int(n))
            rates.extend([q] * int(n))
        parts: dict = {}
        for start in range(0, total, per_unit):
            key = (min(sigmas[start:start + per_unit]), rates[start])
            parts[key] = parts.get(key, 0) + 1
        return pld_lib.compose(
            (self.scheme.pld(s, sample_rate=q, discretization=discretization), n)
            for (s, q), n in parts.items())


class BandMFCyclicPoissonAccountant(_UnitAccountant):
    """BandMF + cyclic Poisson: ``ceil(steps/b)`` Poisson-subsampled Gaussians (``q = b·B/|D|``)."""

    mechanism_name = "bandmf-cyclic-poisson"

    def __init__(self, scheme: BandMFCyclicPoissonScheme = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        if not isinstance(scheme, BandMFCyclicPoissonScheme):
            raise ValueError(f"BandMFCyclicPoissonAccountant needs a BandMFCyclicPoissonScheme, "
                             f"got {scheme!r}")
        super().__init__(scheme, discretization=discretization)


class BallsInBinsAccountant(_UnitAccountant):
    """DP-SGD with balls-in-bins (fixed bins), priced by pld-accounting."""

    mechanism_name = "balls-in-bins"

    def __init__(self, scheme: BallsInBinsScheme = None, *,
                 discretization: float = pld_lib.DEFAULT_DISCRETIZATION):
        if not isinstance(scheme, BallsInBinsScheme):
            raise ValueError(f"BallsInBinsAccountant needs a BallsInBinsScheme, got {scheme!r}")
        super().__init__(scheme, discretization=discretization)
