"""Red-team grid of issue 46 (``tests/redteam_ecosystem.py``): restores, phase schedules and
several private modules on every scheme of the make_private path. A case must print at least
the independent price of what ran, or raise a documented refusal; a replayed noise tensor must
raise. A covering subset runs by default (one scheme per release policy); the grid is ``slow``."""

from __future__ import annotations

import itertools

import pytest
from redteam_ecosystem import (
    DOCUMENTED,
    GRID_SCHEMES,
    LIGHTNING_SHAPES,
    SHAPES,
    judge,
    run_case,
)

#: The default run (README command <= 5 min): every shape on one scheme of each release policy
#: whose cases cost under a second or two (GDP's closed form, shuffle's span, BandMF's exact
#: policy), and Poisson's cheap cases; Poisson's other shapes (2-7 s: dp_accounting's PLD of
#: each oracle) are priced by tests/test_co_release.py, test_phases.py and test_noise_lineage.py
#: in the default run, and in CI's slow step here.
COVERING = {"shuffle", "bandmf-banded", "gdp"}
POISSON_FAST = {"resume_same_seed", "lightning_restore_earlier_new_callback",
                "lightning_phase_resume"}
CASES = list(itertools.product(GRID_SCHEMES, SHAPES + LIGHTNING_SHAPES))


def _fast(scheme, shape):
    if scheme == "bandmf-banded" and shape == "two_modules_two_engines":
        return False  # 4.8 s; its one-engine sibling runs
    if shape.startswith("compiled"):  # Dynamo's first trace ~2 s a case; shuffle's run by
        return scheme == "shuffle"    # default, tests/test_opacus_parity.py prices the rest
    return scheme in COVERING or (scheme == "poisson" and shape in POISSON_FAST)


@pytest.mark.parametrize("scheme,shape", [
    pytest.param(s, sh, marks=() if _fast(s, sh) else (pytest.mark.slow,), id=f"{s}-{sh}")
    for s, sh in CASES])
def test_resumes_phases_and_modules_never_under_report(scheme, shape):
    judge(scheme, shape, run_case(scheme, shape))


def test_documented_refusals_are_in_the_grid():
    assert set(DOCUMENTED) <= set(CASES)
