import os

import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")

#: Coarse discretization for unit tests (DEVELOPERS.md: keep the suite fast).
TEST_DISCRETIZATION = 1e-3


def same_pld(a, b) -> bool:
    """Whether two dp_accounting PLDs hold the same PMFs bit for bit (lowest loss, every
    probability, infinity mass) in both directions: a cached PLD against a fresh build. Exact
    on every CPU: both sides are our code on the same inputs in one process (one float path);
    never use it against a peer's PLD (tests/test_gaussian_branch.py bounds that difference)."""
    import numpy as np

    def pmfs(pld):
        return [(p._lower_loss, np.array(p._probs), p._infinity_mass)  # noqa: SLF001
                for p in (pld._pmf_remove, pld._pmf_add)]  # noqa: SLF001

    return all(l1 == l2 and i1 == i2 and np.array_equal(p1, p2)
               for (l1, p1, i1), (l2, p2, i2) in zip(pmfs(a), pmfs(b), strict=True))


def default_subset(cases, keep, ids=None):
    """Cases for ``@pytest.mark.parametrize`` of a grid whose default run is a subset.

    The cases in ``keep`` run in the README's test command; every other case is marked
    ``slow`` (``.ci/run`` runs them all in its second step). Issue 41: the README command must
    take <= 5 min on 2 cores, so a grid keeps its corners and each distinct code path by
    default and the rest of it runs in CI. A case is a tuple of the argument values (a bare
    value for one argument); cases that are already ``pytest.param`` objects pass through, and
    ids are pytest's own, as without the helper, or ``ids`` (one per case). Each grid's comment
    says which subset is kept.
    """
    keep = list(keep)
    values = [c for c in cases if not hasattr(c, "marks")]
    missing = [k for k in keep if not any(k is v or k == v for v in values)]
    if missing:
        raise ValueError(f"default_subset: {missing} not among the grid's cases")
    out = []
    for i, case in enumerate(cases):
        if hasattr(case, "marks"):  # already a pytest.param
            out.append(case)
            continue
        marks = () if any(case is k or case == k for k in keep) else (pytest.mark.slow,)
        case_id = None if ids is None else ids[i]
        out.append(pytest.param(*case, marks=marks, id=case_id) if isinstance(case, tuple)
                   else pytest.param(case, marks=marks, id=case_id))
    return out


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True, scope="session")
def _weights_cache_in_tmp(tmp_path_factory):
    """Pretrained weights made by tests go to a temporary cache, never the user's."""
    old = os.environ.get("OPACUS_STRUCTURED_CACHE")
    os.environ["OPACUS_STRUCTURED_CACHE"] = str(tmp_path_factory.mktemp("weights-cache"))
    yield
    if old is None:
        os.environ.pop("OPACUS_STRUCTURED_CACHE", None)
    else:
        os.environ["OPACUS_STRUCTURED_CACHE"] = old
