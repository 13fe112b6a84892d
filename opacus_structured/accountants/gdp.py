"""Opacus accountant for full-batch DP-GD (``"gdp-full-batch"``), the :class:`GDPScheme`.

Every example is in every step (the batch sampler is
:class:`~opacus_structured.samplers.full_batch.FullBatchSampler`, so Opacus' hook reports
``sample_rate = 1``); each step is a Gaussian mechanism with sensitivity 1, priced by its
pessimistic PLD (tight up to the discretisation; the closed form is μ-GDP with μ = √T/σ).

The name is not ``"gdp"``: Opacus registers its own ``"gdp"`` accountant (a central-limit
approximation for *Poisson* sampling), and replacing it would change what a stock script
prints. ``PrivacyEngine(accountant="gdp-full-batch")`` followed by
``opacus_structured.make_private(engine, ...)`` trains full-batch DP-GD. The scheme has no
parameters, so the accountant is bound from construction.
"""

from __future__ import annotations

from ..schemes.gdp import GDPScheme
from .base import SchemeAccountant

__all__ = ["GDPFullBatchAccountant"]


class GDPFullBatchAccountant(SchemeAccountant):
    """Full-batch DP-GD: ``T`` composed Gaussian mechanisms at noise multiplier σ."""

    default_scheme = GDPScheme()
    mechanism_name = "gdp-full-batch"
    scheme_class = GDPScheme
