"""Opacus accountants (``IAccountant``) over our schemes, registered with Opacus' registry.

Every module of this package is imported, and every :class:`SchemeAccountant` subclass with a
``mechanism_name`` is registered, so ``PrivacyEngine(accountant="<name>")`` works after
``import opacus_structured`` for each accountant defined in ``accountants/<name>.py``.
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

for _name, _cls in ACCOUNTANTS.items():
    if _ACCOUNTANTS.get(_name) is not _cls:
        register_accountant(_name, _cls, force=True)

__all__ = ["SchemeAccountant", "register_scheme_accountant", "PoissonAccountant", "ACCOUNTANTS"]
