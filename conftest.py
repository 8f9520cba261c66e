"""Shared by the three test trees (``tests``, ``benchmarks/tests``, ``evidence/tests``), also when
one runs alone: the order of the tests and the skipping of those marked ``gpu``."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first (in collection order otherwise), so that no long test ends
    the suite on one worker while the other idles. Tests marked ``gpu`` need a CUDA device and
    compiled kernels (``TRITON_INTERPRET=0``; the trees' own conftest files set 1 when it is unset):
    skipped without them."""
    import torch  # here, not at import: the trees' conftest files set TRITON_INTERPRET first

    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and TRITON_INTERPRET=0 (the suite sets 1 when unset)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
