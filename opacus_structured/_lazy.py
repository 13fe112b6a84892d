"""Lazy loading of the layers (layer 0; docs/architecture.md, "Lazy loading").

``import opacus_structured`` imports no layer. The package facade hands :func:`set_loader` the
function that imports every layer (``opacus_structured.load_all``); the registry
(:mod:`opacus_structured.schemes.registry`) calls :func:`ensure_loaded` when a sampler,
accountant or runner lookup misses, so implementations register before a lookup answers "none"
without a lower layer importing a higher one.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["set_loader", "ensure_loaded"]

_loader: Optional[Callable[[], None]] = None


def set_loader(loader: Callable[[], None]) -> None:
    """Record the function that imports every layer (idempotent)."""
    global _loader
    _loader = loader


def ensure_loaded() -> bool:
    """Run the loader once; ``True`` if it ran now (a missed lookup should look again)."""
    global _loader
    loader, _loader = _loader, None
    if loader is None:
        return False
    loader()
    return True
