"""Time-parallel forward of the filter for few, long series: lanes along time.

The walks of :mod:`kalmanscan.kernels.filter.fwd` give each lane one (stretch, channel) pair; with one
channel their loads are strided and a few thousand lanes leave the GPU idle. Here a program owns
one series' *stretch* of ``R`` tiles of ``TILE`` consecutive steps, visited in order, carrying the
state. A tile is a block ``[NT, ROW]`` of steps, ``NT = TILE / ROW`` *rows* of ``ROW`` consecutive
steps (``ROW`` a power of two dividing ``TILE``): loaded, stored and turned into step inputs
(:func:`kalmanscan.kernels.filter.steps.step_inputs`) as a block, contiguous along time for ``C = 1``. Each
lane composes its row's steps in registers (the merged homogeneous form of
:mod:`kalmanscan.kernels.filter.fwd`: seven numbers, trace-normalised, with the factored step
:func:`kalmanscan.kernels.filter.fwd.step_after`), and only the ``NT`` row maps are combined across lanes by
``tl.associative_scan``: ``ROW`` times fewer scan elements than one per step.

1. :func:`filter_tile_agg_kernel` writes each stretch's product ``agg[b, k, s, c]``;
2. :func:`kalmanscan.kernels.filter.fwd.filter_carry_kernel` scans them into each stretch's starting state;
3. :func:`filter_tile_fwd_kernel` scans, in every tile, the row maps (inclusive), reads the state
   after each row out of it projectively (``lam = (p11 lam0 + p12) / w0``, ``eta = (e1 lam0 + e2 +
   f eta0) / w0``, ``w0 = p21 lam0 + p22``, from the tile's starting state ``(lam0, eta0)``), moves
   it one row on (``tl.gather``: the state before row ``k`` is the one after row ``k - 1``, the
   tile's starting state before row 0), walks each row from there with the plain recursion
   (:func:`kalmanscan.kernels.filter.steps.info_step`) for the state before each of its steps, and writes the
   tile's outputs from those states as a block (:func:`kalmanscan.kernels.filter.steps.emit_step`); the state
   after the tile's last row starts the next.

Every term of the precision's read-out is non-negative, so it is accurate to a few ulps per
combine; the information mean's may cancel, as a walk's sum of information does. Within a row the
numerics are those of the walks.

With ``CLOSED`` (static parameters, several stretches), a complete stretch takes the closed form of
:mod:`kalmanscan.kernels.filter.tiles_closed` in both passes instead (a uniform branch per program;
the aggregate pass records which stretches did in ``fast``).
"""

import triton
import triton.language as tl

from kalmanscan.kernels.fast_math import rcp
from kalmanscan.kernels.filter.fwd import compose7, step_after, last7, leaf7
from kalmanscan.kernels.filter.steps import emit_step, index, info_step, load_y, pick, static_inputs, step_inputs
from kalmanscan.kernels.filter.tiles_closed import (closed_agg7, closed_constants, closed_power, closed_sums,
                                                    closed_tile_states, tile_sum)


@triton.jit
def row_columns(x, ROW: tl.constexpr):
    """The ``ROW`` columns of ``x`` (``[NT, ROW]``, ``ROW`` a power of two) as a tuple of ``[NT]``
    vectors, by halving: each part ``[NT, m]`` is cut into its first and second ``m / 2`` columns.
    Values are moved, not computed (register renaming where a thread holds its row)."""
    NT: tl.constexpr = x.shape[0]
    parts = (x,)
    for level in tl.static_range(ROW.bit_length() - 1):
        halves = ()
        for i in tl.static_range(1 << level):
            lo, hi = tl.split(tl.permute(tl.reshape(parts[i], [NT, 2, (ROW >> level) // 2]), (0, 2, 1)))
            halves = halves + (lo, hi)
        parts = halves
    cols = ()
    for j in tl.static_range(ROW):
        cols = cols + (tl.reshape(parts[j], [NT]),)
    return cols


@triton.jit
def join_columns(cols, ROW: tl.constexpr):
    """The ``[NT, ROW]`` block whose columns are the tuple ``cols`` of ``[NT]`` vectors (the
    inverse of :func:`row_columns`)."""
    NT: tl.constexpr = cols[0].shape[0]
    parts = ()
    for j in tl.static_range(ROW):
        parts = parts + (tl.reshape(cols[j], [NT, 1]),)
    for level in tl.static_range(ROW.bit_length() - 1):
        pairs = ()
        for i in tl.static_range(ROW >> (level + 1)):
            pairs = pairs + (tl.reshape(tl.permute(tl.join(parts[2 * i], parts[2 * i + 1]), (0, 2, 1)),
                                        [NT, 2 << level]),)
        parts = pairs
    return parts[0]


@triton.jit
def tile_inputs(t, T, b, c, y_ptr, sy_b, sy_t, sy_c, params, statics,
                TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr):
    """``(valid, decay, noise, observed, yc, phi, info, obs_var, mean, h)`` of the steps ``t`` (a
    block ``[NT, ROW]``, :func:`kalmanscan.kernels.filter.steps.step_inputs`; ``params`` the 24
    parameter pointers and strides in kernel order, ``statics`` the stretch's static parameters,
    :func:`stretch_setup`); at or past ``T`` the identity step: ``decay = 1``, ``noise = 0``, and
    ``y`` reads as missing (``phi = info = 0``)."""
    decay_s, noise_s, obs_var_s, mean_s, h_s = statics
    valid = t < T
    y = load_y(y_ptr, b, t, c, sy_b, sy_t, sy_c, valid)
    decay, noise, observed, yc, hr, phi, info, obs_var, mean, h = step_inputs(
        t, valid, b, c, y, params, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
    return (valid, tl.where(valid, decay, 1.0), tl.where(valid, noise, 0.0), observed, yc, phi, info,
            obs_var, mean, h)


@triton.jit
def row_maps(decay, noise, phi, info, ROW: tl.constexpr):
    """The map of each row (vectors ``[NT]``, 7 numbers) from the row's ``ROW`` steps, given as
    tuples of columns (:func:`row_columns`): the product of the steps in order, composed in-thread:
    the first step's :func:`kalmanscan.kernels.filter.fwd.leaf7`, then :func:`kalmanscan.kernels.filter.fwd.step_after`
    for each of the others (trace 1 from the second step on). A step with ``decay = 1``,
    ``noise = phi = info = 0`` is the identity."""
    p11, p12, p21, p22, e1, e2, f = leaf7(decay[0], noise[0], phi[0], info[0])
    for j in tl.static_range(1, ROW):
        p11, p12, p21, p22, e1, e2, f = step_after(p11, p12, p21, p22, e1, e2, f,
                                                    decay[j], noise[j], phi[j], info[j])
    return p11, p12, p21, p22, e1, e2, f


@triton.jit
def stretch_setup(T, C, R, params, TILE: tl.constexpr, WIDE: tl.constexpr):
    """``(s, b, c, t0, statics)``: stretch ``program_id(0)`` of series ``program_id(1) = b C + c``,
    its first step and its static parameters ``(decay, noise, obs_var, mean, h)``
    (:func:`kalmanscan.kernels.filter.steps.static_inputs`; ``params`` as :func:`tile_inputs`)."""
    s = tl.program_id(0)
    bc = tl.program_id(1)
    b = index(bc // C, WIDE)
    c = bc % C
    t0 = index(s, WIDE) * R * TILE
    statics = static_inputs(t0, t0 < T, b, c, params)
    return s, b, c, t0, statics


@triton.jit
def filter_tile_agg_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    agg_ptr, fast_ptr, T, C, NS, R,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr, TILE: tl.constexpr, ROW: tl.constexpr,
    WIDE: tl.constexpr, CLOSED: tl.constexpr,
):
    """Stretch ``program_id(0)`` of series ``program_id(1) = b C + c``: its product into
    ``agg[b, k, s, c]`` (7 numbers, trace 1), and ``fast[b C + c, s]`` 1 where it came in closed
    form (``CLOSED``, static parameters, a complete stretch: :mod:`kalmanscan.kernels.filter.tiles_closed`),
    0 where the steps were composed."""
    tl.static_assert(TILE % ROW == 0)
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    s, b, c, t0, statics = stretch_setup(T, C, R, params, TILE, WIDE)
    decay_s, noise_s, obs_var_s, mean_s, h_s = statics
    rows = tl.arange(0, TILE // ROW)
    last = rows == TILE // ROW - 1
    steps = rows[:, None] * ROW + tl.arange(0, ROW)[None, :]
    zero = tl.zeros([], decay_s.dtype)
    t11, t12, t21, t22, u1, u2, v = zero + 1.0, zero, zero, zero + 1.0, zero, zero, zero + 1.0
    fast = tl.zeros([], tl.int32)
    if CLOSED and not TRANS_STEP and not OBS_STEP:
        xp, xm, inv_d, log2_f, nlr, c_lam, c_var, var_star, usable = closed_constants(decay_s, noise_s,
                                                                                        obs_var_s, h_s)
        L = R * TILE
        complete = usable & (s > 0) & (t0 + L <= T)
        if complete:  # a gap in the first tile (dense missing values): compose without summing first
            first_y = load_y(y_ptr, b, t0 + steps, c, sy_b, sy_t, sy_c, t0 + steps < T)
            complete = tile_sum((first_y != first_y).to(tl.int32)) == 0
        if complete:
            acc1 = tl.zeros(steps.shape, decay_s.dtype)
            acc2 = tl.zeros(steps.shape, decay_s.dtype)
            gaps = tl.zeros(steps.shape, tl.int32)
            for r in range(R):
                t = t0 + r * TILE + steps
                valid, decay, noise, observed, yc, phi, info, obs_var, mean, h = tile_inputs(
                    t, T, b, c, y_ptr, sy_b, sy_t, sy_c, params, statics, TRANS_STEP, OBS_STEP)
                acc1, acc2, gaps = closed_sums(acc1, acc2, gaps, r * TILE + steps, L, observed, info, xp, xm,
                                               log2_f, nlr)
            if tile_sum(gaps) == 0:
                t11, t12, t21, t22, u1, u2, v = closed_agg7(tile_sum(acc1), tile_sum(acc2), L, xp, xm, inv_d,
                                                            log2_f, nlr)
                fast = fast + 1
    if fast == 0:
        for r in range(R):
            t = t0 + r * TILE + steps
            valid, decay, noise, observed, yc, phi, info, obs_var, mean, h = tile_inputs(
                t, T, b, c, y_ptr, sy_b, sy_t, sy_c, params, statics, TRANS_STEP, OBS_STEP)
            p11, p12, p21, p22, e1, e2, f = tl.associative_scan(row_maps(
                row_columns(decay, ROW), row_columns(noise, ROW), row_columns(phi, ROW), row_columns(info, ROW),
                ROW), 0, compose7)
            q11, q12, q21, q22, g1, g2, h = last7(p11, p12, p21, p22, e1, e2, f, last)
            t11, t12, t21, t22, u1, u2, v = compose7(t11, t12, t21, t22, u1, u2, v,
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
    if CLOSED:
        tl.store(fast_ptr + (b * C + c) * NS + s, fast)


@triton.jit
def tile_outputs(lams, etas, inputs, o, outs, total, WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr,
                 WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr, ROW: tl.constexpr, SUM_LOGLIK: tl.constexpr):
    """A tile's outputs at the offsets ``o`` (``[NT, ROW]``) from the states before its steps
    (``lams``, ``etas``: ``ROW`` columns of ``[NT]``) and its step inputs (:func:`tile_inputs`),
    written through the ten pointers ``outs`` in kernel order
    (:func:`kalmanscan.kernels.filter.steps.emit_step`). Returns ``total`` plus, with ``SUM_LOGLIK``,
    the tile's log-likelihoods at steps before ``T``, each taken to float64 before it is added."""
    valid, decay, noise, observed, yc, phi, info, obs_var, mean, h = inputs
    (mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr,
     loglik_ptr, missing_ptr) = outs
    _, _, loglik = emit_step(join_columns(lams, ROW), join_columns(etas, ROW), decay, noise, observed, yc, phi, info,
                             obs_var, mean, h, o, valid, mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr,
                             pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr,
                             WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR)
    if SUM_LOGLIK:
        total += tl.sum(tl.sum(tl.where(valid, loglik, 0.0).to(tl.float64), axis=1), axis=0)
    return total


@triton.jit
def filter_tile_fwd_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    start_ptr, fast_ptr, mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr,
    var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr, T, C, NS, R,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr,
    TILE: tl.constexpr, ROW: tl.constexpr, WIDE: tl.constexpr, CLOSED: tl.constexpr,
    loglik_sum_ptr=None, SUM_LOGLIK: tl.constexpr = False,
):
    """Stretch ``program_id(0)`` of series ``program_id(1)`` from ``start[b, :, s, c]``: the outputs
    ``(B, T, C)`` of :func:`kalmanscan.kernels.filter.steps.emit_step`, a tile at a time: the state before
    every step (``[NT, ROW]``, each row walked from the state before it), then the tile's outputs.
    A stretch whose ``fast[b C + c, s]`` is 1 (``CLOSED``: the aggregate pass found it complete)
    takes each row's first precision in closed form and scans the mean's affine maps
    (:func:`kalmanscan.kernels.filter.tiles_closed.closed_tile_states`). With ``SUM_LOGLIK`` (and
    ``POSTERIOR`` bit 256 or 1024) the stretch's log-likelihoods, summed in float64, go to
    ``loglik_sum[b, s, c]`` (``(B, NS, C)``), as the walks' do."""
    tl.static_assert(TILE % ROW == 0)
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    s, b, c, t0, statics = stretch_setup(T, C, R, params, TILE, WIDE)
    decay_s, noise_s, obs_var_s, mean_s, h_s = statics
    sbase = start_ptr + b * 2 * NS * C + s * C + c
    lam = tl.load(sbase)
    eta = tl.load(sbase + NS * C)
    out = b * T * C + c
    outs = (mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr,
            loglik_ptr, missing_ptr)
    rows = tl.arange(0, TILE // ROW)
    first = rows == 0
    last = rows == TILE // ROW - 1
    before = tl.maximum(rows - 1, 0)
    steps = rows[:, None] * ROW + tl.arange(0, ROW)[None, :]
    fast = tl.zeros([], tl.int32)
    total = tl.zeros([], tl.float64)
    if CLOSED and not TRANS_STEP and not OBS_STEP:
        fast = tl.load(fast_ptr + (b * C + c) * NS + s)
    if fast != 0:
        xp, xm, inv_d, log2_f, nlr, c_lam, c_var, var_star, usable = closed_constants(decay_s, noise_s,
                                                                                        obs_var_s, h_s)
        phi_s = h_s / obs_var_s * h_s
        for r in range(R):
            t = t0 + r * TILE + steps
            inputs = tile_inputs(t, T, b, c, y_ptr, sy_b, sy_t, sy_c, params, statics, TRANS_STEP, OBS_STEP)
            info = inputs[6]  # (valid, decay, noise, observed, yc, phi, info, ...): the information only
            lam_rows = closed_power(lam, (r * TILE + rows * ROW).to(lam.dtype), xp, var_star, nlr, c_lam, c_var)
            lams, etas, eta_end = closed_tile_states(lam_rows, eta, decay_s, noise_s, phi_s, row_columns(info, ROW),
                                                     first, before, ROW)
            total = tile_outputs(lams, etas, inputs, out + t * C, outs, total, WRITE_MU, WRITE_LAM, WRITE_PRED,
                                 POSTERIOR, ROW, SUM_LOGLIK)
            eta = pick(eta_end, last)
    else:
        for r in range(R):
            t = t0 + r * TILE + steps
            inputs = tile_inputs(t, T, b, c, y_ptr, sy_b, sy_t, sy_c, params, statics, TRANS_STEP, OBS_STEP)
            valid, decay, noise, observed, yc, phi, info, obs_var, mean, h = inputs
            d = row_columns(decay, ROW)
            n = row_columns(noise, ROW)
            ph = row_columns(phi, ROW)
            inf = row_columns(info, ROW)
            p11, p12, p21, p22, e1, e2, f = tl.associative_scan(row_maps(d, n, ph, inf, ROW), 0, compose7)
            inv_w0 = rcp(p21 * lam + p22)
            lam_r = tl.where(first, lam, tl.gather((p11 * lam + p12) * inv_w0, before, 0))
            eta_r = tl.where(first, eta, tl.gather((e1 * lam + e2 + f * eta) * inv_w0, before, 0))
            lams = ()
            etas = ()
            for j in tl.static_range(ROW):
                lams = lams + (lam_r,)
                etas = etas + (eta_r,)
                lam_r, eta_r = info_step(lam_r, eta_r, d[j], n[j], ph[j], inf[j])
            total = tile_outputs(lams, etas, inputs, out + t * C, outs, total, WRITE_MU, WRITE_LAM, WRITE_PRED,
                                 POSTERIOR, ROW, SUM_LOGLIK)
            lam = pick(lam_r, last)
            eta = pick(eta_r, last)
    if SUM_LOGLIK:
        tl.store(loglik_sum_ptr + b * NS * C + s * C + c, total)
