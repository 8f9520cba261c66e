"""Small forward calls replayed from CUDA graphs (kalmanscan/ops/filter/replay.py): the memory
blocks copied in and out (on any device), and on a GPU the replayed calls equal to the eager ones
bit for bit, never sharing memory between calls, and never waiting on the host."""

import numpy as np
import pytest
import torch

import kalmanscan as ks
from helpers import synchronisations
from kalmanscan import tuning
from kalmanscan.ops.filter.triton import replay
from kalmanscan.ops.filter.triton.replay import Blocks
from kalmanscan.ops.filter.triton.backend import POSTERIOR, replayed


def test_blocks_copy_whole_blocks_and_rebuild_every_view():
    """Tensors viewing two blocks (a broadcast row, a strided slice, a whole tensor): the static
    copies hold the same values through the same views, ``fill`` copies a new call's blocks, and
    ``copied_views`` gives new memory each time."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 1, 7, generator=g)
    y = torch.randn(3, 5, 7, generator=g)
    tensors = [y, rows[0].expand(3, 5, 7), rows[4].expand(3, 5, 7), rows.view(12, 7)[10:12].unsqueeze(0)]
    blocks = Blocks(tensors)
    assert blocks.which == [0, 1, 1, 1] and not blocks.too_large()
    static = blocks.static_views()
    for a, b in zip(static, tensors):
        assert torch.equal(a, b) and a.stride() == b.stride()
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    rows2, y2 = torch.randn(12, 1, 7, generator=g), torch.randn(3, 5, 7, generator=g)
    blocks.fill([y2, rows2[0].expand(3, 5, 7), rows2[4].expand(3, 5, 7), rows2.view(12, 7)[10:12].unsqueeze(0)])
    assert torch.equal(static[0], y2) and torch.equal(static[2], rows2[4].expand(3, 5, 7))
    assert torch.equal(static[3], rows2.view(12, 7)[10:12].unsqueeze(0))
    out = Blocks(static)
    first, second = out.copied_views(), out.copied_views()
    for a, b, s in zip(first, second, static):
        assert torch.equal(a, s) and torch.equal(b, s)
        assert a.untyped_storage().data_ptr() not in (b.untyped_storage().data_ptr(), s.untyped_storage().data_ptr())


def test_a_small_slice_of_a_large_block_is_not_copied_by_block():
    big = torch.zeros(1 << 20)
    assert Blocks([big[:100].view(10, 10)]).too_large()
    assert not Blocks([big.view(1024, 1024)]).too_large()
    assert Blocks([big.view(torch.int32)[:10], big[:10]]).too_large()  # two dtypes over one block


def test_which_calls_are_replayed():
    """Small outputs, and few long series (the host's launches outlast their kernels) up to
    REPLAY_ELEMENTS; not many long series, whose kernels outlast the host."""
    mean_var = ("mean", "var")
    assert replayed((64, 2048), POSTERIOR)
    assert replayed((1 << 22, 1), mean_var) and replayed((1 << 22, 1), POSTERIOR)
    assert replayed((4, 1 << 20, 1), POSTERIOR) and not replayed((1 << 24, 1), mean_var)
    assert not replayed((32768, 4096), mean_var) and not replayed((1 << 20, 64), mean_var)
    assert not replayed((512, 1 << 22, 1), mean_var)


def _eager_and_replayed(monkeypatch, calls):
    """Every call of ``calls`` (functions of no argument) with replay off, then the same calls with
    it on (each call repeated until its layout is captured, then once more replayed)."""
    with tuning.tuned(replay=False):
        eager = [f() for f in calls]
    replay.clear()
    replayed = []
    for f in calls:
        for _ in range(tuning.current().replay_after + 1):
            f()
        replayed.append(f())
    return eager, replayed


FIELDS = ("mean", "var", "precision", "pred_mean", "pred_var", "pred_precision", "pred_obs_mean",
          "pred_obs_var", "logliks", "loglik")


def assert_same_fields(eager, replayed_calls):
    """Each pair of posteriors has the same fields present, with the same bits (NaN included)."""
    for a, b in zip(eager, replayed_calls):
        for k in FIELDS:
            va, vb = getattr(a, k), getattr(b, k)
            assert (va is None) == (vb is None), k
            if va is not None:
                assert torch.equal(torch.nan_to_num(va, 7.0), torch.nan_to_num(vb, 7.0)), k


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(63, 5), (1000, 3), (2, 300, 17), (5000, 1), (1, 64)])
@pytest.mark.parametrize("outputs", [None, ("mean", "var"), ("loglik",)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_replayed_calls_equal_eager_bit_for_bit(monkeypatch, shape, outputs, dtype):
    """Shapes with one stretch, several stretches, a batch, the tiles (one long series) and one
    step; every field, the mean and variance, the log-likelihood alone; both dtypes: a replayed
    call's fields are the eager call's bits, for data and parameters that change between calls."""
    g = torch.Generator("cuda").manual_seed(1)
    ys = [torch.randn(shape, device="cuda", generator=g, dtype=dtype) for _ in range(3)]
    ys[1][..., 7 % shape[-2], :] = float("nan")
    C = shape[-1]
    rng = np.random.default_rng(2)
    kws = [dict(theta=rng.uniform(0.05, 1, C), sigma=rng.uniform(0.2, 1, C), obs_var=float(rng.uniform(0.1, 1)))
           for _ in ys]
    calls = [lambda y=y, kw=kw: ks.filter(y, backend="triton", outputs=outputs, **kw) for y, kw in zip(ys, kws)]
    assert_same_fields(*_eager_and_replayed(monkeypatch, calls))


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", [("mean", "var"), None])
def test_a_long_series_is_replayed(monkeypatch, outputs):
    """One series whose outputs exceed one block (the tiles' regime): kept as a graph, its replayed
    fields the eager call's bits."""
    g = torch.Generator("cuda").manual_seed(5)
    ys = [torch.randn((1 << 21) + 77, 1, device="cuda", generator=g) for _ in range(2)]
    ys[1][1000:1100] = float("nan")
    calls = [lambda y=y: ks.filter(y, theta=0.4, sigma=0.6, obs_var=0.5, backend="triton", outputs=outputs)
             for y in ys]
    eager, replayed_calls = _eager_and_replayed(monkeypatch, calls)
    assert replay.kept() == 1
    assert_same_fields(eager, replayed_calls)


@pytest.mark.gpu
def test_replayed_smoother_equals_eager(monkeypatch):
    """ks.smooth filters first without gradients: replayed, its smoothed fields are unchanged."""
    g = torch.Generator("cuda").manual_seed(4)
    ys = [torch.randn(2, 500, 6, device="cuda", generator=g) for _ in range(3)]
    kw = dict(theta=np.linspace(0.1, 0.6, 6), sigma=0.5, obs_var=0.3, backend="triton")
    calls = [lambda y=y: ks.smooth(y, **kw) for y in ys]
    eager, replayed = _eager_and_replayed(monkeypatch, calls)
    for a, b in zip(eager, replayed):
        for k in ("mean", "var", "loglik"):
            assert torch.equal(getattr(a, k), getattr(b, k)), k


@pytest.mark.gpu
def test_replayed_results_are_new_memory_and_calls_do_not_wait(monkeypatch):
    """Results of a replayed call are not overwritten by the next call; unchecked calls, the one
    that captures included, never synchronise the host."""
    replay.clear()
    g = torch.Generator("cuda").manual_seed(3)
    kw = dict(theta=0.3, sigma=np.full(8, 0.7), obs_var=0.4, backend="triton", check_finite=False)
    ks.filter(torch.randn(64, 8, device="cuda", generator=g), **kw)  # compiles the kernels
    replay.clear()
    kept = []
    for _ in range(tuning.current().replay_after + 3):
        y = torch.randn(64, 8, device="cuda", generator=g)
        torch.cuda.synchronize()
        assert synchronisations(lambda y=y: kept.append((y, ks.filter(y, **kw)))) == 0
    assert replay.kept() == 1
    for y, post in kept:
        again = ks.filter(y, **{**kw, "check_finite": True})
        assert torch.equal(post.mean, again.mean) and torch.equal(post.loglik, again.loglik)


@pytest.mark.gpu
def test_a_call_inside_a_graph_being_captured_launches_eagerly():
    """A ks.filter call captured into the caller's own CUDA graph is not replayed from another."""
    y = torch.randn(40, 4, device="cuda")
    kw = dict(theta=0.3, sigma=0.5, obs_var=0.4, backend="triton", check_finite=False, outputs=("mean",))
    expected = ks.filter(y, **kw).mean
    for _ in range(tuning.current().replay_after + 1):
        ks.filter(y, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ks.filter(y, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        post = ks.filter(y, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(post.mean, expected)
