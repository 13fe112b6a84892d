"""Batching schemes (the "what happened" half of accounting), one module per scheme.

Every module in this package is imported here, so a new ``schemes/<name>.py`` with a
``@register_scheme`` class is picked up by the registry and the CLI without further edits.
"""

from .._discovery import import_submodules
from .base import SCHEMES, BoundKind, Scheme, get_scheme_class, register_scheme
from .poisson import PoissonScheme

import_submodules(__name__)

__all__ = ["SCHEMES", "BoundKind", "Scheme", "get_scheme_class", "register_scheme",
           "PoissonScheme"]
