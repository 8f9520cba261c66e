"""The KLA block: gradients, decoding, chunked prefill, discretisation switch, variance, bad input."""

import functools
import math

import pytest
import torch
from torch.func import functional_call

from helpers import random_kla
from kalmanscan.model import ou
from kalmanscan import nn as ks_nn
from kalmanscan.ops.kla.reference import kla_scan_sequential

# These tests pin the "kalmanscan" scheme's parameters (log_sigma, a per-channel skip, the S4D
# rates); tests/nn/test_init.py covers the default "authors" scheme.
KLA = functools.partial(ks_nn.KLA, init="kalmanscan")

TOL = dict(rtol=1e-10, atol=1e-12)


def inputs(B=2, L=5, D=4, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, L, D, dtype=torch.float64)


@pytest.mark.parametrize("variant,names", [
    ("plain", ("log_theta", "log_dt", "log_sigma", "skip")),
    ("mamba", ("log_theta", "var_expand.weight", "conv.weight")),
])
def test_gradcheck_float64(variant, names):
    layer = random_kla(variant)
    params = dict(layer.named_parameters())
    x = inputs(L=5).requires_grad_()
    chosen = tuple(params[n].detach().clone().requires_grad_() for n in names)

    def f(x, *chosen):
        y, y_var = functional_call(layer, {**params, **dict(zip(names, chosen))}, (x,),
                                   dict(return_variance=True))
        return y, y_var

    assert torch.autograd.gradcheck(f, (x, *chosen), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "mamba"])
@pytest.mark.parametrize("L", [1, 63])
def test_step_by_step_decoding_equals_forward(variant, L):
    layer = random_kla(variant, d_model=6, d_state=5)
    x = inputs(B=3, L=L, D=6)
    y, y_var = layer(x, return_variance=True)
    state = layer.init_state(3)
    ys, vs = [], []
    for t in range(L):
        y_t, v_t, state = layer.step(x[:, t], state, return_variance=True)
        ys.append(y_t)
        vs.append(v_t)
    torch.testing.assert_close(torch.stack(ys, 1), y, **TOL)
    torch.testing.assert_close(torch.stack(vs, 1), y_var, **TOL)


def test_step_state_has_constant_size():
    layer = random_kla()
    state = layer.init_state(2)
    shapes = [tuple(s.shape) for s in state]
    for t in range(4):
        _, state = layer.step(inputs(L=1)[:, 0], state)
    assert [tuple(s.shape) for s in state] == shapes == [(2, 3, 8), (2, 8, 3), (2, 8, 3)]


def assert_prefill_then_step(layer, x, cuts, tol):
    """Prefill of ``x[:, :-1]`` in the chunks between ``cuts`` equals the one-shot forward, and a
    decoding step with ``x[:, -1]`` then continues the same sequence."""
    y_ref, v_ref = layer(x[:, :-1], return_variance=True)
    state = layer.init_state(x.shape[0])
    ys, vs = [], []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        y, v, state = layer(x[:, lo:hi], state=state, return_variance=True)
        ys.append(y)
        vs.append(v)
    torch.testing.assert_close(torch.cat(ys, 1), y_ref, **tol)
    torch.testing.assert_close(torch.cat(vs, 1), v_ref, **tol)
    y_next, _ = layer.step(x[:, -1], state)
    torch.testing.assert_close(y_next, layer(x)[:, -1], **tol)


@pytest.mark.parametrize("variant", ["plain", "mamba"])
def test_chunked_prefill_equals_one_shot(variant):
    x = inputs(L=23)
    # chunks shorter and longer than the conv; the step repeats the last token
    assert_prefill_then_step(random_kla(variant), torch.cat([x, x[:, -1:]], 1), [0, 1, 3, 10, 23], TOL)


def test_forward_matches_float64_sequential_filter():
    """The block around an independent token-by-token filter gives the same output."""
    layer = random_kla(d_model=5, d_state=4)
    x = inputs(L=17, D=5)
    z, gate = layer.in_proj(x).chunk(2, -1)
    z = torch.nn.functional.silu(layer.conv(torch.nn.functional.pad(z.transpose(1, 2), (3, 0))).transpose(1, 2))
    v, lam_v, k, q = layer.sensors(z)
    theta, sigma, dt = (p.exp() for p in (layer.log_theta, layer.log_sigma, layer.log_dt))
    decay, noise = ou.discretize(theta, sigma, dt)
    y, y_var, _, _ = kla_scan_sequential(v, lam_v, k, q, decay, noise)
    g = torch.nn.functional.silu(gate)
    expected = layer.out_proj((y + layer.skip * z) * g)
    expected_var = (y_var * g * g) @ layer.out_proj.weight.square().T
    out, out_var = layer(x, return_variance=True)
    torch.testing.assert_close(out, expected, **TOL)
    torch.testing.assert_close(out_var, expected_var, **TOL)


def test_zoh_and_ou_both_run_and_differ():
    x = inputs(L=9)
    ou_layer, zoh_layer = random_kla(discretization="ou"), random_kla(discretization="zoh")
    zoh_layer.load_state_dict(ou_layer.state_dict())
    y_ou, y_zoh = ou_layer(x), zoh_layer(x)
    assert torch.isfinite(y_ou).all() and torch.isfinite(y_zoh).all()
    assert not torch.allclose(y_ou, y_zoh)
    d_ou, n_ou = ou_layer.discretized()
    d_zoh, n_zoh = zoh_layer.discretized()
    torch.testing.assert_close(d_ou, d_zoh, **TOL)
    assert (n_zoh > n_ou).all()            # Euler noise overstates the exact OU noise


def test_initialisation_ranges():
    torch.manual_seed(0)
    layer = KLA(32, d_state=16, expand=2)
    theta, sigma, dt = layer.ou_params()
    assert dt.min() >= 1e-3 and dt.max() <= 1e-1 and dt.max() / dt.min() > 30
    torch.testing.assert_close(theta[5], torch.arange(1.0, 17.0))
    torch.testing.assert_close(sigma, torch.full_like(sigma, 0.1))
    decay, noise = layer.discretized()
    assert ((decay > 0) & (decay < 1)).all() and (noise > 0).all()
    assert layer.sensor_proj.out_features == 2 * 64 + 2 * 16
    mamba = KLA(32, d_state=16, variant="mamba")
    assert mamba.sensor_proj.out_features == math.ceil(32 / 8) + 2 * 16
    assert mamba.var_expand.in_features == 4


def test_variance_positive_and_shaped():
    layer = random_kla("mamba")
    x = inputs(B=3, L=11)
    y, y_var = layer(x, return_variance=True)
    assert y.shape == y_var.shape == (3, 11, 4)
    assert (y_var > 0).all()


def test_float32_and_bf16_autocast_keep_the_scan_in_float32():
    layer64 = random_kla(d_model=8, d_state=4)
    layer = KLA(8, d_state=4, backend="torch")
    layer.load_state_dict({k: v.float() for k, v in layer64.state_dict().items()})
    x = inputs(L=40, D=8)
    y64 = layer64(x)
    y32 = layer(x.float())
    torch.testing.assert_close(y32.double(), y64, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_var, state = layer(x.float(), state=layer.init_state(2), return_variance=True)
    assert state.lam.dtype == state.eta.dtype == y_var.dtype == torch.float32
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), y64, rtol=0.1, atol=0.05)


def test_gradients_reach_every_parameter():
    layer = random_kla("mamba")
    layer(inputs()).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kwargs", [
    dict(d_state=0), dict(d_conv=0), dict(variant="full"), dict(discretization="euler"),
    dict(expand=1.1), dict(dt_min=0.1, dt_max=0.01), dict(sigma_init=0.0),
    dict(variant="plain", var_rank=4), dict(variant="mamba", var_rank=0),
    dict(theta_init=0.0), dict(theta_init="ones"), dict(theta_init=-1.0),
])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        KLA(4, **kwargs)


def test_theta_init():
    s4d = KLA(4, d_state=3, expand=1, dtype=torch.float64).ou_params()[0]
    torch.testing.assert_close(s4d, torch.tensor([[1.0, 2.0, 3.0]] * 4, dtype=torch.float64))
    flat = KLA(4, d_state=3, expand=1, theta_init=1.0, dtype=torch.float64).ou_params()[0]
    torch.testing.assert_close(flat, torch.ones(4, 3, dtype=torch.float64))


def test_bad_inputs_raise():
    layer = random_kla()
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(2, 5, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must have shape"):
        layer(torch.randn(5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="x_t must have shape"):
        layer.step(torch.randn(2, 1, 4, dtype=torch.float64), layer.init_state(2))
    with pytest.raises(ValueError, match="backend"):
        KLA(4, backend="cuda")


FLOAT32_TOL = dict(rtol=1.3e-6, atol=1e-5)   # torch.testing's default for float32


def noiseless(dtype, d_model=4, d_state=3, seed=0):
    """A layer without process noise (sigma = 0: the GLA limit) whose decays span [0.2, 0.95]: the
    exact precision of its fastest-decaying filters leaves float32's range within 30 tokens and
    float64's within 230."""
    layer = random_kla(d_model=d_model, d_state=d_state, seed=seed).to(dtype)
    M, S = layer.d_inner, layer.d_state
    decay = torch.linspace(0.2, 0.95, M * S, dtype=torch.float64).reshape(M, S)
    with torch.no_grad():
        layer.log_sigma.fill_(-math.inf)
        layer.log_theta.zero_()
        layer.log_dt.copy_(torch.log(-torch.log(decay)))
    layer.noise_free = True
    return layer


def decode(layer, x, state):
    """Token-by-token decoding of ``x`` from ``state``: ``(y, y_var, state)``."""
    ys, vs = [], []
    for t in range(x.shape[1]):
        y_t, v_t, state = layer.step(x[:, t], state, return_variance=True)
        ys.append(y_t)
        vs.append(v_t)
    return torch.stack(ys, 1), torch.stack(vs, 1), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decoding_without_process_noise_equals_forward(dtype):
    """noise = 0 for 300 tokens, past the overflow of the exact precision: decoding carries the
    variance and mean, stays finite, and equals the parallel forward; so does the final state."""
    layer = noiseless(dtype)
    x = inputs(L=300).to(dtype)
    tol = TOL if dtype == torch.float64 else FLOAT32_TOL
    y, y_var, state = layer(x, state=layer.init_state(2), return_variance=True)
    y_dec, v_dec, state_dec = decode(layer, x, layer.init_state(2))
    for out in (y, y_var, y_dec, v_dec):
        assert torch.isfinite(out).all()
    torch.testing.assert_close(y_dec, y, **tol)
    torch.testing.assert_close(v_dec, y_var, **tol)
    torch.testing.assert_close(state_dec.var, state.var, **tol)
    torch.testing.assert_close(state_dec.mu, state.mu, **tol)
    beyond = state.var < 1 / torch.finfo(dtype).max     # the exact precision is out of range
    assert (state.var == 0).any() and torch.isinf(state.lam[beyond]).all()
    assert torch.isfinite(state.lam[~beyond]).all() and not torch.isnan(state.eta).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_prefill_without_process_noise(dtype):
    tol = TOL if dtype == torch.float64 else FLOAT32_TOL
    # cuts before and after the overflow of the exact precision
    assert_prefill_then_step(noiseless(dtype), inputs(L=301).to(dtype), [0, 1, 40, 250, 300], tol)


class PrefillThenDecode(torch.nn.Module):
    """Prefill of the first ``cut`` tokens, then decoding of the rest, as one module."""

    def __init__(self, layer, cut):
        super().__init__()
        self.layer, self.cut = layer, cut

    def forward(self, x):
        y, y_var, state = self.layer(x[:, :self.cut], self.layer.init_state(x.shape[0]), True)
        assert (state.var == 0).any()            # the exact precision is beyond the range there
        y_dec, v_dec, state = decode(self.layer, x[:, self.cut:], state)
        return y, y_var, y_dec, v_dec, state.var, state.mu


def test_gradcheck_prefill_and_decoding_without_process_noise():
    """Gradients through a prefill past float64's overflow of the precision, then decoding."""
    model = PrefillThenDecode(noiseless(torch.float64, d_model=2, d_state=2), cut=250)
    params = dict(model.named_parameters())
    names = ("layer.log_theta", "layer.log_dt", "layer.skip", "layer.sensor_proj.weight")
    x = inputs(B=1, L=255, D=2).requires_grad_()
    chosen = tuple(params[n].detach().clone().requires_grad_() for n in names)

    def f(x, *chosen):
        return functional_call(model, {**params, **dict(zip(names, chosen))}, (x,))

    assert torch.autograd.gradcheck(f, (x, *chosen), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_recurrent_backend_equals_the_parallel_scan():
    """KLA(backend="recurrent") gives the time-parallel scan's outputs, variance and gradients."""
    layer = random_kla(d_model=6, d_state=4)
    x = inputs(B=2, L=33, D=6).requires_grad_()
    y, y_var = layer(x, return_variance=True)
    grads = torch.autograd.grad((y.sum() + y_var.sum()), [x, *layer.parameters()])
    layer.backend = "recurrent"
    y_r, y_var_r = layer(x, return_variance=True)
    grads_r = torch.autograd.grad((y_r.sum() + y_var_r.sum()), [x, *layer.parameters()])
    torch.testing.assert_close(y_r, y, **TOL)
    torch.testing.assert_close(y_var_r, y_var, **TOL)
    for g_r, g in zip(grads_r, grads):
        torch.testing.assert_close(g_r, g, **TOL)
