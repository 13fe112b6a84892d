"""Opacus accountants (``IAccountant``) over our schemes, registered with Opacus' registry.

After ``import opacus_structured``, ``PrivacyEngine(accountant="poisson")`` (and every other
scheme name registered here) works in a stock Opacus ``PrivacyEngine``.
"""

from opacus.accountants.registry import _ACCOUNTANTS, register_accountant

from .base import SchemeAccountant, register_scheme_accountant
from .poisson import PoissonAccountant

__all__ = ["SchemeAccountant", "register_scheme_accountant", "PoissonAccountant",
           "ACCOUNTANTS"]

#: Accountants this package registers with Opacus, by mechanism name.
ACCOUNTANTS = {PoissonAccountant.mechanism(): PoissonAccountant}

for _name, _cls in ACCOUNTANTS.items():
    if _ACCOUNTANTS.get(_name) is not _cls:
        register_accountant(_name, _cls, force=True)
