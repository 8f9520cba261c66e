"""Fused forward of the information-form filter: aggregate, carry and apply kernels.

Lanes and stretches are described in :mod:`kalmanscan.kernels.filter.steps`. With one stretch (many
channels) only :func:`filter_fwd_kernel` runs, from the initial state. With ``NS > 1`` stretches,
time is split across programs by the merged homogeneous form (docs/math.md, section 6): with
``lam = u / w0`` and ``eta = w / w0`` one step is the linear map

    [u, w0, w] <- [[A, B, 0], [C, D, 0], [info C, info D, decay]] [u, w0, w]

(``A, B, C, D = 1 + noise phi, decay^2 phi, noise, decay^2``: the Möbius entries of docs/math.md
§2). Products of such maps stay lower block-triangular: seven numbers
``(p11, p12, p21, p22, e1, e2, f)``. They do not depend on the state, so

1. :func:`filter_agg_kernel` walks every stretch and writes its product ``agg[b, k, s, c]`` (with
   static parameters a complete stretch sums its information in closed form instead:
   :mod:`kalmanscan.kernels.filter.walks_closed`);
2. :func:`filter_carry_kernel` scans the products over stretches (``tl.associative_scan``, never
   ``tl.reduce``: the combine is not commutative) and writes each stretch's starting state
   ``start[b, 0/1, s, c] = (lam, eta)``;
3. :func:`filter_fwd_kernel` walks every stretch again from its starting state with the plain
   recursion :func:`kalmanscan.kernels.filter.steps.info_step` and writes the outputs.

Numerics of the products: the 2x2 block has entries ``>= 0`` and a positive trace (it is a
product of Möbius leaves), and every product is divided by its 2x2 trace, so that block keeps
trace 1 and nothing over- or underflows; ``e1, e2, f`` are divided by the same positive number, so
the projective read-out ``lam = (p11 lam0 + p12) / w0``, ``eta = (e1 lam0 + e2 + f eta0) / w0``
with ``w0 = p21 lam0 + p22 > 0`` is unchanged. ``f`` (a product of decays over traces >= 1) may
underflow to 0: the initial ``eta0``'s share is then below the float range, as it is exactly.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.filter.steps import emit_step, lane_setup, pick, ring_start, step_inputs, walk_y
from kalmanscan.kernels.filter.walks_closed import closed_prefix


@triton.jit
def compose7(p11, p12, p21, p22, e1, e2, f, q11, q12, q21, q22, g1, g2, h):
    """``later @ earlier`` for lower block-triangular 3x3 maps (earlier ``p``, later ``q``), trace 1."""
    n11 = q11 * p11 + q12 * p21
    n12 = q11 * p12 + q12 * p22
    n21 = q21 * p11 + q22 * p21
    n22 = q21 * p12 + q22 * p22
    m1 = g1 * p11 + g2 * p21 + h * e1
    m2 = g1 * p12 + g2 * p22 + h * e2
    inv = rcp(n11 + n22)
    return n11 * inv, n12 * inv, n21 * inv, n22 * inv, m1 * inv, m2 * inv, h * f * inv


@triton.jit
def leaf7(decay, noise, phi, info):
    """One step's map in the merged form: ``(A, B, C, D, info C, info D, decay)`` (trace >= 1)."""
    a2 = decay * decay
    return 1.0 + noise * phi, a2 * phi, noise, a2, info * noise, info * a2, decay


@triton.jit
def step_after(p11, p12, p21, p22, e1, e2, f, decay, noise, phi, info):
    """One step's map composed after the product ``p``: :func:`compose7` of ``p`` and
    :func:`leaf7`, with the leaf's 2x2 block factored as the update ``[[1, phi], [0, 1]]`` after the
    prediction ``[[1, 0], [noise, decay^2]]`` (about a third fewer operations). A step with
    ``decay = 1, noise = phi = info = 0`` leaves ``p`` unchanged up to its scale."""
    a2 = decay * decay
    x21 = noise * p11 + a2 * p21
    x22 = noise * p12 + a2 * p22
    n11 = p11 + phi * x21
    n12 = p12 + phi * x22
    inv = rcp(n11 + x22)
    return (n11 * inv, n12 * inv, x21 * inv, x22 * inv, (info * x21 + decay * e1) * inv,
            (info * x22 + decay * e2) * inv, decay * f * inv)


@triton.jit
def read_out7(p11, p12, p21, p22, e1, e2, f, lam, eta):
    """The state after the product ``p`` from the state ``(lam, eta)`` before it: the projective
    read-out ``((p11 lam + p12) / w0, (e1 lam + e2 + f eta) / w0)``, ``w0 = p21 lam + p22``."""
    w0 = p21 * lam + p22
    return (p11 * lam + p12) / w0, (e1 * lam + e2 + f * eta) / w0


@triton.jit
def store7(ptr, stride, p11, p12, p21, p22, e1, e2, f, mask):
    """Store the 7 numbers of a map at ``ptr + k stride`` (``mask`` as :func:`tl.store`'s)."""
    tl.store(ptr, p11, mask=mask)
    tl.store(ptr + stride, p12, mask=mask)
    tl.store(ptr + 2 * stride, p21, mask=mask)
    tl.store(ptr + 3 * stride, p22, mask=mask)
    tl.store(ptr + 4 * stride, e1, mask=mask)
    tl.store(ptr + 5 * stride, e2, mask=mask)
    tl.store(ptr + 6 * stride, f, mask=mask)


@triton.jit
def last7(p11, p12, p21, p22, e1, e2, f, last):
    """The 7 numbers of a map at the lane where ``last`` is on, as scalars
    (:func:`kalmanscan.kernels.filter.steps.pick`)."""
    return (pick(p11, last), pick(p12, last), pick(p21, last), pick(p22, last), pick(e1, last),
            pick(e2, last), pick(f, last))


@triton.jit
def product_step(p11, p12, p21, p22, e1, e2, f, t, valid, b, c, y,
                 params, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr):
    """The product ``p`` with step ``t``'s map composed after it, from the step's observation ``y``;
    where ``valid`` is off (past the series) the step is the identity (``y`` is NaN there)."""
    decay, noise, observed, yc, hr, phi, info, obs_var, mean, h = step_inputs(
        t, valid, b, c, y, params, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
    return step_after(p11, p12, p21, p22, e1, e2, f, tl.where(valid, decay, 1.0), tl.where(valid, noise, 0.0),
                      phi, info)


@triton.jit
def output_step(lam, eta, total, t, valid, b, c, y, o,
                params, decay_s, noise_s, obs_var_s, mean_s, h_s,
                mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
                pred_obs_var_ptr, loglik_ptr, missing_ptr, TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
                WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr,
                POSTERIOR: tl.constexpr, SUM_LOGLIK: tl.constexpr):
    """Step ``t`` from the state ``(lam, eta)`` before it, given its observation ``y``: its outputs
    written at offset ``o`` (:func:`kalmanscan.kernels.filter.steps.emit_step`); returns the state
    after it and ``total`` plus its log-likelihood in float64 with ``SUM_LOGLIK``."""
    decay, noise, observed, yc, hr, phi, info, obs_var, mean, h = step_inputs(
        t, valid, b, c, y, params, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
    lam, eta, loglik = emit_step(
        lam, eta, decay, noise, observed, yc, phi, info, obs_var, mean, h, o, valid,
        mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
        pred_obs_var_ptr, loglik_ptr, missing_ptr, WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR)
    if SUM_LOGLIK:
        total += tl.where(valid, loglik, 0.0).to(tl.float64)
    return lam, eta, total


@triton.jit
def stretch_product(p11, p12, p21, p22, e1, e2, f, start, t0, L, T, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c,
                    params, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
                    UNROLL: tl.constexpr, PREFETCH: tl.constexpr):
    """The product ``p`` (of steps ``t0 .. t0 + start - 1``) with the maps of steps ``t0 + start ..
    t0 + L - 1`` composed after it (7 numbers per lane, trace 1)."""
    end = tl.minimum(t0 + L, T)
    # with PREFETCH, y of the next four steps in flight (loads issued ahead of the dependent chain)
    y_a, y_b, y_c, y_d = ring_start(y_ptr, b, t0 + start, c, sy_b, sy_t, sy_c, lane_ok, end, decay_s, PREFETCH)
    for i in tl.range(start, L, loop_unroll_factor=UNROLL):
        t = t0 + i
        valid, y, y_a, y_b, y_c, y_d = walk_y(t, lane_ok, end, T, b, c, y_a, y_b, y_c, y_d, y_ptr, sy_b, sy_t, sy_c,
                                              PREFETCH)
        p11, p12, p21, p22, e1, e2, f = product_step(
            p11, p12, p21, p22, e1, e2, f, t, valid, b, c, y,
            params, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
    return p11, p12, p21, p22, e1, e2, f


@triton.jit
def walk_outputs(lam, eta, t0, L, T, C, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, params,
                 decay_s, noise_s, obs_var_s, mean_s, h_s,
                 mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
                 pred_obs_var_ptr, loglik_ptr, missing_ptr, TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
                 WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr,
                 POSTERIOR: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
                 SUM_LOGLIK: tl.constexpr):
    """Walk steps ``t0 .. t0 + L - 1`` from the state ``(lam, eta)``, writing the outputs
    (:func:`kalmanscan.kernels.filter.steps.emit_step`). Returns the sum of the steps'
    log-likelihoods in float64 with ``SUM_LOGLIK`` (``POSTERIOR`` bit 256 or 1024 set), else zeros."""
    out = b * T * C + c
    end = tl.minimum(t0 + L, T)
    total = tl.zeros_like(lam).to(tl.float64)
    # with PREFETCH, y of the next four steps in flight (loads issued ahead of the dependent chain)
    y_a, y_b, y_c, y_d = ring_start(y_ptr, b, t0, c, sy_b, sy_t, sy_c, lane_ok, end, decay_s, PREFETCH)
    for i in tl.range(0, L, loop_unroll_factor=UNROLL):
        t = t0 + i
        valid, y, y_a, y_b, y_c, y_d = walk_y(t, lane_ok, end, T, b, c, y_a, y_b, y_c, y_d, y_ptr, sy_b, sy_t, sy_c,
                                              PREFETCH)
        lam, eta, total = output_step(
            lam, eta, total, t, valid, b, c, y, out + t * C,
            params, decay_s, noise_s, obs_var_s, mean_s, h_s,
            mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
            pred_obs_var_ptr, loglik_ptr, missing_ptr, TRANS_STEP, OBS_STEP,
            WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR, SUM_LOGLIK)
    return total


@triton.jit
def filter_agg_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    agg_ptr, T, C, NS, L,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    BLOCK: tl.constexpr, WIDE: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
    CLOSED: tl.constexpr, CHUNK: tl.constexpr,
):
    """Each lane's stretch product (7 numbers, trace-normalised) into ``agg[b, k, s, c]``. With
    ``CLOSED`` and static parameters, complete stretches take their steps in closed form up to the
    first chunk with a missing value (:func:`kalmanscan.kernels.filter.walks_closed.closed_prefix`)
    and compose the rest."""
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    b, g, lane_ok, s, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s = lane_setup(C, NS, L, params, BLOCK, WIDE)
    one = tl.full((BLOCK,), 1.0, decay_s.dtype)
    zero = tl.zeros((BLOCK,), decay_s.dtype)
    p11, p12, p21, p22, e1, e2, f = one, zero, zero, one, zero, zero, one
    done = tl.zeros([], tl.int32)
    if CLOSED and not TRANS_STEP and not OBS_STEP:
        q11, q12, q21, q22, g1, g2, h, done = closed_prefix(
            t0, L, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, decay_s, noise_s, obs_var_s, mean_s, h_s,
            (s > 0) & (t0 + L <= T), CHUNK)
        if done > 0:
            p11, p12, p21, p22, e1, e2, f = q11, q12, q21, q22, g1, g2, h
    p11, p12, p21, p22, e1, e2, f = stretch_product(
        p11, p12, p21, p22, e1, e2, f, done, t0, L, T, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c,
        params, decay_s, noise_s, obs_var_s, mean_s, h_s,
        TRANS_STEP, OBS_STEP, UNROLL, PREFETCH)
    store7(agg_ptr + b * 7 * NS * C + g, NS * C, p11, p12, p21, p22, e1, e2, f, lane_ok)


@triton.jit
def filter_carry_kernel(agg_ptr, init_ptr, start_ptr, C, NS, CH: tl.constexpr):
    """Starting states ``start[b, :, s, c]`` of every stretch: slot 0 the initial state
    ``init[b, :, c]`` (``(B, 2, C)`` contiguous), slots ``1..NS-1`` from it and the products.

    One program per ``(b, c)``; stretches in chunks of ``CH`` with an inclusive
    ``tl.associative_scan`` of :func:`compose7` (padding is the identity map).
    """
    pid = tl.program_id(0)
    b = pid // C
    c = pid % C
    sbase = start_ptr + b * 2 * NS * C + c
    lam = tl.load(init_ptr + b * 2 * C + c)
    eta = tl.load(init_ptr + b * 2 * C + C + c)
    tl.store(sbase, lam)
    tl.store(sbase + NS * C, eta)
    abase = agg_ptr + b * 7 * NS * C + c
    stride = NS * C
    idx = tl.arange(0, CH)
    for k0 in range(0, NS - 1, CH):
        s = k0 + idx
        m = s < NS - 1
        o = abase + s * C
        p11 = tl.load(o, mask=m, other=1.0)
        p12 = tl.load(o + stride, mask=m, other=0.0)
        p21 = tl.load(o + 2 * stride, mask=m, other=0.0)
        p22 = tl.load(o + 3 * stride, mask=m, other=1.0)
        e1 = tl.load(o + 4 * stride, mask=m, other=0.0)
        e2 = tl.load(o + 5 * stride, mask=m, other=0.0)
        f = tl.load(o + 6 * stride, mask=m, other=1.0)
        p11, p12, p21, p22, e1, e2, f = tl.associative_scan(
            (p11, p12, p21, p22, e1, e2, f), 0, compose7)
        lam_s, eta_s = read_out7(p11, p12, p21, p22, e1, e2, f, lam, eta)
        tl.store(sbase + (s + 1) * C, lam_s, mask=m)
        tl.store(sbase + NS * C + (s + 1) * C, eta_s, mask=m)
        last = idx == CH - 1
        lam = pick(lam_s, last)
        eta = pick(eta_s, last)


@triton.jit
def filter_total_kernel(agg_ptr, total_ptr, C, NS, CH: tl.constexpr):
    """The product of all ``NS`` stretch maps, ``total[b, k, c]`` (7 numbers, trace 1).

    One program per ``(b, c)``; stretches in chunks of ``CH``: an inclusive ``tl.associative_scan``
    of :func:`compose7` gives each chunk's product in its last slot, composed after the running
    total (padding is the identity map).
    """
    pid = tl.program_id(0)
    b = pid // C
    c = pid % C
    abase = agg_ptr + b * 7 * NS * C + c
    stride = NS * C
    idx = tl.arange(0, CH)
    last = idx == CH - 1
    zero = tl.full([], 0.0, agg_ptr.dtype.element_ty)
    t11, t12, t21, t22, u1, u2, v = zero + 1.0, zero, zero, zero + 1.0, zero, zero, zero + 1.0
    for k0 in range(0, NS, CH):
        s = k0 + idx
        m = s < NS
        o = abase + s * C
        p11, p12, p21, p22, e1, e2, f = tl.associative_scan(
            (tl.load(o, mask=m, other=1.0), tl.load(o + stride, mask=m, other=0.0),
             tl.load(o + 2 * stride, mask=m, other=0.0), tl.load(o + 3 * stride, mask=m, other=1.0),
             tl.load(o + 4 * stride, mask=m, other=0.0), tl.load(o + 5 * stride, mask=m, other=0.0),
             tl.load(o + 6 * stride, mask=m, other=1.0)), 0, compose7)
        q11, q12, q21, q22, g1, g2, h = last7(p11, p12, p21, p22, e1, e2, f, last)
        t11, t12, t21, t22, u1, u2, v = compose7(t11, t12, t21, t22, u1, u2, v,
                                                  q11, q12, q21, q22, g1, g2, h)
    store7(total_ptr + b * 7 * C + c, C, t11, t12, t21, t22, u1, u2, v, None)


@triton.jit
def filter_fwd_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    start_ptr, mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr,
    var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr, T, C, NS, L,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr,
    BLOCK: tl.constexpr, WIDE: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
    loglik_sum_ptr=None, SUM_LOGLIK: tl.constexpr = False,
):
    """Walk each lane's stretch from ``start`` and write the outputs ``(B, T, C)``
    (which ones, and how, is :func:`kalmanscan.kernels.filter.steps.emit_step`'s contract).
    With ``SUM_LOGLIK`` (and ``POSTERIOR`` bit 256, or 1024: computed, not stored) each lane's
    stretch also adds its log-likelihoods in float64 into ``loglik_sum[b, s, c]`` (``(B, NS, C)``),
    so the sum over time needs no pass over the per-step values, nor those values written."""
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    b, g, lane_ok, s, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s = lane_setup(C, NS, L, params, BLOCK, WIDE)
    sbase = start_ptr + b * 2 * NS * C + g
    lam = tl.load(sbase, mask=lane_ok, other=1.0)
    eta = tl.load(sbase + NS * C, mask=lane_ok, other=0.0)
    total = walk_outputs(
        lam, eta, t0, L, T, C, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, params,
        decay_s, noise_s, obs_var_s, mean_s, h_s,
        mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
        pred_obs_var_ptr, loglik_ptr, missing_ptr, TRANS_STEP, OBS_STEP,
        WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR, UNROLL, PREFETCH, SUM_LOGLIK)
    if SUM_LOGLIK:
        tl.store(loglik_sum_ptr + b * NS * C + g, total, mask=lane_ok)
