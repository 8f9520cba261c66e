"""The triton filter's differentiable forward as ``torch.library`` operators, so ``torch.compile``
traces a ``ks.filter(..., backend="triton")`` call through the kernels without a graph break.

    kalmanscan::filter_fused(y, theta, sigma, dt, obs_var, mean, h, init, shape, config)
        -> (mu, lam, pred_mu, pred_var)
    kalmanscan::filter_fused_backward(y, theta, sigma, dt, obs_var, mean, h, init, mu, lam,
                                      g_mu?, g_lam?, g_pred_mu?, g_pred_var?, shape, config)
        -> (grad_y, obs_grad, trans_grad, grad_init)
    kalmanscan::filter_posterior(y, theta, sigma, dt, obs_var, mean, h, init, shape, config, mask)
        -> [field, ...]

Shapes: the inputs broadcast to ``shape = (..., T, C)`` (``init`` is ``(B, 2, C)``, ``B`` the
product of the batch dimensions: initial precision and information mean, centred); the forward's
outputs are ``(B, T, C)``: the centred filtered mean and precision, the centred predicted mean and
the predicted variance (:func:`kalmanscan.ops.filter.triton.filter_forward`). The backward takes
their cotangents (absent ones as ``None``: never read) and returns the kernels' adjoints
(:func:`kalmanscan.ops.filter.triton.filter_backward`): ``grad_y`` ``(B, T, C)``, the observation
adjoints ``(3, B, T or 1, C)``, the transition adjoints ``(2, B, T or 1, C)`` (``T`` where those
parameters vary along time, :func:`kalmanscan.ops.filter.triton.step_flags`) and ``grad_init``
``(B, 2, C)``. ``config`` is a :class:`~kalmanscan.ops.filter.triton.config.FilterConfig` as integers
(:meth:`~kalmanscan.ops.filter.triton.config.FilterConfig.as_ints`). ``filter_posterior`` is the forward
without gradients that writes the Posterior's fields directly (those of the bit mask ``mask``, in
the order of :data:`kalmanscan.ops.filter.triton.POSTERIOR`, each of ``shape``): what
``ks.filter`` runs under ``torch.compile`` when nothing needs a gradient (with the mask's bit of
``"loglik"``, :data:`~kalmanscan.ops.filter.triton.walks.LOGLIK_SUM`, also the log-likelihood's
sum over time ``(..., C)``, after the fields), so the compiler sees one
operator that writes only its outputs rather than tracing the kernel launches themselves (a
compiled call that traced them changed the caller's ``theta``).

Each operator has a fake (meta) implementation giving its outputs' shapes from its inputs'
(:func:`torch.library.register_fake`); the forward has its autograd formula
(:func:`torch.library.register_autograd`): the backward operator, then the chain rule to the
user's parameters (:func:`kalmanscan.ops.filter.triton.param_adjoints.param_grads`). The implementations launch
the Triton kernels on the inputs' device (CUDA, or the CPU under ``TRITON_INTERPRET=1``) and read
no value on the host: neither synchronises.
"""

from __future__ import annotations

import math

import torch

from kalmanscan.ops.filter.triton import walks
from kalmanscan.ops.filter.triton.param_adjoints import param_grads
from kalmanscan.ops.filter.triton.config import FilterConfig

__all__ = ["filter_fused", "filter_fused_backward", "filter_posterior"]

Tensor = torch.Tensor
Four = tuple[Tensor, Tensor, Tensor, Tensor]


def _views(inputs, shape):
    return {k: walks.flat(x.detach(), tuple(shape)) for k, x in zip(walks.ORDER, inputs)}


@torch.library.custom_op("kalmanscan::filter_fused", mutates_args=())
def filter_fused(y: Tensor, theta: Tensor, sigma: Tensor, dt: Tensor, obs_var: Tensor, mean: Tensor, h: Tensor,
                 init: Tensor, shape: list[int], config: list[int]) -> Four:
    """The fused forward writing ``(mu, lam, pred_mu, pred_var)``, centred, ``(B, T, C)``; see the
    module docstring."""
    views = _views((y, theta, sigma, dt, obs_var, mean, h), shape)
    out = walks.filter_forward(views, init.contiguous(), config=FilterConfig.from_ints(config))
    return out["mu"], out["lam"], out["pred_mu"], out["pred_var"]


@filter_fused.register_fake
def _(y, theta, sigma, dt, obs_var, mean, h, init, shape, config):
    B, T, C = math.prod(shape[:-2]), shape[-2], shape[-1]
    return tuple(y.new_empty(B, T, C) for _ in range(4))


@torch.library.custom_op("kalmanscan::filter_fused_backward", mutates_args=())
def filter_fused_backward(y: Tensor, theta: Tensor, sigma: Tensor, dt: Tensor, obs_var: Tensor, mean: Tensor,
                          h: Tensor, init: Tensor, mu: Tensor, lam: Tensor, g_mu: Tensor | None, g_lam: Tensor | None,
                          g_pred_mu: Tensor | None, g_pred_var: Tensor | None, shape: list[int],
                          config: list[int]) -> Four:
    """The fused backward: ``(grad_y, obs_grad, trans_grad, grad_init)``; see the module docstring."""
    views = _views((y, theta, sigma, dt, obs_var, mean, h), shape)
    grad_y, obs_grad, trans_grad, grad_init = walks.filter_backward(
        views, init.contiguous(), mu, lam, (g_mu, g_lam, g_pred_mu, g_pred_var), FilterConfig.from_ints(config))
    trans_step, obs_step = walks.step_flags(views)  # else both are views of one (5, B, 1, C) sum:
    own = dict(memory_format=torch.contiguous_format)      # copies, laid out as the fake outputs say
    return (grad_y, obs_grad if obs_step else obs_grad.clone(**own),
            trans_grad if trans_step else trans_grad.clone(**own), grad_init)


@filter_fused_backward.register_fake
def _(y, theta, sigma, dt, obs_var, mean, h, init, mu, lam, g_mu, g_lam, g_pred_mu, g_pred_var, shape, config):
    B, T, C = mu.shape
    trans_step, obs_step = walks.step_flags(_views((y, theta, sigma, dt, obs_var, mean, h), shape))
    return (mu.new_empty(B, T, C), mu.new_empty(3, B, T if obs_step else 1, C),
            mu.new_empty(2, B, T if trans_step else 1, C), mu.new_empty(B, 2, C))


@torch.library.custom_op("kalmanscan::filter_posterior", mutates_args=())
def filter_posterior(y: Tensor, theta: Tensor, sigma: Tensor, dt: Tensor, obs_var: Tensor, mean: Tensor, h: Tensor,
                     init: Tensor, shape: list[int], config: list[int], mask: int) -> list[Tensor]:
    """The Posterior's fields of the bit mask ``mask``, each of ``shape``; see the module docstring."""
    views = _views((y, theta, sigma, dt, obs_var, mean, h), shape)
    fields = _fields(mask)
    out = walks.filter_forward(views, init.contiguous(), config=FilterConfig.from_ints(config),
                               posterior=fields, out_shape=tuple(shape), loglik_sum=False)
    if "loglik" in out:
        out["loglik"] = out["loglik"].reshape(_summed(shape))
    return [out[k] for k in fields]


@filter_posterior.register_fake
def _(y, theta, sigma, dt, obs_var, mean, h, init, shape, config, mask):
    return [y.new_empty(_summed(shape) if k == "loglik" else shape) for k in _fields(mask)]


def _fields(mask: int) -> tuple[str, ...]:
    """The names of ``mask``'s bits: :data:`~kalmanscan.ops.filter.triton.POSTERIOR`'s, then
    ``"loglik"`` (:data:`~kalmanscan.ops.filter.triton.walks.LOGLIK_SUM`)."""
    return tuple(k for i, k in enumerate((*walks.POSTERIOR, "loglik")) if mask >> i & 1)


def _summed(shape: list[int]) -> list[int]:
    """The shape of a sum over time, ``(..., C)``, of a problem of ``shape``."""
    return [*shape[:-2], shape[-1]]


def _setup_context(ctx, inputs, output):
    *tensors, shape, config = inputs
    ctx.shape, ctx.config = shape, config
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, output[0], output[1])


def _backward(ctx, g_mu, g_lam, g_pred_mu, g_pred_var):
    *inputs, init, mu, lam = ctx.saved_tensors
    shape = tuple(ctx.shape)
    grad_y, obs_grad, trans_grad, grad_init = filter_fused_backward(
        *inputs, init, mu, lam, g_mu, g_lam, g_pred_mu, g_pred_var, ctx.shape, ctx.config)
    y, theta, sigma, dt, obs_var, mean, h = inputs
    params = dict(theta=theta, sigma=sigma, dt=dt, obs_var=obs_var, mean=mean, h=h)
    grads = param_grads(shape, params, obs_grad, trans_grad, ctx.needs_input_grad[1:7])
    gy = grad_y.reshape(shape).sum_to_size(y.shape) if ctx.needs_input_grad[0] else None
    return (gy, *grads, grad_init if ctx.needs_input_grad[7] else None, None, None)


filter_fused.register_autograd(_backward, setup_context=_setup_context)
