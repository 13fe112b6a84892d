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
