import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def stretches(monkeypatch):
    """Stretches of 4 steps: a problem of length T runs as ceil(T / 4) stretches."""
    from kalmanscan import fused

    monkeypatch.setattr(fused, "MIN_STRETCH", 4)
    monkeypatch.setattr(fused, "TARGET_LANES", 1 << 30)


@pytest.fixture
def tiles(monkeypatch):
    """The time-parallel forward with tiles of 16 steps and at most 4 stretches of them: a series of
    T >= 16 steps runs as up to 4 stretches of several tiles, the last ones partial."""
    from kalmanscan import fused

    monkeypatch.setattr(fused, "TILE", 16)
    monkeypatch.setattr(fused, "TILE_STRETCHES", 4)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the wrappers allocate starts as NaN: an element left unwritten shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", nan_empty)
