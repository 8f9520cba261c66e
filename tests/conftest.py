import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one process per core: threads inside each would only contend


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first (in collection order otherwise), so that no long test ends
    the suite on one worker while the other idles. Tests marked ``gpu`` need a CUDA device and
    compiled kernels (``TRITON_INTERPRET=0``: this file sets 1 when it is unset): skipped without
    them."""
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and TRITON_INTERPRET=0 (the suite sets 1 when unset)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the wrappers allocate starts as NaN: an element left unwritten shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", nan_empty)
