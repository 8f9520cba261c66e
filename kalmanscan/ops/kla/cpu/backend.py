"""The ``"cpu"`` backend of :func:`kalmanscan.ops.kla.kla_scan`: compiled loops over time,
parallel over batch rows and blocks of channels (:mod:`kalmanscan.ops.kla.cpu.loops`, in numba).

Per token the ``B M S`` filters take one step each in mean form (``var``, ``mu``, the form of the
``"recurrent"`` backend, exact at every length, ``noise = 0`` included), so the work is that of
the sequential recursion, without the time-parallel scan's extra arithmetic and intermediates or
the per-token overhead of a loop of torch operations. Under autograd the forward keeps the state at
the start of every :data:`CHUNK` tokens (``2 B M S ceil(L / CHUNK)`` numbers); the backward
recomputes each chunk from it and runs the exact reverse recursion of the scalar adjoints:
gradients for ``v, lam_v, k, q, decay, noise`` and the initial state (first derivatives only: the
backward is a compiled loop and not itself differentiable).

Both directions are ``torch.library`` operators (``kalmanscan::kla_scan_cpu``,
``kalmanscan::kla_scan_cpu_backward``) with fake implementations, so ``torch.compile`` traces a
model through them. Arithmetic is in the compute dtype (:func:`kalmanscan.ops.kla.compute_dtype`:
float64 if any input is, else float32); numba compiles each loop on its first call per dtype
(seconds) and caches it on disk. Threads: numba's (``numba.set_num_threads``); results do not
depend on the thread count.
"""

from __future__ import annotations

import torch

from kalmanscan.ops.cpu_threads import run_loop
from kalmanscan.ops.kla.documents import boundaries, nonempty
from kalmanscan.ops.kla.state import FilterState, prepare

__all__ = ["kla_scan", "kla_scan_cpu", "kla_scan_cpu_backward", "CHUNK"]

CHUNK = 64  # tokens between the forward's checkpoints (the backward's recomputed stretch)

Tensor = torch.Tensor


def _loops():
    """The compiled loops' module (imports numba on the first call)."""
    from kalmanscan.ops.kla.cpu import loops as cpu_loops

    return cpu_loops


def _np(*xs: Tensor):
    """Zero-copy NumPy views of CPU tensors (the operators run below autograd)."""
    return tuple(x.detach().numpy() for x in xs)


def _one_dtype(*xs: Tensor) -> None:
    """The loops compile per dtype and compute in their inputs' one dtype: refuse a mixture."""
    dtypes = {x.dtype for x in xs}
    if len(dtypes) != 1 or xs[0].dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the cpu KLA operators take float32 or float64 tensors of one dtype, got {dtypes}")


def _blocks(M: int) -> int:
    return -(-M // _loops().BLOCK)


@torch.library.custom_op("kalmanscan::kla_scan_cpu", mutates_args=(), device_types="cpu")
def kla_scan_cpu(v: Tensor, lam_v: Tensor, k: Tensor, q: Tensor, decay: Tensor, noise: Tensor, var0: Tensor,
                 mu0: Tensor, save: bool, starts: Tensor, ends: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, y_var, var, mu, ckpt_var, ckpt_mu)`` from inputs in one dtype (float32 or float64):
    ``v``, ``lam_v`` ``(B, L, M)``; ``k``, ``q`` ``(B, L, S)``; ``decay``, ``noise`` ``(M, S)``;
    the initial variance and mean ``var0``, ``mu0`` ``(B, M, S)``. The checkpoints are
    ``(B, ceil(L / CHUNK), S, M)`` with ``save``, else ``(0, 0, S, M)``. Packed documents: int32
    ``starts``, ``ends`` ``(L,)`` (:func:`kalmanscan.ops.kla.documents.boundaries`, else empty),
    ``B = 1``, ``var0``, ``mu0`` and the final state ``(N, M, S)``; an empty document's final row
    is left unwritten (the caller puts its initial state there)."""
    _one_dtype(v, lam_v, k, q, decay, noise, var0, mu0)
    loops = _loops()
    v, lam_v, k, q, decay, noise, var0, mu0 = (x.contiguous() for x in (v, lam_v, k, q, decay, noise, var0, mu0))
    B, L, M = v.shape
    S = k.shape[-1]
    y, y_var = torch.empty_like(v), torch.empty_like(v)
    var, mu = torch.empty_like(var0), torch.empty_like(var0)
    shape = (B, -(-L // CHUNK), S, M) if save else (0, 0, S, M)
    ckpt = [v.new_empty(shape) for _ in range(2)]
    run_loop(loops.forward, B * _blocks(M), B * L * M * S, *_np(v, lam_v, k, q, decay, noise, var0, mu0, y, y_var,
                                                              var, mu, *ckpt, starts, ends),
             CHUNK, loops.constants(_np(v)[0].dtype))
    return y, y_var, var, mu, ckpt[0], ckpt[1]


@kla_scan_cpu.register_fake
def _(v, lam_v, k, q, decay, noise, var0, mu0, save, starts, ends):
    B, L, M = v.shape
    S = k.shape[-1]
    shape = (B, (L + CHUNK - 1) // CHUNK, S, M) if save else (0, 0, S, M)
    return (v.new_empty(B, L, M), v.new_empty(B, L, M), var0.new_empty(var0.shape), var0.new_empty(var0.shape),
            v.new_empty(shape), v.new_empty(shape))


@torch.library.custom_op("kalmanscan::kla_scan_cpu_backward", mutates_args=(), device_types="cpu")
def kla_scan_cpu_backward(v: Tensor, lam_v: Tensor, k: Tensor, q: Tensor, decay: Tensor, noise: Tensor,
                          ckpt_var: Tensor, ckpt_mu: Tensor, gy: Tensor, gy_var: Tensor, g_var: Tensor,
                          g_mu: Tensor, var0: Tensor, mu0: Tensor, starts: Tensor, ends: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(v, lam_v, k, q, decay, noise, var0, mu0)`` of :func:`kla_scan_cpu` (run with
    ``save``) from the cotangents of ``y``, ``y_var``, ``var``, ``mu``, in the inputs' dtype
    (packed documents: the forward's ``var0``, ``mu0``, ``starts``, ``ends``; an empty document's
    initial-state gradient is 0 here)."""
    _one_dtype(v, lam_v, k, q, decay, noise, ckpt_var, ckpt_mu, gy, gy_var, g_var, g_mu, var0, mu0)
    loops = _loops()
    v, lam_v, k, q, decay, noise, gy, gy_var, g_var, g_mu, var0, mu0 = (
        x.contiguous() for x in (v, lam_v, k, q, decay, noise, gy, gy_var, g_var, g_mu, var0, mu0))
    B, L, M = v.shape
    S = k.shape[-1]
    nb = _blocks(M)
    gv, glam_v = torch.empty_like(v), torch.empty_like(v)
    gk_part, gq_part = (v.new_empty(B, nb, L, S) for _ in range(2))
    gdecay, gnoise = (v.new_empty(B, M, S) for _ in range(2))
    gvar0, gmu0 = (v.new_zeros(var0.shape) for _ in range(2))
    run_loop(loops.backward, B * nb, B * L * M * S, *_np(v, lam_v, k, q, decay, noise, ckpt_var, ckpt_mu, gy, gy_var,
                                                        g_var, g_mu, gv, glam_v, gk_part, gq_part, gdecay, gnoise,
                                                        gvar0, gmu0, var0, mu0, starts, ends),
             CHUNK, loops.constants(_np(v)[0].dtype))
    return gv, glam_v, gk_part.sum(1), gq_part.sum(1), gdecay.sum(0), gnoise.sum(0), gvar0, gmu0


@kla_scan_cpu_backward.register_fake
def _(v, lam_v, k, q, decay, noise, ckpt_var, ckpt_mu, gy, gy_var, g_var, g_mu, var0, mu0, starts, ends):
    # contiguous, as the operator returns them (empty_like would keep a strided input's strides)
    return (v.new_empty(v.shape), v.new_empty(v.shape), k.new_empty(k.shape), q.new_empty(q.shape),
            decay.new_empty(decay.shape), noise.new_empty(noise.shape), var0.new_empty(var0.shape),
            mu0.new_empty(mu0.shape))


def _setup_context(ctx, inputs, output):
    v, lam_v, k, q, decay, noise, var0, mu0, save, starts, ends = inputs
    ctx.save_for_backward(v, lam_v, k, q, decay, noise, output[4], output[5], var0, mu0, starts, ends)
    ctx.save = save


def _backward(ctx, gy, gy_var, g_var, g_mu, _g_ckpt_var, _g_ckpt_mu):
    if not ctx.save:
        raise RuntimeError("kla_scan_cpu ran with save=False: it kept no checkpoints for a backward")
    v, lam_v, k, q, decay, noise, ckpt_var, ckpt_mu, var0, mu0, starts, ends = ctx.saved_tensors
    gy, gy_var = (torch.zeros_like(v) if g is None else g for g in (gy, gy_var))
    g_var, g_mu = (torch.zeros_like(var0) if g is None else g for g in (g_var, g_mu))
    grads = kla_scan_cpu_backward(v, lam_v, k, q, decay, noise, ckpt_var, ckpt_mu, gy, gy_var, g_var, g_mu,
                                  var0, mu0, starts, ends)
    return grads + (None, None, None)


torch.library.register_autograd("kalmanscan::kla_scan_cpu", _backward, setup_context=_setup_context)


def _no_second_derivatives(ctx, *grads):
    raise RuntimeError("backend='cpu' of the KLA scan computes first derivatives only (its backward is a "
                       "compiled loop); use backend='recurrent' for second derivatives (create_graph=True)")


torch.library.register_autograd("kalmanscan::kla_scan_cpu_backward", _no_second_derivatives)


def kla_scan(v: Tensor, lam_v: Tensor, k: Tensor, q: Tensor, decay: Tensor, noise: Tensor,
             initial_state: FilterState | None = None,
             cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor, FilterState]:
    """``(y, y_var, state)``: the signature every KLA backend shares, in the compute dtype; the
    state a :class:`FilterState` made from its variance and mean. CPU tensors only
    (:func:`kalmanscan.ops.kla.check_shapes` says so for a call through the dispatch). With
    ``cu_seqlens`` (:mod:`kalmanscan.ops.kla.documents`) the loops reset the state at each
    document's start and the state has one row per document."""
    rows = None if cu_seqlens is None else cu_seqlens.numel() - 1
    v, lam_v, k, q, decay, noise, state = prepare(v, lam_v, k, q, decay, noise, initial_state, rows)
    if v.shape[1] == 0:
        return v.new_zeros(v.shape), v.new_zeros(v.shape), state
    save = torch.is_grad_enabled() and any(
        x.requires_grad for x in (v, lam_v, k, q, decay, noise, state.var, state.mu))
    if cu_seqlens is None:
        starts = ends = torch.empty(0, dtype=torch.int32)
    else:
        starts, ends = boundaries(cu_seqlens, v.shape[1])
    y, y_var, var, mu, _, _ = kla_scan_cpu(v, lam_v, k, q, decay, noise, state.var, state.mu, save, starts, ends)
    if cu_seqlens is not None:
        kept = nonempty(cu_seqlens).view(-1, 1, 1)
        var, mu = torch.where(kept, var, state.var), torch.where(kept, mu, state.mu)
    return y, y_var, FilterState.from_moments(var, mu)
