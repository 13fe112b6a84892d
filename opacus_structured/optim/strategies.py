"""Strategy matrices for correlated noise, at their public path next to the optimizer.

The math (banded Toeplitz, BSR / BISR / BandInvMF, BLT) lives in the torch-free layer,
:mod:`opacus_structured.accounting.strategies`, because schemes price strategies too; this
module re-exports it so ``from opacus_structured.optim.strategies import ...`` keeps working.
"""

from ..accounting.strategies import *  # noqa: F401,F403
from ..accounting.strategies import __all__  # noqa: F401
