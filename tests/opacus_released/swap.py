"""Opacus' ``PrivacyEngine`` with this package's accountants in place of Opacus' default.

Used by ``tests/test_opacus_suite.py`` (through a ``monkeypatch`` fixture) and, as a pytest
plugin (``-p opacus_released.swap``), by ``benchmarks/opacus_own_tests.py``, which runs Opacus'
released test modules unchanged with it:

* ``PrivacyEngine()`` builds ``"poisson"`` (our pessimistic-PLD Poisson accountant) where
  Opacus builds ``"prv"``; an accountant the test names (``accountant="rdp"``) is kept;
* a fresh ``"poisson"`` accountant becomes ``"shuffle"`` when ``make_private(...,
  poisson_sampling=False)`` keeps the caller's shuffled / sequential loader (``"poisson"``
  rightly refuses that loader; ``"shuffle"`` prices it soundly, without amplification).

As a plugin it also installs the documented torchvision stand-in
(:mod:`.torchvision_standin`) when torchvision is missing, and ``--max-examples N`` caps every
hypothesis test at ``N`` examples (Opacus' own settings leave hypothesis' default, 100).
"""

from __future__ import annotations

from opacus import PrivacyEngine

import opacus_structured  # noqa: F401  (registers the accountants with Opacus)
from opacus_structured.accountants.poisson import PoissonAccountant
from opacus_structured.accountants.shuffle import ShuffleAccountant

from . import torchvision_standin

__all__ = ["init", "make_private", "install", "uninstall", "ORIGINAL_INIT",
           "ORIGINAL_MAKE_PRIVATE"]

ORIGINAL_INIT = PrivacyEngine.__init__
ORIGINAL_MAKE_PRIVATE = PrivacyEngine.make_private


def init(self, *, accountant: str = "poisson", secure_mode: bool = False):
    """Opacus' ``PrivacyEngine.__init__`` with our ``"poisson"`` as the default accountant."""
    ORIGINAL_INIT(self, accountant=accountant, secure_mode=secure_mode)


def make_private(self, *args, poisson_sampling: bool = True, **kwargs):
    """Opacus' ``make_private``; a fresh ``"poisson"`` accountant becomes ``"shuffle"`` when the
    caller keeps its own (shuffled / sequential) loader."""
    if not poisson_sampling and isinstance(self.accountant, PoissonAccountant) \
            and len(self.accountant) == 0:
        self.accountant = ShuffleAccountant()
    return ORIGINAL_MAKE_PRIVATE(self, *args, poisson_sampling=poisson_sampling, **kwargs)


def install() -> None:
    PrivacyEngine.__init__ = init
    PrivacyEngine.make_private = make_private


def uninstall() -> None:
    PrivacyEngine.__init__ = ORIGINAL_INIT
    PrivacyEngine.make_private = ORIGINAL_MAKE_PRIVATE


# ---- pytest plugin ------------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--max-examples", type=int, default=None,
                     help="cap every hypothesis test at this many examples")


def pytest_configure(config):
    torchvision_standin.install()
    install()
    cap = config.getoption("max_examples")
    if cap:
        from hypothesis import settings

        settings.register_profile("opacus_released_cap", max_examples=int(cap))
        settings.load_profile("opacus_released_cap")


def pytest_unconfigure(config):
    uninstall()
