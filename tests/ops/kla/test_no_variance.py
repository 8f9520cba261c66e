"""The KLA scan without ``y_var`` (``variance=False``): the fused kernels leave its arithmetic,
its store and its gradient's loads out; everything else is unchanged, bit for bit.

The triton kernels run through the interpreter on the CPU (``TRITON_INTERPRET=1``): a partial
channel block, time split into stretches forward and backward (the adjoint maps), both grid
orientations, an initial state, poisoned buffers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import KERNEL_DEVICE, device_of, max_rel_error
from kla_helpers import make_inputs, outputs_and_grads, poisoned

from kalmanscan.nn import KLA
from kalmanscan.ops.kla import kla_scan_unchecked
from kalmanscan.ops.kla.triton.library import (DEFAULT_CONFIG, SPLIT_CONFIG, KLAConfig, kla_scan_bwd, kla_scan_fwd,
                                               launch_config)
from kalmanscan.ops.kla.reference import kla_scan_sequential
from kalmanscan.ops.kla.triton.backend import kla_scan_triton

TOL = 2e-5   # test_kla_scan's float32 tolerance
SMALL = KLAConfig(block_m=4, chunk=8, bwd_block_m=4)                           # M = 5: a partial block
SPLIT = KLAConfig(block_m=4, chunk=4, bwd_block_m=4, pieces=3, bwd_pieces=3)  # time in 3 stretches
SPLIT_S = dataclasses.replace(SPLIT, states_first=True)


def scan(xs, config, variance):
    """``(y, lam, eta)`` of the triton scan, and ``y_var`` (``None`` without ``variance``)."""
    y, y_var, lam, eta = kla_scan_triton(*xs[:6], *(xs[6:] or (None, None)), config=config, variance=variance)
    return (y, lam, eta), y_var


@pytest.mark.parametrize("B, L, with_state, config", [
    (1, 24, False, SMALL),      # three chunks, two channel blocks (one partial)
    (2, 23, True, SPLIT),       # 3 stretches forward and backward, an initial state
    (2, 23, True, SPLIT_S),     # the same, each thread a channel's states
])
def test_without_variance_equals_with_it_and_the_reference(B, L, with_state, config):
    xs = make_inputs(B, L, 5, 3, seed=30 + L, with_state=with_state, device=KERNEL_DEVICE)
    xs32 = [x.float() for x in xs]
    with poisoned():
        out, grads = outputs_and_grads(lambda a: scan(a, config, False)[0], xs32)
        full, full_grads = outputs_and_grads(lambda a: scan(a, config, True)[0], xs32)
    assert scan(xs32, config, False)[1] is None
    for a, b in zip(out + grads, full + full_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref, ref_grads = outputs_and_grads(lambda a: (lambda y, v, lam, eta: (y, lam, eta))(*kla_scan_sequential(*a)), xs)
    for a, r in zip(out + grads, ref + ref_grads):
        assert max_rel_error(a.double(), r) < TOL


def test_a_config_without_variance():
    """The config's field alone turns it off, and launch_config keeps its choice of grid."""
    cpu = torch.device("cpu")
    assert launch_config(1, 64, 8, cpu, variance=False) == dataclasses.replace(SPLIT_CONFIG, variance=False)
    assert launch_config(8, 64, 64, cpu, variance=False) == dataclasses.replace(DEFAULT_CONFIG, variance=False)
    xs = [x.float() for x in make_inputs(1, 9, 5, 3, seed=3, device=KERNEL_DEVICE)]
    y, y_var, _, _ = kla_scan_triton(*xs, config=dataclasses.replace(SMALL, variance=False))
    assert y_var is None
    torch.testing.assert_close(y, kla_scan_triton(*xs, config=SMALL)[0], rtol=0, atol=0)
    assert KLAConfig.from_ints(dataclasses.replace(SMALL, variance=False).as_ints()).variance is False


@pytest.mark.slow  # about 6.5 s: every opcheck of the operator without the variance
def test_opcheck_without_variance():
    config = dataclasses.replace(SPLIT_S, variance=False).as_ints()
    xs = [x.float().requires_grad_() for x in make_inputs(2, 11, 5, 3, seed=5, with_state=True,
                                                          device=KERNEL_DEVICE)]
    args = (*xs, True, config)
    torch.library.opcheck(kla_scan_fwd, args)
    y, y_var, _, _, ckpt_lam, ckpt_eta = kla_scan_fwd(*args)
    assert y_var.shape == (1,)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(*s, generator=g).to(KERNEL_DEVICE) for s in ((2, 11, 5), (1,), (2, 5, 3), (2, 5, 3))]
    torch.library.opcheck(kla_scan_bwd, (*[x.detach() for x in (*xs[:6], ckpt_lam, ckpt_eta)], *grads, config))


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_unchecked_without_variance_on_every_backend(backend):
    xs = [x.float() for x in make_inputs(2, 13, 5, 3, seed=9, device=device_of(backend))]
    y, y_var, state = kla_scan_unchecked(*xs, return_state=True, backend=backend, variance=False)
    y_full, _, state_full = kla_scan_unchecked(*xs, return_state=True, backend=backend)
    assert y_var is None
    torch.testing.assert_close(y, y_full, rtol=0, atol=0)
    torch.testing.assert_close(state.var, state_full.var, rtol=0, atol=0)


def test_layer_leaves_the_variance_out_unless_asked():
    """The layer's output and every gradient are those of a forward that also returned the
    variance (the triton kernels through the interpreter on the CPU)."""
    torch.manual_seed(0)
    layer = KLA(8, d_state=3, expand=2, backend="triton").to(KERNEL_DEVICE)
    x = torch.randn(2, 19, 8, device=KERNEL_DEVICE, requires_grad=True)
    weight = torch.randn(2, 19, 8, device=KERNEL_DEVICE)
    y = layer(x)
    grads = torch.autograd.grad((y * weight).sum(), [x, *layer.parameters()])
    y_full, y_var = layer(x, return_variance=True)
    grads_full = torch.autograd.grad((y_full * weight).sum(), [x, *layer.parameters()])
    assert y_var.shape == y.shape
    torch.testing.assert_close(y, y_full, rtol=0, atol=0)
    for a, b in zip(grads, grads_full):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_without_variance_equals_eager():
    """torch.compile(fullgraph=True) traces the op without y_var (its (1,) placeholder and the
    gradient autograd gives it): forward and gradients equal eager's."""
    xs = [x.float().requires_grad_() for x in make_inputs(2, 11, 5, 3, seed=1, device=KERNEL_DEVICE)]

    def loss(*a):
        y, y_var, lam, eta = kla_scan_triton(*a, variance=False)
        return y.square().sum() + lam.sum() + eta.sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for a, b in zip(torch.autograd.grad(loss(*xs), xs), torch.autograd.grad(compiled(*xs), xs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
