"""Helpers to run Opacus' released test sources (the ``opacus.tests`` package of the installed
Opacus 1.6.0 wheel, Apache-2.0, Meta Platforms) against this package's accountants.

Nothing of Opacus' tests is copied here: ``tests/test_opacus_suite.py`` imports them from the
wheel. :mod:`.torchvision_standin` replaces the few ``torchvision`` names those sources import
when torchvision is not installed (it is not a dependency of this package).
"""
