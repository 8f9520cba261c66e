"""Fused forward for many series in one pass over ``y``: a program per block of channels streams
time in chunks, its rows splitting each chunk.

A program owns ``BLOCK_C`` channels of one batch row for all of time; its lanes are a
``[ROWS, BLOCK_C]`` grid. A *chunk* is ``ROWS`` consecutive *segments* of ``STEPS`` steps, and row
``r`` walks segment ``r``. The state entering the chunk is carried in registers from the chunk
before (the first chunk enters from ``init``). Per chunk:

1. row ``r`` composes the maps of segment ``r - 1`` (row 0: none, the identity) in the merged
   form of :mod:`kalmanscan.kernels.filter.fwd` (seven numbers, trace 1);
2. an inclusive ``tl.associative_scan`` of those maps over the rows gives row ``r`` the product of
   segments ``0 .. r - 1``: read out from the entering state, its starting state;
3. each row walks its segment from that state writing the outputs
   (:func:`kalmanscan.kernels.filter.fwd.walk_outputs`): its ``y`` was just loaded by the row after it,
   so only the last row's segment comes from memory a second time (no second pass over ``y``);
4. the last row's final state enters the next chunk.

*Steady chunks* (``STEADY``: static parameters). When the entering precision is a fixed point of
the step's precision map to within :data:`STEADY_ULPS` units in the last place and no value of
segments ``0 .. ROWS - 2`` is missing, every step of those segments maps the precision to itself,
so the information mean's step is affine with one factor ``f = decay / (decay^2 + noise lam)``
(:func:`kalmanscan.kernels.filter.steps.info_step` at the entering ``lam``): step 1 composes two
numbers per row (:func:`steady_segment`) instead of seven, and each row starts from the entering
precision. The walks of step 3 are the exact recursion either way, so the precision written is
the walked one and only the mean's starting values use ``f``; its error is that of ``f`` at the
entering precision against the walked one's (a few ulps, as the walk's own rounding of ``f``).
"""

import triton
import triton.language as tl

from ..fast_math import rcp
from .fwd import compose7, read_out7, stretch_product, walk_outputs
from .steps import index, load_y, observation, pick, static_inputs

STEADY_ULPS = tl.constexpr(2.0)
"""A precision counts as the fixed point when one step moves it by at most this many ulps."""


@triton.jit
def affine_after(a1, b1, a2, b2):
    """``x -> a2 (a1 x + b1) + b2``: the affine map ``(a2, b2)`` after ``(a1, b1)``."""
    return a2 * a1, a2 * b1 + b2


@triton.jit
def steady_segment(t0, row, lane_ok, T, b, c, y_ptr, sy_b, sy_t, sy_c, f, obs_var, mean, h,
                   STEPS: tl.constexpr):
    """The affine map ``eta -> a eta + s`` of steps ``t0 - STEPS .. t0 - 1`` of every row (the
    segment before the row's own; row 0 and steps at or past ``T``: the identity) at the factor
    ``f``, and whether a value among them is missing."""
    a = tl.full(t0.shape, 1.0, f.dtype) + tl.zeros_like(f)
    s = tl.zeros_like(a)
    bad = tl.zeros(a.shape, tl.int32)
    for k in tl.static_range(STEPS):
        t = t0 - STEPS + k
        valid = lane_ok & (row > 0) & (t < T)
        y = load_y(y_ptr, b, t, c, sy_b, sy_t, sy_c, valid)
        observed, yc, hr, phi, info = observation(y, obs_var, mean, h)
        a = tl.where(valid, f * a, a)
        s = tl.where(valid, f * s + info, s)
        bad = bad | (valid & ~observed).to(tl.int32)
    return a, s, bad


@triton.jit
def steady_factor(lam, decay, noise, obs_var, h):
    """``(f, fixed)``: the mean's factor at the precision ``lam`` and whether one observed step
    moves ``lam`` by at most :data:`STEADY_ULPS` ulps (``lam`` is then the map's fixed point)."""
    rho = rcp(decay * decay + noise * lam)
    moved = tl.abs(rho * lam + h * h / obs_var - lam)
    if lam.dtype == tl.float64:
        ulp = 2.220446049250313e-16
    else:
        ulp = 1.1920928955078125e-07
    return decay * rho, moved <= STEADY_ULPS * ulp * lam


@triton.jit
def filter_chunk_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    init_ptr, mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr,
    var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr, T, C,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr,
    ROWS: tl.constexpr, STEPS: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
    loglik_sum_ptr=None, SUM_LOGLIK: tl.constexpr = False,
):
    """Filter channels ``program_id(0) * BLOCK_C ..`` of batch row ``program_id(1)`` from
    ``init[b, :, c]`` (``(B, 2, C)``: precision and information mean) over all of time, writing the
    outputs (:func:`kalmanscan.kernels.filter.steps.emit_step`'s contract); with ``SUM_LOGLIK`` the
    float64 sum of each channel's log-likelihoods into ``loglik_sum[b, 0, c]`` (``(B, 1, C)``)."""
    b = index(tl.program_id(1), WIDE)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    row = tl.arange(0, ROWS)[:, None]
    c_ok = c < C
    lane_ok = c_ok & (row < ROWS)
    decay_s, noise_s, obs_var_s, mean_s, h_s = static_inputs(
        0, c_ok, b, c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
        dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
        h_ptr, sh_b, sh_t, sh_c)
    lam_c = tl.load(init_ptr + b * 2 * C + c, mask=c_ok, other=1.0)
    eta_c = tl.load(init_ptr + b * 2 * C + C + c, mask=c_ok, other=0.0)
    total = tl.zeros(lane_ok.shape, tl.float64)
    for t_c in range(0, T, ROWS * STEPS):
        t0 = index(t_c, WIDE) + row * STEPS
        general = tl.full([], 1, tl.int32)
        lam = lam_c + tl.zeros(lane_ok.shape, lam_c.dtype)
        eta = tl.zeros_like(lam)
        if not (TRANS_STEP or OBS_STEP):
            f, fixed = steady_factor(lam_c, decay_s, noise_s, obs_var_s, h_s)
            if (t_c > 0) & (tl.min((fixed | ~c_ok).to(tl.int32)) > 0):
                a, s, bad = steady_segment(t0, row, lane_ok, T, b, c, y_ptr, sy_b, sy_t, sy_c, f,
                                           obs_var_s, mean_s, h_s, STEPS)
                a, s = tl.associative_scan((a, s), 0, affine_after)
                eta = a * eta_c + s
                general = tl.max(bad)
        if general != 0:  # row r composes segment r - 1 (row 0: the identity)
            p11, p12, p21, p22, e1, e2, f7 = stretch_product(
                t0 - STEPS, STEPS, T, b, c, lane_ok & (row > 0), y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t,
                sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c,
                mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c, decay_s, noise_s, obs_var_s, mean_s, h_s,
                TRANS_STEP, OBS_STEP, STEPS, False)
            p11, p12, p21, p22, e1, e2, f7 = tl.associative_scan((p11, p12, p21, p22, e1, e2, f7), 0, compose7)
            lam, eta = read_out7(p11, p12, p21, p22, e1, e2, f7, lam_c, eta_c)
        lam, eta, walked = walk_outputs(
            lam, eta, t0, STEPS, T, C, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c,
            sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c,
            mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c, decay_s, noise_s, obs_var_s, mean_s, h_s,
            mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
            pred_obs_var_ptr, loglik_ptr, missing_ptr, TRANS_STEP, OBS_STEP,
            WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR, STEPS, False, SUM_LOGLIK)
        total += walked
        last = row == ROWS - 1
        lam_c = pick(lam, last)[None, :]
        eta_c = pick(eta, last)[None, :]
    if SUM_LOGLIK:
        tl.store(loglik_sum_ptr + b * C + c, tl.sum(total, axis=0)[None, :], mask=c_ok)
