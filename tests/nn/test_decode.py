"""Decoding steps into given buffers: the KLA conv and filter steps (kernels through the interpreter
against the torch path; float64 layers against the scan at every position), the attention mixer's
static KV cache, the model's step in place, and on a GPU the compiled kernels and a CUDA graph."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import KERNEL_DEVICE, random_kla
from kalmanscan.nn import SequenceModel
from kalmanscan.nn.common import RMSNorm
from kalmanscan.nn.model import SwiGLU
from kalmanscan.nn.baselines.attention import CausalAttention
from kalmanscan.ops.block import add_rms_norm, silu_mul
from kalmanscan.ops.kla.step import conv_step, kla_decode_step

TOL = dict(rtol=1e-10, atol=1e-12)
FLOAT32_TOL = dict(rtol=1.3e-6, atol=1e-5)   # torch.testing's default for float32


def rows(B, widths, seed, scale=1.0, dtype=torch.float32):
    """Column slices of one (B, sum(widths)) tensor: the token rows of a projection's output."""
    torch.manual_seed(seed)
    return (scale * torch.randn(B, sum(widths), dtype=dtype)).split(widths, -1)


def nan_like(x):
    return torch.full_like(x, math.nan)


@pytest.mark.parametrize("K", [1, 2, 4])
def test_conv_step_kernel_equals_torch(K):
    B, M = 3, 37                                         # M not a multiple of the kernel's block
    z, _ = rows(B, [M, M], seed=K)
    torch.manual_seed(0)
    window, weight, bias = torch.randn(B, K - 1, M), torch.randn(M, K), torch.randn(M)
    out, window_out = conv_step(z, window, weight, bias, backend="torch")
    expect = bias + (torch.cat([window, z[:, None]], 1) * weight.T).sum(1)
    torch.testing.assert_close(out, torch.nn.functional.silu(expect), **FLOAT32_TOL)
    torch.testing.assert_close(window_out, torch.cat([window, z[:, None]], 1)[:, 1:], rtol=0, atol=0)
    buffers = nan_like(out), nan_like(window)
    got, got_window = conv_step(z, window, weight, bias, window_out=buffers[1], out=buffers[0], backend="triton")
    assert got is buffers[0] and got_window is buffers[1]
    torch.testing.assert_close(got, out, **FLOAT32_TOL)
    torch.testing.assert_close(got_window, window_out, rtol=0, atol=0)
    in_place = window.clone()                            # the window updated in place
    conv_step(z, in_place, weight, bias, window_out=in_place, backend="triton")
    torch.testing.assert_close(in_place, window_out, rtol=0, atol=0)


def filter_inputs(B=3, M=37, S=5, seed=0, scalar_skip=False, bias=True):
    """Random non-zero inputs of :func:`kla_decode_step` (float32), log variances over a wide range."""
    v, log_var, k, q = rows(B, [M, M, S, S], seed, scale=3.0)
    z, gate = rows(B, [M, M], seed + 1)
    torch.manual_seed(seed + 2)
    decay, noise = torch.rand(M, S) * 0.98 + 0.01, torch.rand(M, S) * 0.1
    noise[0] = 0.0                                       # a channel without process noise
    skip = torch.randn(()) if scalar_skip else torch.randn(M)
    obs_var_bias = torch.randn(M) if bias else None
    var, mu = torch.rand(B, M, S) + 0.05, torch.randn(B, M, S)
    return (v, log_var, k, q, z, gate, decay, noise, skip, obs_var_bias, var, mu)


@pytest.mark.parametrize("scalar_skip,bias,variance", [(False, True, True), (True, False, False)])
@pytest.mark.parametrize("S", [5, 16])
def test_filter_step_kernel_equals_torch(S, scalar_skip, bias, variance):
    args = filter_inputs(S=S, scalar_skip=scalar_skip, bias=bias)
    ref = kla_decode_step(*args, floor=1e-4, variance=True, backend="torch")
    var, mu = args[-2:]
    buffers = dict(var_out=nan_like(var), mu_out=nan_like(mu), out=nan_like(ref[0]))
    got = kla_decode_step(*args, floor=1e-4, variance=variance, backend="triton", **buffers)
    assert got[0] is buffers["out"] and got[2] is buffers["var_out"] and got[3] is buffers["mu_out"]
    assert (got[1] is not None) == variance
    for g, r in zip(got, ref):
        if g is not None:
            torch.testing.assert_close(g, r, **FLOAT32_TOL)
    state = var.clone(), mu.clone()                      # the state updated in place
    kla_decode_step(*args[:-2], *state, floor=1e-4, var_out=state[0], mu_out=state[1], backend="triton")
    torch.testing.assert_close(state[0], ref[2], **FLOAT32_TOL)
    torch.testing.assert_close(state[1], ref[3], **FLOAT32_TOL)


def test_steps_write_every_output(poisoned):
    """Outputs the wrappers allocate start as NaN (the ``poisoned`` fixture): every element is written."""
    args = filter_inputs(M=45, S=3)
    got = kla_decode_step(*args, floor=1e-4, variance=True, backend="triton")
    ref = kla_decode_step(*args, floor=1e-4, variance=True, backend="torch")
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **FLOAT32_TOL)
    z, window = args[4], torch.randn(3, 3, 45)
    out, window_out = conv_step(z, window, torch.randn(45, 4), torch.randn(45), backend="triton")
    assert torch.isfinite(out).all() and torch.isfinite(window_out).all()


def test_filter_step_torch_is_the_block_arithmetic():
    """The torch path in float64: the sensors of :meth:`KLA.sensors` and one token of the
    reference precision recursion (``var = 1/lam``, ``mu = eta/lam``), then skip and gate."""
    from kalmanscan.ops.kla.reference import kla_scan_sequential

    args = [x if x is None else x.double() for x in filter_inputs()]
    v, log_var, k, q, z, gate, decay, noise, skip, bias, var, mu = args
    out, y_var, var_new, mu_new = kla_decode_step(*args, floor=1e-4, variance=True)
    lam_v = 1.0 / (torch.nn.functional.softplus(log_var + bias) + 1e-4)
    unit = [x / x.norm(dim=-1, keepdim=True) for x in (k, q)]
    y, y_var_ref, lam, eta = kla_scan_sequential(v[:, None], lam_v[:, None], unit[0][:, None], unit[1][:, None],
                                                 decay, noise, 1.0 / var, mu / var)
    torch.testing.assert_close(var_new, 1.0 / lam, **TOL)
    torch.testing.assert_close(mu_new, eta / lam, **TOL)
    torch.testing.assert_close(y_var, y_var_ref[:, 0], **TOL)
    torch.testing.assert_close(out, (y[:, 0] + skip * z) * torch.nn.functional.silu(gate), **TOL)


def test_step_buffers_are_checked():
    args = filter_inputs()
    with pytest.raises(ValueError, match="var_out"):
        kla_decode_step(*args, floor=1e-4, var_out=torch.empty(3, 37, 4), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        kla_decode_step(*args, floor=1e-4, backend="cuda")
    with pytest.raises(ValueError, match="unit column stride"):
        kla_decode_step(args[0].T.contiguous().T, *args[1:], floor=1e-4)


def decode_in_place(layer, x, state, **kwargs):
    """Token-by-token decoding of ``x`` with the state advanced in place: ``(y, y_var)``."""
    ys, vs = [], []
    tensors = [t.data_ptr() for t in state]
    with torch.no_grad():
        for t in range(x.shape[1]):
            y_t, v_t, new = layer.step(x[:, t], state, return_variance=True, out=state, **kwargs)
            assert [t.data_ptr() for t in new] == tensors
            ys.append(y_t)
            vs.append(v_t)
    return torch.stack(ys, 1), torch.stack(vs, 1)


@pytest.mark.parametrize("variant,init", [("plain", "kalmanscan"), ("mamba", "authors")])
@pytest.mark.parametrize("L", [1, 63])
def test_step_in_place_equals_scan_float64(variant, init, L):
    layer = random_kla(variant, d_model=6, d_state=5, init=init)
    torch.manual_seed(3)
    x = torch.randn(3, L, 6, dtype=torch.float64)
    with torch.no_grad():
        y, y_var = layer(x, return_variance=True)
    y_dec, v_dec = decode_in_place(layer, x, layer.init_state(3))
    torch.testing.assert_close(y_dec, y, **TOL)
    torch.testing.assert_close(v_dec, y_var, **TOL)


def test_step_into_other_buffers_leaves_the_state():
    layer = random_kla(d_model=6, d_state=5)
    x = torch.randn(2, 6, dtype=torch.float64)
    state, out = layer.init_state(2), layer.init_state(2)
    before = [t.clone() for t in state]
    with torch.no_grad():
        y, new = layer.step(x, state, out=out)
        y_ref, ref = layer.step(x, state)
    assert all(torch.equal(a, b) for a, b in zip(state, before))
    assert all(a is b for a, b in zip(new, out))
    torch.testing.assert_close(y, y_ref, **TOL)
    for a, b in zip(new, ref):
        torch.testing.assert_close(a, b, **TOL)


def test_step_parameters_follow_in_place_updates():
    layer = random_kla(d_model=4, d_state=3)
    first = layer.step_params()
    assert layer.step_params()[0] is first[0]            # remembered
    with torch.no_grad():
        layer.log_dt.add_(0.5)
    decay, noise = layer.step_params()
    torch.testing.assert_close(decay, layer.discretized()[0], rtol=0, atol=0)
    assert not torch.equal(decay, first[0])


def test_step_into_buffers_needs_no_grad():
    layer = random_kla(d_model=4, d_state=3)
    state = layer.init_state(2)
    with pytest.raises(ValueError, match="no_grad"):
        layer.step(torch.randn(2, 4, dtype=torch.float64), state, out=state)


def test_triton_step_equals_scan_float32():
    """The kernels (through the interpreter on the CPU) step a float32 layer in place; it equals
    the float64 scan at every position to float32 accuracy."""
    layer = random_kla("mamba", d_model=8, d_state=5, init="authors")
    torch.manual_seed(4)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    with torch.no_grad():
        y, y_var = layer(x, return_variance=True)
    layer = layer.float().to(KERNEL_DEVICE)
    layer.backend = "triton"
    y_dec, v_dec = decode_in_place(layer, x.float().to(KERNEL_DEVICE), layer.init_state(2))
    torch.testing.assert_close(y_dec.cpu().double(), y, **FLOAT32_TOL)
    torch.testing.assert_close(v_dec.cpu().double(), y_var, **FLOAT32_TOL)


def test_attention_static_cache_step_equals_forward():
    """Steps in place into a cache with room for every token: the cache is never reallocated,
    ``pos`` counts the tokens, and each step equals the forward at its position; a forward then
    continues from the stepped state."""
    torch.manual_seed(0)
    m = CausalAttention(8, 2).double()
    x = torch.randn(2, 13, 8, dtype=torch.float64)
    y = m(x)
    state = m.init_state(2, capacity=13)
    k_ptr = state.k.data_ptr()
    steps = []
    with torch.no_grad():
        for t in range(9):
            y_t, state = m.step(x[:, t], state, out=state)
            steps.append(y_t)
        assert state.k.data_ptr() == k_ptr and int(state.pos) == state.length == 9
        tail, state = m(x[:, 9:], state=state)
    torch.testing.assert_close(torch.stack(steps, 1), y[:, :9], **TOL)
    torch.testing.assert_close(tail, y[:, 9:], **TOL)
    assert state.k.data_ptr() == k_ptr and int(state.pos) == state.length == 13
    with pytest.raises(ValueError, match="in place"):
        m.step(x[:, 0], state, out=m.init_state(2))


@pytest.mark.parametrize("mix", ["kla", ["attention", "gla", "kla"]])
def test_model_step_in_place_equals_forward(mix):
    torch.manual_seed(0)
    names = mix if isinstance(mix, list) else [mix, mix]
    kwargs = dict(n_heads=2) if "attention" in names else {}
    model = SequenceModel(11, 8, len(names), mixer=names, d_state=4, dtype=torch.float64, **kwargs)
    tokens = torch.randint(0, 11, (2, 21))
    logits = model(tokens)
    state = model.init_state(2, capacity=21)
    steps = []
    with torch.no_grad():
        for t in range(21):
            l_t, _ = model.step(tokens[:, t], state, out=state)
            steps.append(l_t)
    torch.testing.assert_close(torch.stack(steps, 1), logits, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernels_equal_the_modules(dtype):
    """The residual sum with its RMSNorm, and the SwiGLU product, as one kernel each (through the
    interpreter on the CPU) against the modules; odd widths (not powers of two)."""
    torch.manual_seed(0)
    x, y = torch.randn(3, 37, dtype=dtype), torch.randn(3, 37, dtype=dtype)
    norm = RMSNorm(37, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_()
    s, h = add_rms_norm(x, y, norm.weight, norm.eps)
    # bf16: one rounding apart (Triton's interpreter rounds float32 to bf16 towards zero)
    tol = FLOAT32_TOL if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    exact = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0)
    torch.testing.assert_close(s, x + y, **exact)
    torch.testing.assert_close(h, norm(x + y), **tol)
    alone, h = add_rms_norm(x, None, norm.weight, norm.eps)
    assert alone is x
    torch.testing.assert_close(h, norm(x), **tol)
    mlp = SwiGLU(24, multiple_of=1, dtype=dtype)                 # hidden width 64
    gate_up = mlp.w_in(torch.randn(3, 24, dtype=dtype)).detach()
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **tol)
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(gate_up[:, :-1])


def test_fused_model_step_equals_unfused():
    """A KLA model's step with every kernel (the block's and the layer's, through the interpreter)
    equals the step in torch operations, token by token."""
    torch.manual_seed(0)
    model = SequenceModel(17, 16, 2, mixer="kla", d_state=4, backend="triton")
    tokens = torch.randint(0, 17, (2, 5))
    with torch.no_grad():
        states = model.init_state(2), model.init_state(2)
        for t in range(5):
            fused, _ = model.step(tokens[:, t], states[0], out=states[0], fused=True)
            for block in model.blocks:
                block.mixer.backend = "torch"
            plain, _ = model.step(tokens[:, t], states[1], out=states[1], fused=False)
            for block in model.blocks:
                block.mixer.backend = "triton"
            torch.testing.assert_close(fused, plain, **FLOAT32_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "mamba"])
def test_compiled_step_equals_scan(variant):
    """The compiled kernels (float32 state, a bf16 layer's projections too) against the float64
    scan at every position."""
    layer = random_kla(variant, d_model=64, d_state=16, init="authors")
    torch.manual_seed(5)
    x = torch.randn(4, 70, 64, dtype=torch.float64)
    with torch.no_grad():
        y, y_var = layer(x, return_variance=True)
    cuda = layer.float().cuda()
    cuda.backend = "auto"
    y_dec, v_dec = decode_in_place(cuda, x.float().cuda(), cuda.init_state(4))
    torch.testing.assert_close(y_dec.cpu().double(), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_dec.cpu().double(), y_var, rtol=1e-5, atol=1e-5)
    half = layer.to(torch.bfloat16).cuda()
    y_half, _ = decode_in_place(half, x.to(torch.bfloat16).cuda(), half.init_state(4))
    assert torch.isfinite(y_half).all()
    assert (y_half.cpu().double() - y).norm() < 0.05 * y.norm()        # bf16 projections: relative RMS


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["kla", "attention"])
def test_model_step_replayed_from_a_cuda_graph(mix):
    """A model step captured once and replayed gives the eager steps' logits, token by token."""
    torch.manual_seed(0)
    model = SequenceModel(64, 64, 2, mixer=mix, device="cuda")
    tokens = torch.randint(0, 64, (4, 12), device="cuda")
    with torch.no_grad():
        eager, state = [], model.init_state(4, capacity=12)
        for t in range(12):
            eager.append(model.step(tokens[:, t], state, out=state)[0])
        state = model.init_state(4, capacity=12)
        current = tokens[:, 0].clone()
        replayed = [model.step(current, state, out=state)[0].clone()]     # warms every cache
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits, _ = model.step(current, state, out=state)
        for t in range(1, 12):
            current.copy_(tokens[:, t])
            graph.replay()
            replayed.append(logits.clone())
    torch.testing.assert_close(torch.stack(replayed), torch.stack(eager), rtol=1e-5, atol=1e-5)
