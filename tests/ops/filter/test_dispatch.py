"""One registry per operation: ``register_backend`` really extends what ``backend=`` accepts, and
``"auto"`` picks the compiled loop on the CPU."""

import types

import numpy as np
import pytest
import torch

import kalmanscan as ks
from kalmanscan.ops import filter as filter_ops
from kalmanscan.ops import kla as kla_ops
from kalmanscan.ops.filter import torch as torch_backend
from kalmanscan.ops.kla import torch as kla_torch

KW = dict(theta=0.4, sigma=0.6, obs_var=0.3)


def test_auto_is_the_compiled_loop_on_the_cpu():
    assert filter_ops.resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert filter_ops.resolve_backend("auto", torch.device("cuda")) == "triton"
    assert filter_ops.resolve_backend("torch", torch.device("cpu")) == "torch"


def test_a_registered_filter_backend_runs_filter_and_smooth():
    calls = []
    mine = types.ModuleType("mine")
    mine.filter = lambda p: calls.append("filter") or torch_backend.filter(p)
    mine.smooth = lambda f, m: calls.append("smooth") or torch_backend.smooth(f, m)
    ks.register_backend("mine", mine)
    try:
        y = np.random.default_rng(0).normal(size=(30, 2))
        want = ks.smooth(y, backend="torch", **KW)
        got = ks.smooth(y, backend="mine", **KW)
        np.testing.assert_array_equal(got.mean, want.mean)
        np.testing.assert_array_equal(ks.filter(y, backend="mine", **KW).loglik, want.loglik)
        assert calls == ["filter", "smooth", "filter"] and "mine" in filter_ops.backend_names()
    finally:
        filter_ops.dispatch.unregister_backend("mine")
    with pytest.raises(ValueError, match="backend must be one of"):
        ks.filter(y, backend="mine", **KW)


@pytest.mark.parametrize("name, module", [("auto", "x"), ("", "x"), ("x", 3)])
def test_bad_registrations_are_named(name, module):
    with pytest.raises(ValueError, match="name|module"):
        ks.register_backend(name, module)


def test_a_registered_kla_backend_runs():
    kla_ops.register_backend("mine", "kalmanscan.ops.kla.torch")
    try:
        g = torch.Generator().manual_seed(0)
        v, k = torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 4, generator=g)
        args = (v, torch.ones_like(v), k, k, torch.full((3, 4), 0.9), torch.full((3, 4), 0.1))
        torch.testing.assert_close(ks.nn.kla_scan(*args, backend="mine"), kla_torch.kla_scan(*args)[:2])
    finally:
        kla_ops.dispatch.unregister_backend("mine")
