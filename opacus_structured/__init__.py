"""opacus-structured: sound and tight DP-SGD accounting for structured batching, as Opacus plugins.

Importing the package registers its accountants with Opacus' registry, so
``opacus.PrivacyEngine(accountant=NAME)`` works for every scheme accountant name; follow it with
:func:`make_private` / :func:`make_private_with_epsilon` (:mod:`opacus_structured.engine`), which
build the scheme from the DataLoader, install its sampler and its accountant. Subpackages:

* :mod:`opacus_structured.accounting` — pure math (no torch): pairs, profiles, PLDs, GDP.
* :mod:`opacus_structured.schemes` — frozen batching-scheme descriptions.
* :mod:`opacus_structured.accountants` — Opacus ``IAccountant`` adapters.
* :mod:`opacus_structured.samplers` — torch batch samplers matching the schemes.
* :mod:`opacus_structured.optim` — correlated-noise optimizer.
* :mod:`opacus_structured.forecasting` — gluonts / Lightning glue for DP forecasting.
* :mod:`opacus_structured.engine` — ``make_private`` / ``make_private_with_epsilon`` for every
  scheme by name.
* :mod:`opacus_structured.advisor` — which scheme gives the least noise for a setting.
* :class:`DatasetBudget` (:mod:`opacus_structured.dataset_budget`) — one privacy budget per
  private dataset, in a file shared by runs, processes and searches (a privacy filter).

Lazy loading (docs/architecture.md, "Lazy loading"): ``import opacus_structured`` itself imports
neither torch, opacus nor dp_accounting, so the ``opacus-structured`` command starts fast. The
layers load on first use, with every registration they carry:

* Opacus' accountant registry: if ``opacus`` is already imported, :mod:`.accountants` (which
  registers) is imported now; otherwise a one-shot import hook imports it right after
  ``opacus`` finishes importing. Nobody can read Opacus' registry without importing ``opacus``,
  so ``PrivacyEngine(accountant="truncated-poisson")`` works exactly as with an eager import.
* The package's attributes (``make_private``, ``PoissonAccountant``, ``accountants``, ...) import
  their layer on first access (module ``__getattr__``).
* A sampler / accountant / runner lookup in :mod:`.schemes.registry` that misses loads every
  layer once and looks again (:func:`load_all` is the registry's implementation loader).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from . import _lazy

__version__ = "0.1.0"

__all__ = ["__version__", "accounting", "accountants", "schemes", "PoissonAccountant",
           "SchemeAccountant", "register_scheme_accountant", "PoissonScheme", "Scheme",
           "make_private", "make_private_with_epsilon", "public", "public_rows",
           "DatasetBudget", "BudgetExhaustedError"]

#: Public names defined in a layer -> that layer (imported on first access).
_LAZY_NAMES = {"PoissonAccountant": "accountants", "SchemeAccountant": "accountants",
               "register_scheme_accountant": "accountants", "make_private": "engine",
               "make_private_with_epsilon": "engine", "PoissonScheme": "schemes",
               "Scheme": "schemes", "public": "samplers.row_provenance",
               "public_rows": "samplers.row_provenance", "DatasetBudget": "dataset_budget",
               "BudgetExhaustedError": "dataset_budget"}
#: Submodules an eager ``import opacus_structured`` used to bind as attributes.
_LAZY_SUBMODULES = ("accounting", "accountants", "advisor", "distributed", "engine", "optim",
                    "runners", "samplers", "schemes")
_loaded = False


def load_all() -> None:
    """Import every layer (what ``import opacus_structured`` did eagerly before lazy loading):
    accounting, schemes, samplers, runners, accountants (Opacus registrations), engine."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in ("accounting", "schemes", "runners", "accountants", "engine"):
        importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str):
    # Only names we know: Python's ``from opacus_structured import x`` probes attributes with
    # hasattr before importing submodule ``x``, so this must never import more than asked.
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _register_with_opacus() -> None:
    """Import :mod:`.accountants`, whose import registers our accountants with Opacus' registry
    (nothing to do if it is imported or being imported: it registers itself)."""
    if f"{__name__}.accountants" not in sys.modules:
        importlib.import_module(f"{__name__}.accountants")


class _RegisterAfterOpacus(importlib.abc.Loader):
    """Wraps opacus' loader: runs it, then :func:`_register_with_opacus` (the rest delegates)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_with_opacus()

    def __getattr__(self, name):  # get_resource_reader, is_package, get_data, ...
        return getattr(self._loader, name)


class _OpacusImportHook(importlib.abc.MetaPathFinder):
    """One-shot finder: the first ``import opacus`` gets the wrapped loader above."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "opacus":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterOpacus(spec.loader)
        return spec


def _install() -> None:
    _lazy.set_loader(load_all)
    if "opacus" in sys.modules:
        _register_with_opacus()
    elif not any(isinstance(f, _OpacusImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _OpacusImportHook())


_install()
