"""Rauch–Tung–Striebel smoothing over the filter's outputs: fused reverse walks.

Lanes and stretches are those of :mod:`kalmanscan.kernels.filter.steps`. With ``mu_t = mean_t - m_t`` (the
filtered centred mean; ``m`` the model's mean parameter) and the next step's transition and
prediction, step ``t`` of the smoother is the pair of affine maps

    x_t = J_t x_{t+1} + k_t mu_t,     r_t = c_t g_{t+1} r_{t+1} + k_t

with ``J_t = a_{t+1} var_t / pv_{t+1}`` (``1 / a_{t+1}`` where ``q_{t+1} = 0``), ``k_t = q_{t+1} /
pv_{t+1} = 1 - a_{t+1} J_t``, ``c_t = a_{t+1} J_t`` (1 where ``q_{t+1} = 0``) and ``g_{t+1} =
var_{t+1} / pv_{t+1}``: the mean's map is the textbook ``mu_t + J_t (x_{t+1} - a_{t+1} mu_t)`` with
the prediction cancelled exactly (non-negative coefficients; the predicted mean is not read), and
``r_t = var_s_t / var_t`` is the smoothed variance as a ratio
(:func:`kalmanscan.ops.filter.torch.smooth`; gains and offsets in ``[0, 1]``), and ``var_t r_t``
is stored. A predicted variance below the normal range is read as its limit 0
(:func:`kalmanscan.ops.filter.torch.rts_gains`: ``J = 0``, the mean's offset ``mu_t``, ``c = 1``
where ``a > 0`` else 0, ``k = 1 - c``, ``g = 1``). The last step is the constant ``(mu_{T-1}, 1)``
and steps past ``T`` are the identity. As the maps act on the pair ``(x, r)`` with a diagonal
matrix ``diag(J, c g)``, they are the five-number affine maps of
:mod:`kalmanscan.kernels.filter.bwd` with a zero corner, and time splits the same way:

1. :func:`rts_agg_kernel` walks each stretch backwards and writes its composed map
   ``agg[b, 0..4, s, c] = (P, 0, P_v, B, B_v)``;
2. :func:`kalmanscan.kernels.filter.bwd.filter_bwd_carry_kernel` scans them from the last stretch to the
   first, giving the smoothed pair entering each stretch from above;
3. :func:`rts_kernel` walks each stretch backwards from there and writes the smoothed mean
   ``x_t + m_t``, variance ``var_t r_t`` and precision ``1 / (var_t r_t)``.

Every term of the variance recursion is non-negative (no cancellation), and no product of
variances or of ``J^2`` (``1 / a^2`` without process noise) is formed. Arithmetic in the
pointers' dtype.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.filter.steps import index, lane_coords, load_param


@triton.jit
def rts_step(t, lane_ok, b, c, T, mean_ptr, smu_b, smu_t, smu_c, var_ptr, svr_b, svr_t, svr_c,
             pmean_ptr, spm_b, spm_t, spm_c, pvar_ptr, spv_b, spv_t, spv_c,
             decay_ptr, sdc_b, sdc_t, sdc_c, noise_ptr, snz_b, snz_t, snz_c, m_ptr, sm_b, sm_t, sm_c):
    """``(J, bm, G, K, var_t, m_t, mean_t, valid)`` of step ``t``: the maps ``x -> J x + bm``,
    ``r -> G r + K`` (constant at ``T - 1``, identity past ``T``), the filtered variance, the mean
    parameter and the filtered mean at ``t``. The predicted mean (``pmean_ptr``, a field of the
    backends' ``smooth`` contract) is not read: the mean's map cancels the prediction exactly."""
    valid = lane_ok & (t < T)
    inner = lane_ok & (t < T - 1)
    m_t = load_param(m_ptr, b, t, c, sm_b, sm_t, sm_c, valid, 0.0)
    mean_t = load_param(mean_ptr, b, t, c, smu_b, smu_t, smu_c, valid, 0.0)
    mu = mean_t - m_t
    var = load_param(var_ptr, b, t, c, svr_b, svr_t, svr_c, valid, 0.0)
    var_next = load_param(var_ptr, b, t + 1, c, svr_b, svr_t, svr_c, inner, 0.0)
    a = load_param(decay_ptr, b, t + 1, c, sdc_b, sdc_t, sdc_c, inner, 0.0)
    q = load_param(noise_ptr, b, t + 1, c, snz_b, snz_t, snz_c, inner, 0.0)
    pv = load_param(pvar_ptr, b, t + 1, c, spv_b, spv_t, spv_c, inner, 1.0)
    known = pv >= smallest_normal(pv)
    noisy = known & (q > 0.0)
    ipv = rcp(tl.where(known, pv, 1.0))
    J = tl.where(noisy, a * (var * ipv), tl.where(known, rcp(tl.where(noisy | ~known, 1.0, a)), 0.0))
    k = tl.where(known, q * ipv, tl.where(a > 0.0, 0.0, 1.0))
    G = tl.where(noisy, a * J, 1.0 - k) * tl.where(known, var_next * ipv, 1.0)
    J = tl.where(inner, J, tl.where(valid, 0.0, 1.0))
    bm = tl.where(inner, tl.where(known, k, 1.0) * mu, tl.where(valid, mu, 0.0))
    G = tl.where(inner, G, tl.where(valid, 0.0, 1.0))
    K = tl.where(inner, k, tl.where(valid, 1.0, 0.0))
    return J, bm, G, K, var, m_t, mean_t, valid


@triton.jit
def smallest_normal(x):
    """The smallest normal number of ``x``'s dtype (float32 or float64), as ``x``."""
    if x.dtype == tl.float32:
        tiny = 1.1754943508222875e-38
    else:
        tiny = 2.2250738585072014e-308
    return tl.full(x.shape, tiny, x.dtype)


@triton.jit
def rts_agg_kernel(
    mean_ptr, smu_b, smu_t, smu_c, var_ptr, svr_b, svr_t, svr_c, pmean_ptr, spm_b, spm_t, spm_c,
    pvar_ptr, spv_b, spv_t, spv_c, decay_ptr, sdc_b, sdc_t, sdc_c, noise_ptr, snz_b, snz_t, snz_c,
    m_ptr, sm_b, sm_t, sm_c,
    agg_ptr, T, C, NS, L, BLOCK: tl.constexpr, WIDE: tl.constexpr,
):
    """Each lane's stretch map ``(P, 0, P_v, B, B_v)`` into ``agg[b, k, s, c]``: the pair at the
    stretch's first step is ``(P x + B, P_v v + B_v)`` of the pair ``(x, v)`` entering from above."""
    b = index(tl.program_id(1), WIDE)
    g, lane_ok, s, c = lane_coords(C, NS, BLOCK)
    t0 = index(s, WIDE) * L
    one = tl.full((BLOCK,), 1.0, agg_ptr.dtype.element_ty)
    zero = tl.zeros((BLOCK,), agg_ptr.dtype.element_ty)
    P, Pv, B, Bv = one, one, zero, zero
    for k in range(0, L):
        J, bm, G, K, _, m_t, _, valid = rts_step(
            t0 + L - 1 - k, lane_ok, b, c, T, mean_ptr, smu_b, smu_t, smu_c, var_ptr, svr_b, svr_t, svr_c,
            pmean_ptr, spm_b, spm_t, spm_c, pvar_ptr, spv_b, spv_t, spv_c,
            decay_ptr, sdc_b, sdc_t, sdc_c, noise_ptr, snz_b, snz_t, snz_c, m_ptr, sm_b, sm_t, sm_c)
        P, B, Pv, Bv = J * P, J * B + bm, G * Pv, G * Bv + K
    base = agg_ptr + b * 5 * NS * C + g
    stride = NS * C
    tl.store(base, P, mask=lane_ok)
    tl.store(base + stride, zero, mask=lane_ok)
    tl.store(base + 2 * stride, Pv, mask=lane_ok)
    tl.store(base + 3 * stride, B, mask=lane_ok)
    tl.store(base + 4 * stride, Bv, mask=lane_ok)


@triton.jit
def rts_kernel(
    mean_ptr, smu_b, smu_t, smu_c, var_ptr, svr_b, svr_t, svr_c, pmean_ptr, spm_b, spm_t, spm_c,
    pvar_ptr, spv_b, spv_t, spv_c, decay_ptr, sdc_b, sdc_t, sdc_c, noise_ptr, snz_b, snz_t, snz_c,
    m_ptr, sm_b, sm_t, sm_c,
    top_ptr, mean_s_ptr, var_s_ptr, prec_s_ptr, T, C, NS, L, BLOCK: tl.constexpr, WIDE: tl.constexpr,
):
    """Walk each stretch backwards from ``top[b, 0/1, s, c]`` (the smoothed centred mean and
    variance ratio entering from above) and write the smoothed ``mean, var, precision`` ``(B, T, C)``."""
    b = index(tl.program_id(1), WIDE)
    g, lane_ok, s, c = lane_coords(C, NS, BLOCK)
    t0 = index(s, WIDE) * L
    tbase = top_ptr + b * 2 * NS * C + g
    x = tl.load(tbase, mask=lane_ok, other=0.0)
    r = tl.load(tbase + NS * C, mask=lane_ok, other=0.0)
    out = b * T * C + c
    for k in range(0, L):
        t = t0 + L - 1 - k
        J, bm, G, K, var, m_t, mean_t, valid = rts_step(
            t, lane_ok, b, c, T, mean_ptr, smu_b, smu_t, smu_c, var_ptr, svr_b, svr_t, svr_c,
            pmean_ptr, spm_b, spm_t, spm_c, pvar_ptr, spv_b, spv_t, spv_c,
            decay_ptr, sdc_b, sdc_t, sdc_c, noise_ptr, snz_b, snz_t, snz_c, m_ptr, sm_b, sm_t, sm_c)
        x = J * x + bm
        r = G * r + K
        v = var * r
        o = out + t * C
        # at the last step the smoothed mean is the filtered one, stored as it is (x + m_t would
        # round the centring back and forth)
        tl.store(mean_s_ptr + o, tl.where(t == T - 1, mean_t, x + m_t), mask=valid)
        tl.store(var_s_ptr + o, v, mask=valid)
        tl.store(prec_s_ptr + o, 1.0 / tl.where(valid, v, 1.0), mask=valid)
