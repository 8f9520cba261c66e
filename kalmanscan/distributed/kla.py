"""Context parallelism for Kalman Linear Attention: the token sequence split across ranks.

:func:`kla_scan` is :func:`kalmanscan.nn.kla_scan` for a sequence whose tokens are split along
``L`` across the ranks of a group: each rank summarises its ``M x S`` filters over its tokens in
the merged homogeneous form (:mod:`kalmanscan.model.merged`; every token, the first
included, applies predict then update, so rank 0's summary follows the initial state ``lam = 1,
eta = 0``), one ``all_gather`` exchanges the ``(B, M, S)`` summaries, and each rank runs
``kla_scan`` on its tokens from its incoming state (``initial_state``).

:func:`sequence_parallel` runs a model's KLA layers that way (plus the halo of the causal conv:
the last ``d_conv - 1`` pre-conv inputs of the previous rank), so a
:class:`~kalmanscan.nn.SequenceModel` trains with the sequence split across ranks.
"""

from __future__ import annotations

import contextlib
import importlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING


import torch
import torch.distributed as dist
import torch.nn.functional as F

from kalmanscan.model import merged
from kalmanscan.distributed import summaries
from kalmanscan.distributed.comm import agree, all_gather, fingerprint, rank_world, tie

if TYPE_CHECKING:
    from torch import nn

    from kalmanscan.ops.kla import FilterState


__all__ = ["kla_scan", "sequence_parallel", "reduce_gradients"]



def kla_scan(v: torch.Tensor, lam_v: torch.Tensor, k: torch.Tensor, q: torch.Tensor, decay: torch.Tensor,
             noise: torch.Tensor, *, initial_state: FilterState | None = None, group: dist.ProcessGroup | None = None,
             backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """KLA scan over tokens split along ``L`` across the ranks of ``group``; a collective call.

    Shapes as :func:`kalmanscan.nn.kla_scan` for this rank's tokens: ``v, lam_v`` ``(B, L_local,
    M)``, ``k, q`` ``(B, L_local, S)``; ``decay, noise`` ``(M, S)`` the same on every rank. ``B, M,
    S`` must agree across ranks, ``L_local >= 1`` may differ. ``initial_state`` ``(lam, eta)``
    (each ``(B, M, S)``) is the state before the sequence's first token, read on rank 0 only
    (default ``lam = 1, eta = 0``). ``backend`` is passed to the local ``kla_scan``.

    Returns ``(y, y_var)`` ``(B, L_local, M)``, equal to rounding to the same tokens of
    ``kla_scan`` on the whole sequence. Differentiable; gradients of ``decay`` and ``noise`` are
    this rank's share (sum them over ranks, e.g. with :func:`reduce_gradients`).

    Forward: summaries (no gradient) from the fused piece-map kernel with the triton backend, or a
    torch product in chunks; one ``all_gather`` of ``7 B M S`` numbers per rank (plus 4 float64 of
    agreement); the local scan from the incoming state.

    Backward (no gradient through the summaries): the carry into rank ``r + 1`` is rank ``r``'s
    final state, so the adjoints ``g_r`` of the carries follow ``g_r = l_r + J_r^T g_{r+1}``, with
    ``l_r`` the gradient of rank ``r``'s own outputs with respect to its carry (one local
    backward) and ``J_r`` the Jacobian of its map at its carry, read from its summary:
    ``d lam'/d lam = f^2``, ``d eta'/d eta = f`` with ``f = G / (C lam + D)`` the product of the
    forget gates (a ratio of positive numbers: no cancellation), ``d eta'/d lam = (E - C eta') /
    (C lam + D)``. One ``all_gather`` of those 5 numbers per filter (``5 B M S`` per rank), an
    exclusive suffix over ranks, and a second local backward with the final-state cotangent
    ``g_{r+1}``.
    """
    from kalmanscan.ops.kla import validate

    rank, world = rank_world(group)

    def check():
        validate(v, lam_v, k, q, decay, noise, initial_state if rank == 0 else None, backend)

    init = tuple(initial_state) if initial_state is not None and rank == 0 else (None, None)
    tensors = [x for x in (v, lam_v, k, q, decay, noise, *init) if x is not None]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    shapes = fingerprint(v.shape[0], v.shape[2], k.shape[2])
    dtypes = fingerprint(*(t.dtype for t in tensors))
    _, infos = agree(check, lambda _: [grad, shapes, dtypes], 3, v.device, group)
    if not bool((infos[:, 1] == infos[0, 1]).all()):
        raise ValueError("v, k: B, M and S must be the same on every rank")
    if not bool((infos[:, 2] == infos[0, 2]).all()):
        raise ValueError("v, lam_v, k, q, decay, noise: the dtypes must be the same on every rank")
    setup = _Setup(group, backend, rank, world)
    if not bool(infos[:, 0].any()):
        own, carry = _exchange(setup, v, lam_v, k, q, decay, noise, *init)
        state = (carry if rank > 0 else (None if initial_state is None else init))
        y, y_var, _ = _local(setup, v, lam_v, k, q, decay, noise, state)
        return y, y_var
    anchor = torch.zeros((), device=v.device, requires_grad=True)  # records the backward on every rank
    return _ContextScan.apply(setup, anchor, v, lam_v, k, q, decay, noise, *init)


class _Setup:
    """The non-tensor arguments of :class:`_ContextScan`."""

    def __init__(self, group, backend, rank, world):
        self.group, self.backend, self.rank, self.world = group, backend, rank, world


def _local(setup, v, lam_v, k, q, decay, noise, state):
    """The local ``kla_scan`` from ``state``, returning ``(y, y_var, (lam, eta))``."""
    from kalmanscan.ops.kla import kla_scan as local_scan

    return local_scan(v, lam_v, k, q, decay, noise, initial_state=state, return_state=True,
                      backend=setup.backend)


def _exchange(setup, v, lam_v, k, q, decay, noise, lam0, eta0):
    """Summaries and their exchange, without gradient: ``(own, carry)``, this rank's summary (7
    tensors ``(B, M, S)``; ``None`` on the last rank, which computes none) and its incoming state
    (``None`` on rank 0)."""
    from kalmanscan.ops.kla import compute_dtype

    rank, world = setup.rank, setup.world
    dtype = compute_dtype(v, lam_v, k, q, decay, noise)
    B, _, M = v.shape
    S = k.shape[-1]
    with torch.no_grad():
        own = None
        if rank == world - 1:
            local = torch.zeros(7, B, M, S, dtype=dtype, device=v.device)
        else:
            fused = setup.backend == "triton" or setup.backend == "auto" and v.is_cuda
            backend = importlib.import_module(f"kalmanscan.ops.kla.{'triton' if fused else 'torch'}")
            own = backend.summary(v, lam_v, k, q, decay, noise, dtype)
            local = own
            if rank == 0:
                lam0 = torch.ones(B, M, S, dtype=dtype, device=v.device) if lam0 is None else lam0.to(dtype)
                eta0 = torch.zeros_like(lam0) if eta0 is None else eta0.to(dtype)
                local = merged.compose(merged.initial(lam0, eta0), own)
            local = torch.stack(local)
        gathered = all_gather(local, setup.group)
        carry = None if rank == 0 else summaries.incoming(gathered, rank)
    return own, carry


class _ContextScan(torch.autograd.Function):
    """``(v, lam_v, k, q, decay, noise, lam0, eta0) -> (y, y_var)`` with the backward exchange
    described in :func:`kla_scan` (the local scan's graph is kept for two backward passes)."""

    @staticmethod
    def forward(ctx, setup, anchor, v, lam_v, k, q, decay, noise, lam0, eta0):
        own, carry = _exchange(setup, v, lam_v, k, q, decay, noise, lam0, eta0)
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_(x.requires_grad) for x in (v, lam_v, k, q, decay, noise)]
            if setup.rank > 0:
                state = tuple(x.detach().requires_grad_() for x in carry)
            else:
                state = None if lam0 is None else tuple(
                    x.detach().requires_grad_(x.requires_grad) for x in (lam0, eta0))
            y, y_var, final = _local(setup, *inputs, state)
        ctx.setup, ctx.own, ctx.carry = setup, own, carry
        ctx.graph = (inputs, state, y, y_var, final)
        return y.detach(), y_var.detach()

    @staticmethod
    def backward(ctx, gy, gy_var):
        setup = ctx.setup
        rank, world = setup.rank, setup.world
        inputs, state, y, y_var, final = ctx.graph
        del ctx.graph
        leaves = inputs + ([] if state is None else list(state))
        wanted = [x for x in leaves if x.requires_grad]
        grads = {}
        if wanted:
            grads = dict(zip(map(id, wanted), torch.autograd.grad(
                (y, y_var), wanted, (gy, gy_var), retain_graph=rank < world - 1, allow_unused=True)))
        lam_T = final[0]
        zeros = torch.zeros_like(lam_T)
        local_adjoint = [zeros, zeros]
        if rank > 0:
            local_adjoint = [zeros if grads.get(id(x)) is None else grads[id(x)].to(lam_T.dtype) for x in state]
        jacobian = [zeros, zeros, zeros]
        if 0 < rank < world - 1:
            jacobian = _jacobian(ctx.own, ctx.carry, lam_T.dtype)
        pack = torch.stack(local_adjoint + jacobian)
        gathered = all_gather(pack, setup.group)
        if rank < world - 1 and wanted:
            g_lam, g_eta = gathered[world - 1, 0], gathered[world - 1, 1]
            for j in range(world - 2, rank, -1):
                l_lam, l_eta, j_ll, j_el, j_ee = gathered[j]
                g_lam, g_eta = l_lam + j_ll * g_lam + j_el * g_eta, l_eta + j_ee * g_eta
            more = torch.autograd.grad(final, wanted, (g_lam.to(final[0].dtype), g_eta.to(final[1].dtype)),
                                       allow_unused=True)
            for x, g in zip(wanted, more):
                if g is not None:
                    grads[id(x)] = g if grads.get(id(x)) is None else grads[id(x)] + g
        out = [grads.get(id(x)) for x in inputs]
        init = [None, None]
        if rank == 0 and state is not None:
            init = [grads.get(id(x)) for x in state]
        return (None, None, *out, *init)


def _jacobian(own, carry, dtype):
    """``[d lam'/d lam, d eta'/d lam, d eta'/d eta]`` of the map ``own`` at ``carry = (lam, eta)``."""
    A, B, C, D, E, F, G = (x.to(torch.float64) for x in own)
    lam, eta = (x.to(torch.float64) for x in carry)
    den = C * lam + D
    forget = G / den
    eta_out = (E * lam + F + G * eta) / den
    return [(forget * forget).to(dtype), ((E - C * eta_out) / den).to(dtype), forget.to(dtype)]


def _halo(layer, z, grad: bool, group):
    """The pre-conv window entering this rank (the previous rank's last ``d_conv - 1`` inputs, in
    the layout of the layer's recurrent state; zeros on rank 0), and the gathered tensor."""
    from kalmanscan.nn.common import causal_conv

    rank, _ = rank_world(group)
    width = layer.d_conv - 1
    zeros = layer.init_state(z.shape[0], device=z.device).conv.to(z.dtype)
    _, tail = causal_conv(z[:, z.shape[1] - width:], zeros, layer.conv)
    if grad and not tail.requires_grad:
        tail = tail.detach().requires_grad_()
    gathered = all_gather(tail, group)
    return (zeros if rank == 0 else gathered[rank - 1]), gathered


def _forward(layer, x, state=None, return_variance=False, *, group=None):
    """:meth:`kalmanscan.nn.KLA.forward` for this rank's tokens of a sequence split across ranks."""
    from kalmanscan.nn.common import causal_conv

    def check():
        if state is not None:
            raise ValueError("state: a sequence-parallel KLA layer runs whole sequences, without a state")
        layer.check_input(x, 3, "x")
        if x.shape[1] < layer.d_conv - 1:
            raise ValueError(f"x: sequence-parallel KLA needs at least d_conv - 1 = {layer.d_conv - 1} "
                             f"tokens per rank, got {x.shape[1]}")

    grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters()))
    _, infos = agree(check, lambda _: [grad, fingerprint(x.shape[0], x.shape[2:], x.dtype)], 2, x.device, group)
    if not bool((infos[:, 1] == infos[0, 1]).all()):
        raise ValueError("x: the batch size, d_model and dtype must be the same on every rank")
    z, gate = layer.in_proj(x).chunk(2, -1)
    window, halo = _halo(layer, z, bool(infos[:, 0].any()), group)
    z, _ = causal_conv(z, window, layer.conv)
    z = F.silu(z)
    v, lam_v, k, q = layer.sensors(z)
    if halo.requires_grad:
        v = v if v.requires_grad else v.detach().requires_grad_()
        v = tie(halo, {"v": v})["v"]
    decay, noise = layer.discretized()
    with torch.autocast(x.device.type, enabled=False):
        y, y_var = kla_scan(v, lam_v, k, q, decay.to(v.dtype), noise.to(v.dtype), group=group,
                            backend=layer.backend)
    out = layer.read_out(y, y_var, z, gate, return_variance)
    return out if len(out) > 1 else out[0]


@contextlib.contextmanager
def sequence_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run ``model``'s KLA layers over a sequence split along time across ``group``'s ranks.

        with ks.distributed.sequence_parallel(model, group):
            logits = model(tokens_local)            # (B, L_local): this rank's stretch
        loss.backward()                             # on every rank
        ks.distributed.reduce_gradients(model, group)

    Inside the block, every :class:`~kalmanscan.nn.KLA` module of ``model`` exchanges the causal
    conv's halo (``d_conv - 1`` inputs) and the scan summaries (:func:`kla_scan`) with the other
    ranks; everything else in a :class:`~kalmanscan.nn.SequenceModel` is per token. The logits
    equal the same positions of the single-process model on the whole sequence (to rounding).
    Every rank must pass the same batch size and ``L_local >= d_conv - 1``. Raises ``ValueError``
    for models with other sequence mixers (attention, gla, mamba), which need their own scheme.
    Per KLA layer and call: one agreement all-gather (3 float64), the halo (``B (d_conv - 1) M``
    numbers) and :func:`kla_scan`'s exchange.
    The modules are restored on exit; backward may run after the block.
    """
    from kalmanscan.nn.layer import KLA, forward_with
    from kalmanscan.nn.mixers import MIXERS

    rank_world(group)
    others = [type(m).__name__ for m in model.modules()
              if type(m) in MIXERS.values() and not isinstance(m, KLA)]
    if others:
        raise ValueError(f"model: mixers {sorted(set(others))} cannot run sequence-parallel; only KLA can")
    layers = [m for m in model.modules() if isinstance(m, KLA)]
    with forward_with(functools.partial(_forward, group=group), layers):
        yield model


def reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of ``model``'s trainable parameters over the ranks of ``group``.

    With the sequence split across ranks each rank's backward gives its share of the gradient of
    the summed loss; after this call every rank holds the whole-sequence gradient. One
    ``all_reduce`` per dtype of a flat buffer (a missing ``.grad`` counts as zero and is created).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for dtype in sorted({p.dtype for p in params}, key=str):
        group_params = [p for p in params if p.dtype == dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in group_params])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in group_params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
