"""Time-parallel forward of the filter for few, long series: lanes along time.

The walks of :mod:`kernels.filter_fwd` give each lane one (stretch, channel) pair; with one
channel their loads are strided and a few thousand lanes leave the GPU idle. Here a program owns
one series' *stretch* of ``R`` tiles of ``TILE`` consecutive steps, and the lanes of a tile are its
steps: loads and stores are contiguous along time (for ``C = 1``). Within a tile the steps' maps
(the merged homogeneous form of :mod:`kernels.filter_fwd`, seven numbers, trace-normalised) are
combined by ``tl.associative_scan``; tiles within a stretch are visited in order, carrying the state.

1. :func:`filter_tile_agg_kernel` writes each stretch's product ``agg[b, k, s, c]``;
2. :func:`kernels.filter_fwd.filter_carry_kernel` scans them into each stretch's starting state;
3. :func:`filter_tile_fwd_kernel` scans, in every tile, the maps of the steps *before* each step
   (an inclusive scan of the maps shifted by one step, the identity first), reads the state before
   each step out of it projectively (``lam = (p11 lam0 + p12) / w0``, ``eta = (e1 lam0 + e2 +
   f eta0) / w0``, ``w0 = p21 lam0 + p22``), and from there does what a walk does at that step
   (:func:`kernels.filter_steps.emit_step`); the state after the tile's last step starts the next.

Every term of the precision's read-out is non-negative, so it is accurate to a few ulps per
combine; the information mean's may cancel, as a walk's sum of information does.
"""

import triton
import triton.language as tl

from .fast_math import rcp
from .filter_fwd import _compose7, last7, leaf7
from .filter_steps import emit_step, index, load_y, static_inputs, step_inputs


@triton.jit
def tile_leaves(t, valid, b, c, y_ptr, sy_b, sy_t, sy_c,
                theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
                dt_ptr, sdt_b, sdt_t, sdt_c,
                obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
                h_ptr, sh_b, sh_t, sh_c,
                decay_s, noise_s, obs_var_s, mean_s, h_s,
                TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr):
    """The maps of steps ``t`` (a tile), the identity where ``valid`` is off."""
    y = load_y(y_ptr, b, t, c, sy_b, sy_t, sy_c, valid)
    decay, noise, observed, yc, hr, phi, info, obs_var, mean, h = step_inputs(
        t, valid, b, c, y,
        theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
        obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c,
        decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
    p11, p12, p21, p22, e1, e2, f = leaf7(decay, noise, phi, info)
    return (tl.where(valid, p11, 1.0), tl.where(valid, p12, 0.0), tl.where(valid, p21, 0.0),
            tl.where(valid, p22, 1.0), tl.where(valid, e1, 0.0), tl.where(valid, e2, 0.0),
            tl.where(valid, f, 1.0))


@triton.jit
def stretch_setup(T, C, R, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
                  dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
                  h_ptr, sh_b, sh_t, sh_c, TILE: tl.constexpr, WIDE: tl.constexpr):
    """``(s, b, c, t0, *statics)``: stretch ``program_id(0)`` of series ``program_id(1) = b C + c``,
    its first step and its static parameters (:func:`kernels.filter_steps.static_inputs`)."""
    s = tl.program_id(0)
    bc = tl.program_id(1)
    b = index(bc // C, WIDE)
    c = bc % C
    t0 = index(s, WIDE) * R * TILE
    decay_s, noise_s, obs_var_s, mean_s, h_s = static_inputs(
        t0, t0 < T, b, c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
        dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
        h_ptr, sh_b, sh_t, sh_c)
    return s, b, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s


@triton.jit
def filter_tile_agg_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    agg_ptr, T, C, NS, R,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr, TILE: tl.constexpr, WIDE: tl.constexpr,
):
    """Stretch ``program_id(0)`` of series ``program_id(1) = b C + c``: its product into
    ``agg[b, k, s, c]`` (7 numbers, trace 1)."""
    s, b, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s = stretch_setup(
        T, C, R, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
        dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
        h_ptr, sh_b, sh_t, sh_c, TILE, WIDE)
    idx = tl.arange(0, TILE)
    last = idx == TILE - 1
    zero = tl.zeros([], decay_s.dtype)
    t11, t12, t21, t22, u1, u2, v = zero + 1.0, zero, zero, zero + 1.0, zero, zero, zero + 1.0
    for r in range(R):
        t = t0 + r * TILE + idx
        p11, p12, p21, p22, e1, e2, f = tl.associative_scan(tile_leaves(
            t, t < T, b, c, y_ptr, sy_b, sy_t, sy_c,
            theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
            obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c,
            decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP), 0, _compose7)
        q11, q12, q21, q22, g1, g2, h = last7(p11, p12, p21, p22, e1, e2, f, last)
        t11, t12, t21, t22, u1, u2, v = _compose7(t11, t12, t21, t22, u1, u2, v,
                                                  q11, q12, q21, q22, g1, g2, h)
    base = agg_ptr + b * 7 * NS * C + s * C + c
    stride = NS * C
    tl.store(base, t11)
    tl.store(base + stride, t12)
    tl.store(base + 2 * stride, t21)
    tl.store(base + 3 * stride, t22)
    tl.store(base + 4 * stride, u1)
    tl.store(base + 5 * stride, u2)
    tl.store(base + 6 * stride, v)


@triton.jit
def filter_tile_fwd_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    start_ptr, mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr,
    var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr, T, C, NS, R,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr,
    TILE: tl.constexpr, WIDE: tl.constexpr,
):
    """Stretch ``program_id(0)`` of series ``program_id(1)`` from ``start[b, :, s, c]``: the outputs
    ``(B, T, C)`` of :func:`kernels.filter_steps.emit_step`, a tile at a time."""
    s, b, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s = stretch_setup(
        T, C, R, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
        dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
        h_ptr, sh_b, sh_t, sh_c, TILE, WIDE)
    sbase = start_ptr + b * 2 * NS * C + s * C + c
    lam = tl.load(sbase)
    eta = tl.load(sbase + NS * C)
    out = b * T * C + c
    idx = tl.arange(0, TILE)
    last = idx == TILE - 1
    for r in range(R):
        t = t0 + r * TILE + idx
        valid = t < T
        p11, p12, p21, p22, e1, e2, f = tl.associative_scan(tile_leaves(
            t - 1, valid & (idx > 0), b, c, y_ptr, sy_b, sy_t, sy_c,
            theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
            obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c,
            decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP), 0, _compose7)
        inv_w0 = rcp(p21 * lam + p22)
        lam_t = (p11 * lam + p12) * inv_w0
        eta_t = (e1 * lam + e2 + f * eta) * inv_w0
        y = load_y(y_ptr, b, t, c, sy_b, sy_t, sy_c, valid)
        decay, noise, observed, yc, hr, phi, info, obs_var, mean, h = step_inputs(
            t, valid, b, c, y,
            theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
            obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c,
            decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
        lam_t, eta_t = emit_step(
            lam_t, eta_t, decay, noise, observed, yc, phi, info, obs_var, mean, h, out + t * C, valid,
            mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
            pred_obs_var_ptr, loglik_ptr, missing_ptr, WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR)
        lam = tl.sum(tl.where(last, lam_t, 0.0), axis=0)
        eta = tl.sum(tl.where(last, eta_t, 0.0), axis=0)
