"""A KLA layer's grid of filters as a toolkit filter, so the toolkit's diagnostics apply to it.

    obs, post = ks.nn.layer_filters(layer, x)         # x (B, L, D) -> (B, L, M*S) channels
    ks.diagnostics.report(post, obs)                   # NIS, PIT, coverage of the layer's own v

Filter ``(m, s)`` of a :class:`kalmanscan.nn.KLA` layer is a scalar Kalman filter with an OU prior
(docs/math.md, section 7): state ``x_t = decay x_{t-1} + N(0, noise)``, observation ``v_t[m] = k_t[s]
x_t + N(0, 1 / lam_v_t[m])``, prior ``N(0, 1)`` before the first token's transition. That is
:func:`kalmanscan.filter` on channel ``c = m * S + s`` with ``y = v[m]``, ``h = k[s]``, ``obs_var =
1 / lam_v[m]`` per token, and the OU pair ``(theta dt, sigma_eff)`` over a unit step whose exact
discretisation is the layer's ``(decay, noise)``: ``decay = exp(-theta dt)`` and ``sigma_eff^2 =
noise / phi(2 theta dt)`` (:func:`kalmanscan.model.ou.phi`), which holds for the OU and the zero-order-
hold layers alike. The first observation's belief is the prior moved one step: ``N(0, decay^2 +
noise)``.

The layer's outputs are the read-out of these filters: ``y[m] = sum_s q[s] mean[m, s]`` and
``y_var[m] = sum_s q[s]^2 var[m, s]`` (tested against :func:`kalmanscan.nn.kla_scan`). What the
diagnostics then ask is whether each filter's one-step predictive law of ``v`` is honest about
the ``v`` the layer actually produces: the same question the toolkit asks of a filter fitted to
sensor data. The ``S`` filters of one ``m`` observe the same ``v[m]``, so their innovations are
not independent: a report over all channels counts ``S`` times the independent observations, and
its bands are correspondingly too narrow (read the statistics, or report one ``s`` at a time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


import torch

from kalmanscan.model import ou
from kalmanscan.inference.filtering import filter as kalman_filter
from kalmanscan.inference.posterior import Posterior

if TYPE_CHECKING:
    from kalmanscan.nn.layer import KLA


__all__ = ["layer_filters"]


@torch.no_grad()
def layer_filters(layer: KLA, x: torch.Tensor, backend: str = "torch") -> tuple[Any, Posterior]:
    """``(obs, post)``: the filters of ``layer`` (a :class:`kalmanscan.nn.KLA`) run over ``x``.

    A diagnostic: it runs without gradients, and under the caller's autocast for the layer's
    projections (as the layer's forward does), the filter itself in the scan dtype.

    Args:
        layer: a ``KLA`` layer; its parameters are read, not changed.
        x: the layer's input ``(B, L, D)`` (a sequence from its start: zero conv window, prior
            ``N(0, 1)``).
        backend: :func:`kalmanscan.filter`'s backend (``"reference"``: the sequential float64
            covariance form, on the CPU).

    Returns:
        ``obs`` ``(B, L, M * S)``: ``v[..., m]`` on channel ``m * S + s``, a tensor in the scan
        dtype (float64 for a float64 layer, else float32), a NumPy array for ``"reference"``;
        ``post``: the :class:`~kalmanscan.Posterior` of :func:`kalmanscan.filter` over ``obs``
        (NumPy for ``"reference"``).

    Raises:
        ValueError: naming ``layer`` or ``x`` when they are not a KLA layer and its input.
    """
    from kalmanscan.nn.layer import KLA

    if not isinstance(layer, KLA):
        raise ValueError(f"layer must be a kalmanscan.nn.KLA, got {type(layer).__name__}")
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != layer.d_model:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a tensor of shape (B, L, D) with D = {layer.d_model}, got {shape}")
    _, _, _, (v, lam_v, k, _) = layer.observe(x)      # under the caller's autocast, as the layer
    theta, _, dt = layer.ou_params()
    decay, noise = layer.discretized()
    B, L, M = v.shape
    S = k.shape[-1]
    channels = (B, L, M, S)
    obs = v[..., None].expand(channels).reshape(B, L, M * S)
    h = k[:, :, None, :].expand(channels).reshape(B, L, M * S)
    obs_var = (1.0 / lam_v)[..., None].expand(channels).reshape(B, L, M * S)
    rate = theta * dt
    rate, sigma_eff, init_var = (t.reshape(M * S) for t in (
        rate, torch.sqrt(noise / ou.phi(2.0 * rate)), decay * decay + noise))
    args = dict(theta=rate, sigma=sigma_eff, obs_var=obs_var, h=h, dt=1.0,
                init_mean=torch.zeros_like(init_var), init_var=init_var)
    if backend == "reference":
        obs_np = obs.cpu().numpy()
        args = {n: a.cpu().numpy() if isinstance(a, torch.Tensor) else a for n, a in args.items()}
        return obs_np, kalman_filter(obs_np, backend=backend, **args)
    with torch.autocast(obs.device.type, enabled=False):
        post: Posterior = kalman_filter(obs, backend=backend, **args)
    return obs, post
