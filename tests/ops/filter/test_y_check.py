"""``y``'s inf check queued with the triton forward (``Problem.y_check``): from the stretch products
of the aggregate pass when time is split, else a reduction of ``y`` queued before the kernels; a
small ``y`` checked by result. Run with the threshold (``Tuning.y_by_result``) at 0 so that small
problems take the queued paths."""

import dataclasses
import math

import numpy as np
import pytest
import torch

import kalmanscan as ks
from helpers import KERNEL_DEVICE, synchronisations
from kalmanscan import tuning
from kalmanscan.problem import checks
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton import backend as triton

KW = dict(theta=np.array([0.1, 0.7, 2.0]), sigma=0.8, obs_var=np.array([0.5, 2.0, 1e-3]),
          h=np.array([1.0, 0.0, 3.0]))


@pytest.fixture
def queued(monkeypatch):
    """Every ``y`` large enough for the queued check; the searches of ``y`` counted."""
    searches = []
    search = checks.check_no_inf

    def counted(y):
        searches.append(1)
        search(y)

    monkeypatch.setattr(checks, "check_no_inf", counted)
    with tuning.tuned(y_by_result=0):
        yield searches


def series(T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T, 3, dtype=torch.float64, generator=g).to(KERNEL_DEVICE)
    y[T // 2:: 7, 0] = math.nan  # missing values are not an inf
    return y


@pytest.mark.parametrize("T", [200, 1000])
def test_the_aggregate_pass_is_not_finite_exactly_where_y_holds_an_inf(T):
    """The stretch products' ``e1, e2`` (what the check sums) are finite for finite ``y`` with
    missing values, and not finite for an inf at a stretch's first or last step, the series' first
    or last, of either sign, in each channel (``h = 0`` in channel 1)."""
    y = series(T)
    p = prepare(y, backend="triton", **KW)
    views, init = triton.kernel_views(p), triton.initial_state(p)
    ns, L = triton.plan(1, T, 3)
    assert ns > 1
    out = triton.filter_forward(views, init, posterior=("mean", "var"), y_check=True)
    assert math.isfinite(float(out["y_check"].read()))
    for t, c, value in ((0, 0, math.inf), (L - 1, 1, -math.inf), (L, 2, math.inf), (T - 1, 1, -math.inf)):
        bad = y.clone()
        bad[t, c] = value
        views["y"] = triton.flat(bad, p.shape)
        out = triton.filter_forward(views, init, posterior=("mean", "var"), y_check=True)
        assert not math.isfinite(float(out["y_check"].read())), (t, c, value)


@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("call, outputs", [("filter", None), ("filter", ("mean", "var")), ("smooth", None)])
def test_public_calls_refuse_an_inf_and_search_clean_y_never(queued, T, call, outputs):
    """Through the public calls (one stretch: ``nansum(y)`` queued; several: the aggregate pass):
    an inf anywhere is a ValueError naming ``y``; a clean ``y`` is never searched."""
    fn = getattr(ks, call)
    kw = dict(KW, backend="triton", **({} if outputs is None else dict(outputs=outputs)))
    y = series(T)
    clean = fn(y, **kw)
    assert not queued
    assert torch.isfinite(clean.mean).all() and torch.isfinite(clean.var).all()
    for t in sorted({0, T // 3, T - 1}):
        bad = y.clone()
        bad[t, 2] = -math.inf
        with pytest.raises(ValueError, match="y must be finite or NaN"):
            fn(bad, **kw)
    assert queued


def test_the_check_is_queued_with_the_kernels(queued):
    """The backend returns it with a large ``y`` and a request; never without the request, and never
    in the result of the public call."""
    y = series(200)
    p = prepare(y, backend="triton", **KW)
    assert "y_check" not in triton.filter(p)
    assert isinstance(triton.filter(dataclasses.replace(p, y_check=True))["y_check"], checks.Ahead)
    post = ks.filter(y, backend="triton", **KW)
    assert not hasattr(post, "y_check")


@pytest.mark.gpu
@pytest.mark.parametrize("outputs", [None, ("mean", "var")])
def test_large_gpu_calls_check_y_from_their_kernels_with_one_wait(queued, outputs):
    """On a GPU, at the default threshold, a ``y`` past it (stretches: the aggregate pass's check)
    is refused for an inf anywhere, searched never when clean, with one synchronisation a call."""
    with tuning.tuned(y_by_result=tuning.DEFAULT.y_by_result):
        y = torch.randn(4096, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
        assert triton.plan(1, 4096, 128)[0] > 1 and y.numel() > tuning.current().y_by_result
        kw = dict(theta=0.2, sigma=0.5, obs_var=0.3, backend="triton", outputs=outputs)
        ks.filter(y, **kw)
        torch.cuda.synchronize()
        assert synchronisations(lambda: ks.filter(y, **kw)) == 1
        assert not queued
        for t, c in ((0, 0), (2047, 64), (4095, 127)):
            bad = y.clone()
            bad[t, c] = math.inf
            with pytest.raises(ValueError, match="y must be finite or NaN"):
                ks.filter(bad, **kw)


def test_a_queued_value_past_the_dtype_only_sends_the_check_to_search_y(queued):
    """A queued sum that overflows (finite ``y`` of values near the dtype's largest) is not an
    error: ``y`` is searched, and passes."""
    checks.decide_y(series(200), checks.Ahead(torch.tensor(math.inf)))
    assert queued == [1]
