"""Import every module of a subpackage so that their registrations run (schemes, commands)."""

from __future__ import annotations

import importlib
import pkgutil

_OPTIONAL_DEPS = {"gluonts", "lightning", "pandas", "matplotlib", "PLD_accounting",
                  "pytorch_lightning", "sklearn"}


def import_submodules(package_name: str, *, skip_optional: bool = True) -> list[str]:
    """Import all direct submodules of ``package_name``; return the names imported.

    A module whose import fails only because an optional extra (gluonts, lightning, ...) is not
    installed is skipped when ``skip_optional``; any other error propagates.
    """
    package = importlib.import_module(package_name)
    done = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        name = f"{package_name}.{info.name}"
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = (getattr(exc, "name", None) or "").split(".")[0]
            if skip_optional and missing in _OPTIONAL_DEPS:
                continue
            raise
        done.append(name)
    return done
