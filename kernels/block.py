"""The elementwise pieces of a :class:`kalmanscan.nn.SequenceModel` block for one decoding token
(``@triton.jit``; launched by :mod:`kalmanscan.ops.block`), each one launch instead of several.

:func:`add_rms_norm_kernel`: per row of ``N`` features, the residual sum and the next norm::

    s = x + y                        (rounded to s's dtype, as the model's residual stream is)
    h = s / sqrt(mean(s^2) + eps) * weight        (float32 arithmetic, rounded once to h's dtype)

(``HAS_Y=False``: the norm of ``x`` alone, ``s`` not written.)

:func:`silu_mul_kernel`: the SwiGLU product of the ``(B, 2 H)`` output of its input projection,
``out = SiLU(gate) * up`` with ``gate, up`` its halves (float32 arithmetic, rounded once).
"""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(
    # pointers: x, y, s, h (B, N) contiguous; weight (N,)
    x_ptr, y_ptr, weight_ptr, s_ptr, h_ptr,
    # dimensions, constants
    N, eps,
    # meta-parameters
    BLOCK: tl.constexpr, HAS_Y: tl.constexpr,
):
    row = tl.program_id(0) * N
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    s = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_Y:
        s += tl.load(y_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        s = s.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row + offs, s, mask=mask)
        s = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / N + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + row + offs, (s * rstd * weight).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(
    # pointers: the (B, 2 H) projection (row stride 2 H), the (B, H) product
    gate_up_ptr, out_ptr,
    # dimensions
    H,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    pid_b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    gate = tl.load(gate_up_ptr + pid_b * 2 * H + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + pid_b * 2 * H + H + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + pid_b * H + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
