"""Opacus accountants (``IAccountant``) over our schemes, registered with Opacus' registry.

Every module of this package is imported. Opacus' registry builds accountants by name with no
arguments (``PrivacyEngine(accountant=name)``, ``make_private_with_epsilon``), so only the
accountants constructible that way are registered under their mechanism name (``"poisson"``,
``"individual-gdp"``). Accountants that need a configured scheme (``"truncated-poisson"``,
``"structured"``, ``"balls-in-bins"`` …) are listed in :data:`ACCOUNTANTS` but registered only
*bound to a scheme*, under a name of your choice, with
:func:`~opacus_structured.accountants.base.register_scheme_accountant` (or built directly as
``SchemeAccountant(scheme)`` and assigned to ``engine.accountant`` before ``make_private``).
"""

from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from .._discovery import import_submodules
from .base import SchemeAccountant, register_scheme_accountant
from .poisson import PoissonAccountant

import_submodules(__name__)


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


#: Accountants this package registers with Opacus, by mechanism name.
ACCOUNTANTS = {c.mechanism_name: c for c in _all_subclasses(SchemeAccountant)
               if c.__dict__.get("mechanism_name") and "default_scheme" not in c.__dict__
               or c is PoissonAccountant}



def _constructible(cls) -> bool:
    try:
        cls()
    except ValueError:
        return False
    return True


#: The names registered with Opacus (constructible without arguments).
REGISTERED = {n: c for n, c in ACCOUNTANTS.items() if _constructible(c)}

for _name, _cls in REGISTERED.items():
    if _ACCOUNTANTS.get(_name) is not _cls:
        register_accountant(_name, _cls, force=True)

__all__ = ["SchemeAccountant", "register_scheme_accountant", "PoissonAccountant", "ACCOUNTANTS",
           "REGISTERED"]
