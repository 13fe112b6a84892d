"""opacus-structured: sound and tight DP-SGD accounting for structured batching, as Opacus plugins.

Importing the package registers its accountants with Opacus' registry, so
``opacus.PrivacyEngine(accountant="poisson")`` works. Subpackages:

* :mod:`opacus_structured.accounting` — pure math (no torch): pairs, profiles, PLDs, GDP.
* :mod:`opacus_structured.schemes` — frozen batching-scheme descriptions.
* :mod:`opacus_structured.accountants` — Opacus ``IAccountant`` adapters.
* :mod:`opacus_structured.samplers` — torch batch samplers matching the schemes.
* :mod:`opacus_structured.optim` — correlated-noise optimizer.
* :mod:`opacus_structured.forecasting` — gluonts / Lightning glue for DP forecasting.
"""

__version__ = "0.1.0"

from . import accountants, accounting, schemes  # noqa: E402,F401  (registers accountants)
from .accountants import PoissonAccountant, SchemeAccountant, register_scheme_accountant  # noqa: E402
from .schemes import PoissonScheme, Scheme  # noqa: E402

__all__ = ["__version__", "accounting", "accountants", "schemes", "PoissonAccountant",
           "SchemeAccountant", "register_scheme_accountant", "PoissonScheme", "Scheme"]
