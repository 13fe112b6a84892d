import os

import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")

#: Coarse discretization for unit tests (DEVELOPERS.md: keep the suite fast).
TEST_DISCRETIZATION = 1e-3


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
