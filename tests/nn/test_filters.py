"""ks.nn.layer_filters: a KLA layer's filters as kalmanscan.filter channels, read out as the layer."""

import math

import numpy as np
import pytest
import torch

import kalmanscan as ks
from helpers import random_kla
from kalmanscan.nn import KLA, layer_filters
from kalmanscan.ops.kla.reference import kla_scan_sequential

TOL = dict(rtol=1e-10, atol=1e-12)


def readout(layer, x):
    """The scan's y, y_var for x by the float64 token-by-token filter of the scan's tests."""
    _, _, _, (v, lam_v, k, q) = layer.observe(x)
    decay, noise = layer.discretized()
    y, y_var, _, _ = kla_scan_sequential(v, lam_v, k, q, decay, noise)
    return y, y_var, q


def assert_reads_out_as_the_layer(layer, x, backend):
    obs, post = layer_filters(layer, x, backend=backend)
    y, y_var, q = readout(layer, x)
    B, L, M = y.shape
    S = q.shape[-1]
    mean = torch.as_tensor(np.asarray(post.mean)).reshape(B, L, M, S)
    var = torch.as_tensor(np.asarray(post.var)).reshape(B, L, M, S)
    torch.testing.assert_close((q[:, :, None, :] * mean).sum(-1), y.detach(), **TOL)
    torch.testing.assert_close((q[:, :, None, :] ** 2 * var).sum(-1), y_var.detach(), **TOL)
    assert tuple(obs.shape) == (B, L, M * S)
    return obs, post


@pytest.mark.parametrize("variant", ["plain", "mamba"])
@pytest.mark.parametrize("discretization", ["ou", "zoh"])
@pytest.mark.parametrize("L", [1, 63])
def test_filters_read_out_as_the_scan(variant, discretization, L):
    """Against the covariance-form reference filter (an independent formulation)."""
    layer = random_kla(variant, discretization, d_model=5, d_state=4, seed=L)
    x = torch.randn(2, L, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(L))
    assert_reads_out_as_the_layer(layer, x, "reference")


def test_torch_backend_equals_reference_and_leaves_inputs_alone():
    layer = random_kla(d_model=4, d_state=3)
    x = torch.randn(3, 40, 4, dtype=torch.float64)
    before = [p.detach().clone() for p in layer.parameters()]
    x0 = x.clone()
    obs, post = assert_reads_out_as_the_layer(layer, x, "torch")
    ref_obs, ref = layer_filters(layer, x, backend="reference")
    np.testing.assert_allclose(obs.numpy(), ref_obs, rtol=0, atol=0)
    for name in ("mean", "var", "pred_obs_mean", "pred_obs_var", "logliks"):
        np.testing.assert_allclose(getattr(post, name).numpy(), getattr(ref, name), rtol=1e-10,
                                   atol=1e-12, err_msg=name)
    assert torch.equal(x, x0) and all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))


def test_without_process_noise():
    """sigma = 0 (the GLA limit): sigma_eff = 0, still the layer's read-out."""
    layer = random_kla(d_model=4, d_state=3)
    with torch.no_grad():
        layer.log_sigma.fill_(-math.inf)
    x = torch.randn(2, 30, 4, dtype=torch.float64)
    assert_reads_out_as_the_layer(layer, x, "torch")


def test_diagnostics_apply():
    layer = random_kla(d_model=4, d_state=3)
    obs, post = layer_filters(layer, torch.randn(4, 50, 4, dtype=torch.float64))
    rep = ks.diagnostics.report(post, obs)
    assert rep.n_obs == obs.numel() and math.isfinite(rep.mean_nis) and 0 <= rep.coverage[0.9] <= 1


def test_float32_layer_gives_float32_channels():
    layer = KLA(4, d_state=3, backend="torch")
    obs, post = layer_filters(layer, torch.randn(2, 9, 4))
    assert obs.dtype == torch.float32 and post.mean.dtype == torch.float32
    assert torch.isfinite(post.var).all()


def test_bad_arguments_raise():
    layer = random_kla()
    with pytest.raises(ValueError, match="layer must be"):
        layer_filters(torch.nn.Linear(4, 4), torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="x must be"):
        layer_filters(layer, torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        layer_filters(layer, torch.randn(1, 3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        layer_filters(layer, np.zeros((1, 3, 4)))
