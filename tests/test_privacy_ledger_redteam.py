"""Red-team suite of the privacy ledger (issue 29): plausible training loops, as users write
them, over every scheme, on the ``make_private`` path, with ``num_workers`` 0 and 2. Each case
must raise a clear error or print an ε at least an independent pricing of what actually ran
(see ``tests/redteam.py``). A fast subset runs in every CI run; the full grid is ``slow``."""

from __future__ import annotations

import itertools

import pytest
from redteam import (
    GHOST_SHAPES,
    MAY_RAISE,
    MUST_RAISE,
    SCHEMES,
    SHAPES,
    STOCK_SHAPES,
    judge,
    run_case,
    run_ghost_case,
    run_stock_case,
)
from redteam_lightning import LIGHTNING_SHAPES, run_lightning_case

from opacus_structured.schemes import registry

FAST_SHAPES = ("plain", "skip2", "break", "double_step", "rewrap", "stale_reload",
               "resume_checkpoint", "skip_accumulate2", "two_views", "cached", "prefetched",
               "peek", "public_fakes", "reuse_cached", "sampler_mutation")

#: The default run (README command, issue 41: <= 5 min) takes a covering subset of
#: ``FAST_SHAPES`` x schemes with 0 workers; the rest of the grid is ``slow`` (CI runs it all):
#:
#: * every scheme on ``plain`` and on the shapes that must raise or are refused in well under
#:   a second (``CHEAP_SHAPES``);
#: * every other fast shape on one scheme of each release policy and on both structured
#:   top levels (``COVERING_SCHEMES``: independent, GDP's closed form, span, exact, windows).
#:
#: What leaves the default run: balls-in-bins, random-allocation-bandmf, bandmf-identity and
#: Poisson on the priced loop shapes beyond ``plain`` (3-9 s each, 2/3 of the grid's time;
#: their pricing is the same code path as ``plain``, the loop shapes' bookkeeping is covered
#: on the covering schemes of the same release policy). Two views of each example on Poisson's
#: make_private path are priced in the default run against dp_accounting's optimistic PLD at
#: σ/2 by tests/test_release_rows.py (test_two_views_per_example_are_priced_at_half_sigma).
CHEAP_SHAPES = ("plain", "double_step", "rewrap", "reuse_cached", "sampler_mutation")
COVERING_SCHEMES = ("truncated-poisson", "gdp", "shuffle", "random-allocation-identity",
                    "bandmf-banded", "structured-wor", "structured-deterministic")

#: Shapes also run with 2 workers (where prefetching could hide which batch a step used).
WORKER_SHAPES = ("plain", "skip2", "break", "eval_draw", "early_stop", "double_step",
                 "resume_checkpoint", "skip_accumulate2", "concat2", "two_views", "cached",
                 "prefetched", "rebuilt", "peek", "reuse_cached")
CASES = [(s, sh, w) for s, sh, w in itertools.product(SCHEMES, SHAPES, (0, 2))
         if w == 0 or sh in WORKER_SHAPES]


def _marks(scheme, shape, workers):
    fast = workers == 0 and shape in FAST_SHAPES and (
        shape in CHEAP_SHAPES or scheme in COVERING_SCHEMES)
    return () if fast else (pytest.mark.slow,)


@pytest.mark.parametrize("scheme,shape,workers", [
    pytest.param(s, sh, w, marks=_marks(s, sh, w), id=f"{s}-{sh}-w{w}") for s, sh, w in CASES])
def test_loop_never_under_reports(scheme, shape, workers):
    judge(scheme, shape, run_case(scheme, shape, workers))


def test_grid_size():
    """Issue 39 grew the grid: draws per release (1, 2, 3), rows per example (1, 2),
    delivery (live, cached, prefetched, rebuilt, a look first), public rows, a batch trained
    twice and sampler mutation, on every scheme and both paths (and DPCallback where the
    shape applies)."""
    total = len(CASES) + len(LIGHTNING_CASES) + len(STOCK_CASES) + len(GHOST_CASES)
    assert total >= 700
    assert MUST_RAISE <= MAY_RAISE <= set(SHAPES)


def test_every_registered_scheme_is_in_the_grid():
    """A new scheme gets the red-team suite by adding one small instance to
    ``redteam.SCHEMES``; this fails until it does. ``bminsep-mc`` is priced by Monte Carlo
    (an estimate, never printed as a guarantee), so ``make_private`` refuses it; its ledger
    policy is checked in tests/test_privacy_ledger.py."""
    names = {s.name if not isinstance(s, str) else "structured" for s in SCHEMES.values()}
    missing = set(registry.SCHEMES) - names - {"bminsep-mc"}
    assert not missing, f"add an instance of {sorted(missing)} to tests/redteam.py SCHEMES"


STOCK_ROW_SHAPES = ("skip_accumulate2", "concat2", "two_views", "cached", "prefetched",
                    "public_fakes", "reuse_cached", "accumulate", "stale_reload", "peek",
                    "sampler_mutation")
STOCK_CASES = list(itertools.product(("poisson", "shuffle"), STOCK_SHAPES + STOCK_ROW_SHAPES,
                                     (0, 2)))
#: Default run of the stock path (issue 41: Poisson skip_accumulate2, 5 s, is ``slow``: the
#: default run prices two draws summed in one step on our make_private path,
#: tests/test_release_rows.py, and rows on the stock path with two_views).
STOCK_FAST = {("poisson", "plain", 0), ("poisson", "other_loader", 0),
              ("poisson", "double_step", 0), ("shuffle", "break", 0),
              ("poisson", "two_views", 0),
              ("poisson", "cached", 2), ("shuffle", "concat2", 0),
              ("shuffle", "prefetched", 0), ("shuffle", "public_fakes", 0),
              ("poisson", "sampler_mutation", 0)}


@pytest.mark.parametrize("accountant,shape,workers", [
    pytest.param(a, sh, w, marks=() if (a, sh, w) in STOCK_FAST else (pytest.mark.slow,),
                 id=f"stock-{a}-{sh}-w{w}") for a, sh, w in STOCK_CASES])
def test_stock_opacus_loop_never_under_reports(accountant, shape, workers):
    judge(accountant, shape, run_stock_case(shape, workers, accountant))


LIGHTNING_CASES = [(s, sh, w) for s, sh, w in itertools.product(
    [s for s in SCHEMES if not isinstance(SCHEMES[s], str)], LIGHTNING_SHAPES, (0, 2))
    if w == 0 or sh in ("plain", "skip2", "accumulate2")]
#: One case per Lightning shape in the default run; public_fakes runs on shuffle (span policy,
#: as balls-in-bins: 0.3 s against 3.5 s; issue 41), balls-in-bins' case is ``slow``. Issue 46:
#: accumulate_grad_batches (a shorter last group on span and one-σ schemes, the correlated
#: refusal; Poisson against dp_accounting is tests/test_dp_accumulation.py), ghost clipping,
#: declared rows per example.
LIGHTNING_FAST = {("poisson", "skip2"), ("bandmf-banded", "limit_train_batches"),
                  ("balls-in-bins", "max_steps"), ("shuffle", "two_views"),
                  ("shuffle", "public_fakes"), ("shuffle", "accumulate4"),
                  ("random-allocation-identity", "accumulate4"),
                  ("truncated-poisson", "accumulate3"), ("bandmf-banded", "accumulate2"),
                  ("shuffle", "ghost_two_views"), ("shuffle", "ghost_two_views_declared"),
                  ("gdp", "two_views_declared"), ("truncated-poisson", "ghost_accumulate2"),
                  ("shuffle", "ghost_plain"), ("random-allocation-identity", "ghost_accumulate4")}


@pytest.mark.parametrize("scheme,shape,workers", [
    pytest.param(s, sh, w, marks=() if (s, sh) in LIGHTNING_FAST and w == 0
                 else (pytest.mark.slow,),
                 id=f"lightning-{s}-{sh}-w{w}") for s, sh, w in LIGHTNING_CASES])
def test_lightning_loop_never_under_reports(scheme, shape, workers):
    out = run_lightning_case(scheme, shape, workers)
    judge(scheme, shape, out)


#: Opacus' ghost clipping on the make_private path (issue 46): k rows per example, K draws per
#: release, delivery and public rows, on every scheme; priced from the rows' tokens as in hooks
#: mode (the zero_grad inside Opacus' ghost loss.backward() keeps the forwards it clips).
GHOST_CASES = [(s, sh) for s in SCHEMES for sh in GHOST_SHAPES]
#: Default run: rows per example on an independent-noise span scheme and the closed-form GDP
#: scheme, draws per release on windows, a cached epoch, and the correlated-noise refusal
#: (each < 1 s; Poisson's two views at the issue's setting is tests/test_release_rows.py).
GHOST_FAST = {("shuffle", "two_views"), ("gdp", "three_views"), ("shuffle", "concat2"),
              ("structured-wor", "skip_accumulate2"), ("truncated-poisson", "cached"),
              ("bandmf-banded", "concat2"), ("random-allocation-identity", "two_views")}


@pytest.mark.parametrize("scheme,shape", [
    pytest.param(s, sh, marks=() if (s, sh) in GHOST_FAST else (pytest.mark.slow,),
                 id=f"ghost-{s}-{sh}") for s, sh in GHOST_CASES])
def test_ghost_clipping_loop_never_under_reports(scheme, shape):
    out = run_ghost_case(scheme, shape)
    if shape in ("two_views", "three_views", "concat2", "skip_accumulate2", "cached"):
        # a valid loop: priced (a refusal is acceptable only under correlated noise)
        assert out.error is None or out.scheme.release_policy == "exact", out.error
    judge(scheme, shape, out)
