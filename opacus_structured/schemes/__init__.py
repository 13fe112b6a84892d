"""Batching schemes (the "what happened" half of accounting), one module per scheme."""

from .base import SCHEMES, BoundKind, Scheme, get_scheme_class, register_scheme
from .poisson import PoissonScheme

__all__ = ["SCHEMES", "BoundKind", "Scheme", "get_scheme_class", "register_scheme",
           "PoissonScheme"]
