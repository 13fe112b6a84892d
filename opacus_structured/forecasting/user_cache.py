"""The user cache root of the forecasting layer (public artefacts only: pretrained weights,
remembered calibrations): ``$OPACUS_STRUCTURED_CACHE``, else
``$XDG_CACHE_HOME/opacus-structured``, else ``~/.cache/opacus-structured``."""

from __future__ import annotations

import os

__all__ = ["cache_root"]


def cache_root() -> str:
    """The cache root directory (not created here)."""
    root = os.environ.get("OPACUS_STRUCTURED_CACHE")
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "opacus-structured")
