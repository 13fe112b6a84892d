"""Opacus accountants (``IAccountant``) over our schemes, registered with Opacus' registry.

Every module of this package is imported. Opacus' registry builds accountants by name with no
arguments (``PrivacyEngine(accountant=name)``, ``make_private_with_epsilon``), so only the
accountants constructible that way are registered under their mechanism name
(:data:`REGISTERED`). That is every scheme accountant whose constructor accepts no scheme:
``"poisson"`` and ``"gdp-full-batch"`` are bound from construction (their scheme needs no
parameter), ``"shuffle"`` too, with a template scheme that binds to the DataLoader it is attached
to (Opacus' stock ``make_private(..., poisson_sampling=False)`` path); ``"truncated-poisson"``, ``"balls-in-bins"``, ``"bandmf-cyclic-poisson"``,
``"random-allocation-mf"`` and ``"structured"`` are constructed *unbound*: they refuse to price
(naming ``opacus_structured.make_private``) until ``opacus_structured.make_private(engine, ...)``
replaces them with an accountant bound to the scheme it builds from the DataLoader. Plus
``"individual-gdp"`` (not a scheme accountant). An accountant whose constructor still requires
a scheme is listed in :data:`ACCOUNTANTS` but not registered; bind it to a scheme under a name
of your choice with :func:`~opacus_structured.accountants.base.register_scheme_accountant`.
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


#: The accountant of each scheme (the class that sets ``scheme_class``), by mechanism name
#: (classes made by ``register_scheme_accountant`` are not listed).
ACCOUNTANTS = {c.mechanism_name: c for c in _all_subclasses(SchemeAccountant)
               if c.__dict__.get("mechanism_name") and "scheme_class" in c.__dict__}



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
