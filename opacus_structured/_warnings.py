"""Warnings that point at the user's line (issue 41).

A fixed ``stacklevel`` points at the right line only for the one call path it was counted on:
``DatasetSizeFromDataWarning`` was reported at ``contextlib.py:81`` (through
``train_forecaster``) and at ``lightning_callbacks/dp_callback.py:323`` (through ``DPCallback``).
:func:`warn` counts the stacklevel at run time instead: it walks out of every frame of this
package, ``lightning_callbacks``, the standard library's ``contextlib``, and the libraries that
call back into us (torch, Opacus, Lightning), and reports the first frame outside them — the
user's call (Python 3.11 has no ``skip_file_prefixes``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

__all__ = ["warn", "caller_stacklevel"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_OWN = (_HERE + os.sep, os.path.join(_ROOT, "lightning_callbacks") + os.sep)
#: Libraries that call our hooks and callbacks; their frames are never the user's line.
_LIBRARIES = ("torch", "opacus", "lightning", "pytorch_lightning", "lightning_fabric")


def _internal_prefixes() -> tuple[str, ...]:
    prefixes = list(_OWN)
    for name in _LIBRARIES:
        module = sys.modules.get(name)  # only what is imported can be on the stack
        path = getattr(module, "__file__", None)
        if path:
            prefixes.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(prefixes)


def _internal(filename: str, prefixes: tuple[str, ...]) -> bool:
    if filename == contextlib.__file__ or filename.startswith("<frozen "):
        return True
    return os.path.abspath(filename).startswith(prefixes)


def caller_stacklevel(skip: int = 0) -> int:
    """The ``stacklevel`` that makes ``warnings.warn`` in the calling function report the first
    frame outside this package and the libraries above (``skip`` more frames of the caller's
    own, e.g. when it is itself a helper outside the package)."""
    prefixes = _internal_prefixes()
    frame = sys._getframe(1)  # the function that calls warnings.warn
    level = 1
    while frame.f_back is not None and _internal(frame.f_code.co_filename, prefixes):
        frame = frame.f_back
        level += 1
    return level + skip


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn(message, category)`` reported at the user's line (module docstring)."""
    warnings.warn(message, category, stacklevel=caller_stacklevel())
