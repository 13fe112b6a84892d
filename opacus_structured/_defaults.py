"""Defaults shared by the accounting core and the command line (layer 0, no imports).

The ``forecast`` command's parser shows :data:`DEFAULT_DISCRETIZATION` in ``--help`` and checks
its arguments before the accounting core (dp_accounting, scipy) is imported
(docs/architecture.md, "Lazy loading"), so the value lives here;
:mod:`opacus_structured.accounting.pld` re-exports it.
"""

#: Pessimistic PLD discretisation interval of every command and of ``accounting.pld``.
DEFAULT_DISCRETIZATION = 1e-4
