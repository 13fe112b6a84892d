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
"""

__version__ = "0.1.0"

from . import accountants, accounting, runners, schemes  # noqa: E402,F401  (registrations)
from .accountants import PoissonAccountant, SchemeAccountant, register_scheme_accountant  # noqa: E402
from .engine import make_private, make_private_with_epsilon  # noqa: E402
from .schemes import PoissonScheme, Scheme  # noqa: E402

__all__ = ["__version__", "accounting", "accountants", "schemes", "PoissonAccountant",
           "SchemeAccountant", "register_scheme_accountant", "PoissonScheme", "Scheme",
           "make_private", "make_private_with_epsilon"]
