"""The hardware reciprocal and logarithm for the kernels (``@triton.jit``).

Triton lowers a float32 ``1.0 / x`` to ``div.full.f32``: the hardware reciprocal (``MUFU.RCP``)
wrapped in range checks and rescalings, about six instructions. ``rcp`` is the bare instruction
(``rcp.approx.ftz.f32``: at most one ulp off; inputs beyond ``2^126`` give 0 and subnormal ones
inf, values the kernels never divide by). Float64 keeps the exact division (the hardware's
float64 reciprocal has about half the precision), as does everything under ``TRITON_INTERPRET=1``
(the CPU tests).

``tl.log`` of a float32 lowers to libdevice's ``logf``, about twenty instructions. ``log`` is the
hardware base-2 logarithm (``lg2.approx.ftz.f32``, ``MUFU.LG2``: absolute error at most ``2^-22``
in ``[0.5, 2]``, relative ``2^-22`` elsewhere) times ``ln 2``; subnormal inputs give ``-inf``, which
the kernels never take the logarithm of.
"""

import os

import triton
import triton.language as tl

FAST = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def rcp(x):
    """``1 / x`` elementwise: ``rcp.approx.ftz.f32`` for float32 on the GPU, else ``1.0 / x``."""
    if FAST and x.dtype == tl.float32:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        r = 1.0 / x
    return r


@triton.jit
def log(x):
    """``ln x`` elementwise: ``lg2.approx.ftz.f32`` times ``ln 2`` for float32 on the GPU, else
    ``tl.log``."""
    if FAST and x.dtype == tl.float32:
        r = 0.6931471805599453 * tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                                           dtype=tl.float32, is_pure=True, pack=1)
    else:
        r = tl.log(x)
    return r
