"""One step of a stream for every series at once: :class:`kalmanscan.StreamFilter`'s update.

A stream of ``N`` independent series (``N = B C``) keeps its filtered belief ``(mean, var)``
per series; one new observation ``y`` per series arrives. :func:`stream_step_kernel` predicts
the belief through the stored static transition ``(decay, noise)`` and applies the step exactly
as the fused forward applies a chunk's first step to the belief :func:`kalmanscan.inference.stream.predict`
gives (``lam0 = 1 / pred_var``, ``eta0 = lam0 (decay (mean - level))``, then
:func:`~kalmanscan.kernels.filter.steps.emit_step` with no transition), so an update equals a
one-step ``ks.filter(..., state=)`` to rounding. One launch with few arguments: the point is the
host's cost of a call, not bandwidth (a step of 4096 series moves about 100 kB).

Layouts (all contiguous, the compute dtype): ``y (N,)`` (NaN: missing); ``state (2, N)`` mean
and variance before the step, ``new_state (2, N)`` after it; ``params (5, N)`` ``decay, noise,
obs_var, mean, h``; ``out (10, N)``: the fields of the ``POSTERIOR`` bit mask in the order of
:data:`kalmanscan.ops.filter.triton.POSTERIOR` (rows not in the mask are left unwritten).
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.filter.steps import emit_step, observation


@triton.jit
def stream_step_kernel(y_ptr, state_ptr, new_state_ptr, params_ptr, out_ptr, N,
                       POSTERIOR: tl.constexpr, BLOCK: tl.constexpr):
    """One predict-and-update step of ``N`` series; see the module docstring."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = o < N
    mean_prev = tl.load(state_ptr + o, mask=valid, other=0.0)
    var_prev = tl.load(state_ptr + N + o, mask=valid, other=1.0)
    decay = tl.load(params_ptr + o, mask=valid, other=1.0)
    noise = tl.load(params_ptr + N + o, mask=valid, other=0.0)
    obs_var = tl.load(params_ptr + 2 * N + o, mask=valid, other=1.0)
    mean = tl.load(params_ptr + 3 * N + o, mask=valid, other=0.0)
    h = tl.load(params_ptr + 4 * N + o, mask=valid, other=0.0)
    y = tl.load(y_ptr + o, mask=valid, other=float("nan"))
    lam0 = 1.0 / (decay * decay * var_prev + noise)
    eta0 = lam0 * (decay * (mean_prev - mean))
    observed, yc, hr, phi, info = observation(y, obs_var, mean, h)
    lam, eta, _ = emit_step(lam0, eta0, 1.0, 0.0, observed, yc, phi, info, obs_var, mean, h, o, valid,
                         out_ptr, out_ptr + N, out_ptr + 2 * N, out_ptr + 3 * N, out_ptr + 4 * N,
                         out_ptr + 5 * N, out_ptr + 6 * N, out_ptr + 7 * N, out_ptr + 8 * N, out_ptr + 9 * N,
                         False, False, False, POSTERIOR)
    var = rcp(lam)
    tl.store(new_state_ptr + o, eta * var + mean, mask=valid)
    tl.store(new_state_ptr + N + o, var, mask=valid)
