import os

import pytest
import torch

# The Triton interpreter must be chosen before any @triton.jit function exists.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory):
    """Generated modules go to a temporary folder, not the user's cache."""
    before = os.environ.get("EINFOLD_CACHE_DIR")
    os.environ["EINFOLD_CACHE_DIR"] = str(tmp_path_factory.mktemp("einfold-cache"))
    yield
    if before is None:
        os.environ.pop("EINFOLD_CACHE_DIR", None)
    else:
        os.environ["EINFOLD_CACHE_DIR"] = before
