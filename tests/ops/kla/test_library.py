"""The fused KLA kernels as torch.library operators: registrations (opcheck), torch.compile and
CUDA graphs.

On the CPU the operators run the Triton kernels through the interpreter (``TRITON_INTERPRET=1``,
set in conftest), so the shapes are tiny: two channel blocks (one partial), two chunks (one
partial), a non-power-of-two state. The ``gpu`` tests compile with inductor and capture a training
step in a CUDA graph; on the GPU machine: ``TRITON_INTERPRET=0 python -m pytest tests/ops/kla/test_library.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import KERNEL_DEVICE, max_rel_error

from kalmanscan.nn import KLA
from kalmanscan.ops.kla.triton.library import SPLIT_CONFIG, KLAConfig, kla_scan_bwd, kla_scan_fwd
from kalmanscan.ops.kla.reference import kla_scan_sequential
from kalmanscan.ops.kla.triton.backend import kla_scan_triton

TINY = KLAConfig(block_m=2, chunk=4, bwd_block_m=2)          # M = 3: two channel blocks; L = 7: two chunks
TINY_S = KLAConfig(block_m=2, chunk=4, bwd_block_m=2, states_first=True)  # the same, each thread a channel's states
B, L, M, S = 2, 7, 3, 3


def scan_inputs(seed, dtype=torch.float32):
    """``v, lam_v, k, q, decay, noise, lam0, eta0``: random, non-zero, in range."""
    g = torch.Generator().manual_seed(seed)
    rand, randn = (lambda *s: f(*s, generator=g, dtype=dtype) for f in (torch.rand, torch.randn))
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    xs = [randn(B, L, M), 0.1 + 2 * rand(B, L, M), unit(randn(B, L, S)), unit(randn(B, L, S)),
          0.6 + 0.4 * rand(M, S), 0.05 + rand(M, S), 0.5 + rand(B, M, S), randn(B, M, S)]
    return [x.to(KERNEL_DEVICE) for x in xs]


def op_args(with_state, save, config=TINY):
    xs = scan_inputs(4)
    lam0, eta0 = (xs[6], xs[7]) if with_state else (None, None)
    return (*xs[:6], lam0, eta0, save, config.as_ints())


def outputs_and_grads(fn, xs):
    """``fn``'s four outputs and the gradients of a fixed random functional of them."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    outs = fn(xs)
    g = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs)
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, xs))


@pytest.mark.parametrize("with_state,save,config", [(False, True, TINY), (True, False, TINY),
                                                    (True, True, TINY_S)])
def test_opcheck_forward(with_state, save, config):
    args = op_args(with_state, save, config)
    if save:
        args = tuple(x.requires_grad_() if isinstance(x, torch.Tensor) else x for x in args)
    torch.library.opcheck(kla_scan_fwd, args)


@pytest.mark.parametrize("config,v_dtype", [(TINY, torch.float32), (TINY_S, torch.float32),
                                            (TINY, torch.bfloat16)])
def test_opcheck_backward(config, v_dtype):
    """The backward's registrations; with a bf16 ``v`` (and ``gy``, ``gy_var`` in ``y``'s dtype) its
    ``gv`` comes in bf16, ``glam_v`` in ``lam_v``'s float32."""
    args = list(op_args(True, True, config))
    args[0] = args[0].to(v_dtype)
    _, _, _, _, ckpt_lam, ckpt_eta = kla_scan_fwd(*args)
    g = torch.Generator().manual_seed(5)
    shapes = ((B, L, M), (B, L, M), (B, M, S), (B, M, S))
    grads = [torch.randn(*shape, generator=g).to(KERNEL_DEVICE) for shape in shapes]
    grads[:2] = [x.to(v_dtype) for x in grads[:2]]
    bwd_args = (*args[:6], ckpt_lam, ckpt_eta, *grads, config.as_ints())
    gv, glam_v = kla_scan_bwd(*bwd_args)[:2]
    assert gv.dtype == v_dtype and glam_v.dtype == torch.float32
    torch.library.opcheck(kla_scan_bwd, bwd_args)


@pytest.mark.slow  # about 3.7 s
def test_opcheck_packed_documents():
    """Both operators with ``cu_seqlens`` (documents of 1, 4, 0 and 2 tokens, one row) and a
    per-document initial state, the grid turned: the fakes' shapes and strides, the autograd
    registration and the schema (no input mutated) as the implementations give them, every
    output defined (an empty document's final state is its initial state)."""
    config = TINY_S
    xs = scan_inputs(8)
    cu = torch.tensor([0, 1, 5, 5, 7], dtype=torch.int32, device=KERNEL_DEVICE)
    g = torch.Generator().manual_seed(9)
    lam0, eta0 = (0.5 + torch.rand(4, M, S, generator=g)).to(KERNEL_DEVICE), torch.randn(4, M, S, generator=g).to(
        KERNEL_DEVICE)
    args = (*(x[:1] for x in xs[:4]), *xs[4:6], lam0, eta0, True, config.as_ints(), cu)
    args = tuple(x.requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in args)
    torch.library.opcheck(kla_scan_fwd, args)
    ckpt_lam, ckpt_eta = (x.detach() for x in kla_scan_fwd(*args)[4:])
    grads = [torch.randn(*shape, generator=g).to(KERNEL_DEVICE) for shape in ((1, L, M), (1, L, M), (4, M, S),
                                                                                (4, M, S))]
    detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in args]
    torch.library.opcheck(kla_scan_bwd, (*detached[:6], ckpt_lam, ckpt_eta, *grads, config.as_ints(), *detached[6:8],
                                         cu))


def test_per_filter_gradients_reach_leaves_in_their_layout():
    """With the grid turned (``states_first``) the backward returns the gradients of ``decay``,
    ``noise``, ``lam0`` and ``eta0`` as views in the kernels' ``(..., S, M)`` layout (no copy); the
    leaves' ``.grad`` still come out contiguous and equal to the unturned grid's."""
    grads = {}
    for config in (TINY, TINY_S):
        xs = [x.requires_grad_() for x in scan_inputs(6)]
        y, y_var, lam, eta = kla_scan_triton(*xs, config=config)
        (y.sum() + y_var.sum() + lam.sum() + eta.square().sum()).backward()
        grads[config.states_first] = [x.grad for x in xs[4:]]
    for turned, plain in zip(grads[True], grads[False]):
        assert turned.is_contiguous() and turned.shape == plain.shape
        assert max_rel_error(turned, plain) < 1e-5


@pytest.mark.parametrize("config", [TINY, TINY_S])
def test_half_precision_v_rounds_once(config):
    """A bf16 ``v`` (the layer's under autocast) gives ``y`` and ``gv`` in bf16: the float32 scan's
    rounded once. On CUDA the kernels round to nearest even, as torch's cast does: equal bit for bit.
    Triton's interpreter converts float32 to bf16 by truncating: there within one bf16 unit in the
    last place. The states do not depend on how ``v`` is stored: bit for bit unchanged. The other
    gradients are float32 sums whose kernel is compiled anew for the bf16 pointer, and the compiler
    may order or contract its float32 arithmetic otherwise (on an H100 at these masked tiny blocks:
    up to 1.2e-6 relative; bit for bit at a full launch): the tolerance of two compilations, as in
    ``test_per_filter_gradients_reach_leaves_in_their_layout``."""
    xs = scan_inputs(7)
    xs[0] = xs[0].to(torch.bfloat16).float()
    g = torch.Generator().manual_seed(3)
    gy = torch.randn(B, L, M, generator=g).to(torch.bfloat16).to(KERNEL_DEVICE)
    runs = []
    for v_dtype in (torch.float32, torch.bfloat16):
        leaves = [x.clone().requires_grad_() for x in xs]
        y, y_var, lam, eta = kla_scan_triton(leaves[0].to(v_dtype), *leaves[1:], config=config)
        assert y.dtype == v_dtype
        torch.autograd.backward((y, lam), (gy.to(v_dtype), torch.ones_like(lam)))
        runs.append((y, lam, eta, *(x.grad for x in leaves)))
    full, half = runs
    assert half[3].dtype == torch.float32            # the leaf is float32; the op's gv was bf16
    for i, (a, b) in enumerate(zip(full, half)):
        if i in (0, 3):
            rounded = b.float() if i == 0 else b
            ulp = torch.exp2(torch.floor(torch.log2(a.abs())) - 7)
            assert ((rounded - a).abs() <= ulp).all(), f"output {i}: more than one bf16 ulp from float32"
            if KERNEL_DEVICE.type == "cuda":
                torch.testing.assert_close(rounded, a.to(torch.bfloat16).float(), rtol=0, atol=0)
        elif i in (1, 2):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"output {i}")
        else:
            assert max_rel_error(b, a) < 1e-5, f"gradient {i}"


def test_config_round_trip():
    for config in (TINY, TINY_S, SPLIT_CONFIG, KLAConfig(unroll=2, pieces=3, bwd_pieces=None)):
        back = KLAConfig.from_ints(config.as_ints())
        assert back == config and type(back.states_first) is bool


@pytest.mark.parametrize("config", [TINY, None])   # None: launch_config's choice, made while tracing
def test_compiled_fullgraph_equals_eager_and_reference(config):
    """torch.compile(fullgraph=True) traces the op with its fake and autograd registrations: the
    compiled forward and backward equal eager, which equals the float64 recursion."""
    xs = scan_inputs(6, torch.float64)

    def scan(xs):
        return kla_scan_triton(*(x.float() for x in xs), config=config)

    compiled = torch.compile(scan, fullgraph=True, backend="aot_eager")
    out, grads = outputs_and_grads(scan, xs)
    out_c, grads_c = outputs_and_grads(compiled, xs)
    for a, b in zip(out + grads, out_c + grads_c):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a), xs)
    for a, r in zip(out_c + grads_c, ref + ref_grads):
        assert max_rel_error(a.double(), r) < 2e-5          # test_kla_scan's float32 tolerance


def layer_and_input(seed=0):
    torch.manual_seed(seed)
    layer = KLA(64, d_state=16, backend="triton").cuda()
    x = torch.randn(2, 300, 64, device="cuda")
    return layer, x


def loss_and_grads(layer, x):
    y = layer(x)
    loss = y.square().mean()
    return loss, torch.autograd.grad(loss, [x, *layer.parameters()])


@pytest.mark.gpu
def test_compiled_layer_equals_eager_on_gpu():
    layer, x = layer_and_input()
    x.requires_grad_()
    loss, grads = loss_and_grads(layer, x)
    compiled = torch.compile(layer, fullgraph=True)
    loss_c, grads_c = loss_and_grads(compiled, x)
    torch.testing.assert_close(loss_c, loss, rtol=1e-4, atol=1e-6)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
def test_training_step_in_a_cuda_graph_equals_eager():
    """A forward, backward and SGD step captured once and replayed equals the same steps in eager."""
    layer, x = layer_and_input()
    eager, _ = layer_and_input()
    eager.load_state_dict(layer.state_dict())
    params = list(layer.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)

    def step(model, optimizer):
        optimizer.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):                              # warm-up: kernels compiled, grads allocated
            step(layer, opt)
            step(eager, eager_opt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(layer, opt)
    losses, eager_losses = [], []
    for _ in range(3):
        graph.replay()
        losses.append(loss.clone())
        eager_losses.append(step(eager, eager_opt).detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-7)
    for p, q in zip(layer.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
