"""The chunked forward (``FilterConfig.chunks``, :mod:`kalmanscan.kernels.filter.chunks`): a program
per block of channels streams time, its rows splitting each chunk; steady chunks compose the mean's
affine maps only. Against the float64 reference and the walks, every field, on the interpreter and
the GPU.

Launches here are small (chunks of 4 rows of 8 steps, 4 channels a program) so that a few hundred
steps cross many chunks and several channel blocks, and the last chunk and block are partial."""

import importlib
import os

import numpy as np
import pytest
import torch
from helpers import FIELDS, FLOAT32_BOUND, KERNEL_DEVICE, POSITIVE, config, max_rel_error, rel_error, triton_filter

import kalmanscan as ks
from kalmanscan.inputs import prepare
from kalmanscan.ops.filter import triton as triton_backend

chunks = importlib.import_module("kalmanscan.kernels.filter.chunks")

CHUNKS = config(chunks=True, chunk_rows=4, chunk_steps=8, chunk_block=4, chunk_warps=1, chunk_min_programs=1)
WALKS = config(stretch=16)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def branches(monkeypatch):
    """``{"steady": n, "general": n}``: chunks (times programs) that took each branch, counted under
    the interpreter (else ``None`` counts)."""
    count = {"steady": 0, "general": 0}
    if INTERPRETED:
        for key, name in (("steady", "steady_segment"), ("general", "stretch_product")):
            original = getattr(chunks, name)

            def counted(*args, _original=original, _key=key):
                count[_key] += 1
                return _original(*args)

            monkeypatch.setattr(chunks, name, counted)
    return count


def problem(T, C, dtype, missing=0.0, batch=2, per_step=False, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(batch, T, C)) + 0.5
    y[rng.random(y.shape) < missing] = np.nan
    kw = dict(theta=rng.uniform(0.3, 1.5, C), sigma=0.7, obs_var=rng.uniform(0.5, 2.0, C), mean=0.2, h=1.1,
              init_var=3.0)
    if per_step:
        kw["obs_var"] = rng.uniform(0.5, 2.0, (T, C))
    t = {k: torch.tensor(v, dtype=dtype, device=KERNEL_DEVICE) if isinstance(v, np.ndarray) else v
         for k, v in kw.items()}
    return y, kw, prepare(torch.tensor(y, dtype=dtype, device=KERNEL_DEVICE), **t)


def errors(out, ref):
    return {k: (rel_error if k in POSITIVE else max_rel_error)(getattr(out, k), getattr(ref, k)) for k in FIELDS}


@pytest.mark.parametrize("T, C, missing", [(1, 3, 0.0), (63, 5, 0.0), (200, 6, 0.0), (200, 6, 0.1), (1000, 3, 0.02)])
def test_float64_every_field_against_the_reference(T, C, missing, branches, poisoned):
    y, kw, p = problem(T, C, torch.float64, missing)
    errs = errors(triton_filter(p, CHUNKS), ks.filter(y, backend="reference", **kw))
    assert max(errs.values()) < 1e-12, errs
    if INTERPRETED and T > 64 and missing == 0.0:
        assert branches["steady"] > branches["general"] > 0


@pytest.mark.parametrize("T, missing", [(200, 0.0), (97, 0.05)])
def test_float32_within_the_bound(T, missing, branches, poisoned):
    y, kw, p = problem(T, 5, torch.float32, missing, seed=T)
    errs = errors(triton_filter(p, CHUNKS), ks.filter(y, backend="reference", **kw))
    assert max(errs.values()) < FLOAT32_BOUND, errs
    if INTERPRETED:
        assert branches["steady"] > 0


def test_equals_the_walks_and_each_launch_shape():
    """Rows, steps and channel blocks of other sizes, per-step observation variance (no steady
    chunk), against the walks in float64."""
    _, _, p = problem(150, 7, torch.float64, 0.05, batch=1, per_step=True, seed=3)
    want = triton_filter(p, WALKS)
    for launch in ((2, 4, 8), (8, 2, 2), (1, 16, 4)):
        got = triton_filter(p, config(chunks=True, chunk_rows=launch[0], chunk_steps=launch[1], chunk_block=launch[2],
                                      chunk_warps=1, chunk_min_programs=1))
        for k in FIELDS:
            assert max_rel_error(getattr(got, k), getattr(want, k)) < 1e-12, (launch, k)


def test_steady_chunks_from_a_sharp_and_a_vague_start(branches):
    """The initial precision far above and below the fixed point: chunks turn steady once the
    carried precision stops moving, and a missing value late in the series sends its chunk back to
    the general branch."""
    y, kw, _ = problem(300, 2, torch.float64, batch=2, seed=5)
    y[:, 250, 1] = np.nan
    kw["init_var"] = np.array([[1e-6], [1e6]])
    t = {k: torch.tensor(v, device=KERNEL_DEVICE) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    out = triton_filter(prepare(torch.tensor(y, device=KERNEL_DEVICE), **t), CHUNKS)
    errs = errors(out, ks.filter(y, backend="reference", **kw))
    assert max(errs.values()) < 1e-12, errs
    if INTERPRETED:
        assert branches["steady"] > 0 and branches["general"] >= 2 * 2


def test_dispatch():
    """Off by default until measured; where on, the tiles' few series and forced stretches stay."""
    on = config(chunks=True)
    assert not triton_backend.uses_chunks(1, 32768, 4096, config())
    assert triton_backend.uses_chunks(1, 32768, 4096, on)
    assert not triton_backend.uses_chunks(1, 1 << 20, 1, on)
    assert not triton_backend.uses_chunks(1, 32768, 64, on)
    assert not triton_backend.uses_chunks(1, 32768, 4096, config(chunks=True, stretch=64))
