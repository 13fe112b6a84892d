"""Red-team suite of the privacy ledger (issue 29): plausible training loops, as users write
them, over every scheme, on the ``make_private`` path, with ``num_workers`` 0 and 2. Each case
must raise a clear error or print an ε at least an independent pricing of what actually ran
(see ``tests/redteam.py``). A fast subset runs in every CI run; the full grid is ``slow``."""

from __future__ import annotations

import itertools

import pytest

from redteam import (
    LIGHTNING_SHAPES,
    MAY_RAISE,
    SCHEMES,
    SHAPES,
    judge,
    run_case,
    run_lightning_case,
)

FAST_SHAPES = ("plain", "skip2", "break", "double_step", "rewrap", "stale_reload",
               "resume_checkpoint")
MUST_RAISE = {"double_step", "rewrap", "stale_reload", "other_loader", "detached_step"}

CASES = list(itertools.product(SCHEMES, SHAPES, (0, 2)))


def _marks(scheme, shape, workers):
    fast = workers == 0 and shape in FAST_SHAPES
    return () if fast else (pytest.mark.slow,)


@pytest.mark.parametrize("scheme,shape,workers", [
    pytest.param(s, sh, w, marks=_marks(s, sh, w), id=f"{s}-{sh}-w{w}") for s, sh, w in CASES])
def test_loop_never_under_reports(scheme, shape, workers):
    out = run_case(scheme, shape, workers)
    judge(scheme, shape, out)
    if shape in MUST_RAISE and not (scheme == "gdp" and shape == "double_step"):
        assert out.error is not None, f"{scheme}/{shape}: printed {out.epsilon}, must raise"


def test_grid_size():
    assert len(CASES) >= 200
    assert MUST_RAISE <= set(SHAPES) and MAY_RAISE <= set(SHAPES)


LIGHTNING_CASES = list(itertools.product([s for s in SCHEMES if not isinstance(SCHEMES[s], str)],
                                         LIGHTNING_SHAPES, (0,)))
LIGHTNING_FAST = {("poisson", "skip2"), ("bandmf-banded", "limit_train_batches"),
                  ("balls-in-bins", "max_steps")}


@pytest.mark.parametrize("scheme,shape,workers", [
    pytest.param(s, sh, w, marks=() if (s, sh) in LIGHTNING_FAST else (pytest.mark.slow,),
                 id=f"lightning-{s}-{sh}-w{w}") for s, sh, w in LIGHTNING_CASES])
def test_lightning_loop_never_under_reports(scheme, shape, workers):
    out = run_lightning_case(scheme, shape, workers)
    judge(scheme, shape, out)
