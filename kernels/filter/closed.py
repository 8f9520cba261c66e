"""Forward of the filter for static parameters and a regular ``dt``: the precision in closed form,
the information mean as a first-order linear recurrence (docs/math.md §9).

A program owns a block of ``BLOCK_C`` channels of one batch row and one *stretch* of ``R`` chunks
of ``CHUNK`` steps; it visits the chunks in order, each as a tile ``[CHUNK, BLOCK_C]`` (channels
contiguous: coalesced loads and stores), carrying the filtered ``(lam, eta)`` from one chunk to the
next. With one stretch per series (many channels) this is the whole forward, one pass over ``y``;
with several (few, long series) each stretch starts from the state that
:func:`closed_agg_kernel` and :func:`kalmanscan.kernels.filter.fwd.filter_carry_kernel` give it.

Row ``t`` of a tile needs the precision before step ``t``, ``lam_{t-1}``; it comes, per chunk, by
one of three routes, chosen for the whole tile (a uniform branch):

- *steady*: no value of the chunk is missing and every channel's carried precision is at the fixed
  point ``lam*`` of the observed step's Möbius map (within ``TOL`` relative): every gate is a
  per-channel constant, read from ``consts``;
- *closed form*: no value of the chunk is missing: ``lam_{t-1}`` is the ``k``-th power of the
  map applied to the carried precision, ``k = t - t0`` (``t0`` the chunk's first step), in the
  deviation form ``x* + d u / (1 + c d (1 - u))``, ``u = rho^k``, with ``x`` the precision when
  it starts above ``lam*`` and the variance otherwise, so that ``d >= 0`` and nothing cancels;
- *scan*: otherwise (or where a channel has no usable closed form): an inclusive
  ``tl.associative_scan`` of the steps' 2x2 Möbius matrices (trace-normalised), shifted by one row
  (row ``t`` holds step ``t - 1``'s matrix, the chunk's first row the identity), read out
  projectively from the carried precision.

Given ``lam_{t-1}``, each row's forget gate ``f_t = a / (a^2 + q lam_{t-1})`` and the information
``b_t = (h / obs_var)(y_t - h mean)`` (0 when missing) are elementwise, and the predicted
information mean ``eta_pred_t = f_t eta_{t-1}`` is the inclusive scan of the affine maps
``x -> f_t x + f_t b_{t-1}`` (``b_{t-1}`` from a second, cached load of ``y`` shifted by one row;
0 on the chunk's first row, whose ``eta_{t0-1}`` is carried), from which ``eta_t = eta_pred_t + b_t``
exactly as the walks add it. Step 0 has no transition (``a = 1``, ``q = 0``).

``consts[b, k, c]`` (``k < NCONST``, computed in float64 by :mod:`kalmanscan.ops.filter.closed`):
0 decay, 1 noise, 2 obs_var, 3 mean, 4 h, 5 ``lam*``, 6 ``var* = 1/lam*``, 7 ``f*``, 8 ``pred_var*``,
9 ``-log rho`` (``rho = f*^2``), 10 ``c`` of the precision form, 11 ``c`` of the variance form,
12 usable (1.0 where the closed form is finite: ``rho < 1`` and every constant in range).
"""

import triton
import triton.language as tl

from ..fast_math import rcp
from .fwd import compose7, leaf7, store7
from .steps import emit_prediction, index, load_y, ou_phi

NCONST = tl.constexpr(13)


@triton.jit
def mobius_combine(p11, p12, p21, p22, q11, q12, q21, q22):
    """``later @ earlier`` of 2x2 Möbius matrices (earlier ``p``, later ``q``) divided by its trace.

    Every entry of a step's matrix is ``>= 0`` and its trace ``>= 1``, so products have
    non-negative entries and a positive trace: no cancellation, and the division keeps the trace
    at 1 (the projective read-out does not see it)."""
    n11 = q11 * p11 + q12 * p21
    n12 = q11 * p12 + q12 * p22
    n21 = q21 * p11 + q22 * p21
    n22 = q21 * p12 + q22 * p22
    inv = rcp(n11 + n22)
    return n11 * inv, n12 * inv, n21 * inv, n22 * inv


@triton.jit
def affine_combine(f1, x1, f2, x2):
    """``x -> f2 (f1 x + x1) + x2``: the affine map ``(f2, x2)`` after ``(f1, x1)``."""
    return f2 * f1, f2 * x1 + x2


@triton.jit
def last_row(x, rows, CHUNK: tl.constexpr):
    """Row ``CHUNK - 1`` of the tile ``x`` as a ``[BLOCK_C]`` vector (a masked sum over rows)."""
    return tl.sum(tl.where(rows == CHUNK - 1, x, 0.0), axis=0)


@triton.jit
def load_consts(consts_ptr, b, cols, C, col_ok):
    """The 13 per-channel constants of the program's channels, each ``[1, BLOCK_C]``."""
    base = consts_ptr + b * NCONST * C + cols
    out = ()
    for k in tl.static_range(NCONST):
        out = out + (tl.load(base + k * C, mask=col_ok, other=1.0),)
    return out


@triton.jit
def closed_power(lam0, k, lam_star, var_star, nlr, c_lam, c_var):
    """The precision after ``k >= 0`` observed steps from ``lam0`` (elementwise), in the form whose
    deviation from the fixed point is non-negative: ``lam* + d u / (1 + c d (1 - u))`` with
    ``d = lam0 - lam*`` when ``lam0 >= lam*``, else the same for the variance with
    ``d = (lam* - lam0) / (lam0 lam*)``. ``u = rho^k = exp(-k nlr)`` and ``1 - u = x phi(x)``,
    ``x = k nlr``, with Kahan's ``phi`` (:func:`kalmanscan.kernels.filter.steps.ou_phi`): accurate
    when ``rho -> 1``, where ``1 - u`` would cancel."""
    x = k * nlr
    u = tl.exp(-x)
    one_minus_u = x * ou_phi(x)
    above = lam0 >= lam_star
    d_lam = tl.where(above, lam0 - lam_star, 0.0)
    d_var = tl.where(above, 0.0, (lam_star - lam0) / (lam0 * lam_star))
    lam_hi = lam_star + d_lam * u / (1.0 + c_lam * d_lam * one_minus_u)
    var_lo = var_star + d_var * u / (1.0 + c_var * d_var * one_minus_u)
    return tl.where(above, lam_hi, 1.0 / var_lo)


@triton.jit
def emit_tile(o, valid, observed, yc, h, obs_var, mean, lam, var, pred_var, eta_pred, eta,
              mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
              pred_obs_var_ptr, loglik_ptr, missing_ptr,
              WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr,
              POSTERIOR: tl.constexpr):
    """Store a tile's outputs: the fields and conventions of
    :func:`kalmanscan.kernels.filter.steps.emit_step` (``POSTERIOR`` bit mask, or the centred
    ``mu, lam, pred_mu, pred_var`` under their ``WRITE_*`` flags), from the filtered precision and
    variance, the predicted variance and the predicted and filtered information means."""
    pred_mu = eta_pred * pred_var
    mu = eta * var
    if POSTERIOR:
        if POSTERIOR & 1:
            tl.store(mu_ptr + o, mu + mean, mask=valid)
        if POSTERIOR & 2:
            tl.store(lam_ptr + o, lam, mask=valid)
        if POSTERIOR & 16:
            tl.store(var_ptr + o, var, mask=valid)
        emit_prediction(pred_mu, pred_var, observed, yc, obs_var, mean, h, o, valid, pred_mu_ptr, pred_var_ptr,
                        pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr, POSTERIOR)
    else:
        if WRITE_MU:
            tl.store(mu_ptr + o, mu, mask=valid)
        if WRITE_LAM:
            tl.store(lam_ptr + o, lam, mask=valid)
        if WRITE_PRED:
            tl.store(pred_mu_ptr + o, pred_mu, mask=valid)
            tl.store(pred_var_ptr + o, pred_var, mask=valid)


@triton.jit
def tile_coords(C, R, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
    """``(b, s, cols, col_ok, rows)``: batch row ``program_id(2)``, stretch ``program_id(1)``, the
    program's channels ``[1, BLOCK_C]`` and the row offsets ``[CHUNK, 1]`` of a tile."""
    b = index(tl.program_id(2), WIDE)
    s = index(tl.program_id(1), WIDE)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    rows = tl.arange(0, CHUNK)[:, None]
    return b, s, cols, cols < C, rows


@triton.jit
def closed_fwd_kernel(
    y_ptr, sy_b, sy_t, sy_c, consts_ptr, start_ptr,
    mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
    pred_obs_var_ptr, loglik_ptr, missing_ptr,
    T, C, NS, R, TOL,
    WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
):
    """Walk the program's stretch chunk by chunk from ``start[b, 0/1, s, c] = (lam, eta)`` (the
    filtered state before the stretch; the initial one for ``s = 0``) and write the outputs
    ``(B, T, C)`` (module docstring). ``TOL``: the relative distance to ``lam*`` below which the
    carried precision counts as the fixed point."""
    b, s, cols, col_ok, rows = tile_coords(C, R, CHUNK, BLOCK_C, WIDE)
    (decay, noise, obs_var, mean, h, lam_star, var_star, f_star, pred_var_star, nlr, c_lam, c_var,
     usable) = load_consts(consts_ptr, b, cols, C, col_ok)
    hr = h / obs_var
    phi = hr * h
    closed_ok = tl.min(tl.where(col_ok, usable, 1.0)) > 0.0
    sbase = start_ptr + b * 2 * NS * C + s * C + cols
    lam_c = tl.load(sbase, mask=col_ok, other=1.0)
    eta_c = tl.load(sbase + NS * C, mask=col_ok, other=0.0)
    for j in range(R):
        t0 = (s * R + j) * CHUNK
        t = t0 + rows
        valid = (t < T) & col_ok
        y = load_y(y_ptr, b, t, cols, sy_b, sy_t, sy_c, valid)
        inner = valid & (rows > 0)
        y_prev = load_y(y_ptr, b, t - 1, cols, sy_b, sy_t, sy_c, inner)
        observed = y == y
        seen_prev = y_prev == y_prev
        yc = tl.where(observed, y - h * mean, 0.0)
        b_prev = tl.where(seen_prev, hr * (y_prev - h * mean), 0.0)
        a_t = tl.where(t == 0, 1.0, decay)
        q_t = tl.where(t == 0, 0.0, noise)
        phi_t = tl.where(observed, phi, 0.0)
        gaps = tl.max(tl.where(valid & ~observed, 1, 0)) > 0
        near = tl.abs(lam_c - lam_star) <= TOL * lam_star
        steady = closed_ok & (t0 > 0) & ~gaps & (tl.min(tl.where(col_ok, near.to(tl.int32), 1)) > 0)
        if steady:
            zero = tl.zeros((CHUNK, BLOCK_C), decay.dtype)
            f = zero + f_star
            pred_var = zero + pred_var_star
            lam = zero + lam_star
            var = zero + var_star
        else:
            if closed_ok & ~gaps:
                base = tl.where(t0 == 0, lam_c + phi, lam_c)
                k = tl.maximum(t - 1 - tl.maximum(t0 - 1, 0), 0).to(decay.dtype)
                lam_prev = closed_power(base, k, lam_star, var_star, nlr, c_lam, c_var)
                lam_prev = tl.where(t == 0, lam_c, lam_prev)
            else:
                one = tl.full((CHUNK, BLOCK_C), 1.0, decay.dtype)
                first = rows == 0
                a_p = tl.where(t == 1, 1.0, decay)
                q_p = tl.where(t == 1, 0.0, noise)
                phi_p = tl.where(seen_prev, phi, 0.0)
                a2 = a_p * a_p
                m11, m12, m21, m22 = tl.associative_scan(
                    (tl.where(first, one, 1.0 + q_p * phi_p), tl.where(first, 0.0, a2 * phi_p),
                     tl.where(first, 0.0, q_p * one), tl.where(first, one, a2)), 0, mobius_combine)
                lam_prev = (m11 * lam_c + m12) / (m21 * lam_c + m22)
            r = rcp(a_t * a_t + q_t * lam_prev)
            f = a_t * r
            lam = lam_prev * r + phi_t
            pred_var = a_t * a_t * rcp(lam_prev) + q_t
            var = rcp(lam)
        fs, xs = tl.associative_scan((f, tl.where(rows > 0, f * b_prev, 0.0)), 0, affine_combine)
        eta_pred = fs * eta_c + xs
        eta = eta_pred + hr * yc
        o = b * T * C + t * C + cols
        emit_tile(o, valid, observed, yc, h, obs_var, mean, lam, var, pred_var, eta_pred, eta,
                  mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
                  pred_obs_var_ptr, loglik_ptr, missing_ptr, WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR)
        lam_c = last_row(lam, rows, CHUNK)[None, :]
        eta_c = last_row(eta, rows, CHUNK)[None, :]


@triton.jit
def closed_agg_kernel(y_ptr, sy_b, sy_t, sy_c, consts_ptr, agg_ptr, T, C, NS, R,
                      CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
    """Each stretch's map in the merged form (7 numbers, docs/math.md §6) into ``agg[b, k, s, c]``,
    the layout :func:`kalmanscan.kernels.filter.fwd.filter_carry_kernel` scans: per chunk an
    inclusive ``tl.associative_scan`` of the steps' :func:`kalmanscan.kernels.filter.fwd.leaf7` by
    :func:`kalmanscan.kernels.filter.fwd.compose7`, its last row composed after the running
    product. Rows at or past ``T`` are the identity step."""
    b, s, cols, col_ok, rows = tile_coords(C, R, CHUNK, BLOCK_C, WIDE)
    decay, noise, obs_var, mean, h, _, _, _, _, _, _, _, _ = load_consts(consts_ptr, b, cols, C, col_ok)
    hr = h / obs_var
    one = tl.full((BLOCK_C,), 1.0, decay.dtype)[None, :]
    zero = one * 0.0
    p11, p12, p21, p22, e1, e2, g = one, zero, zero, one, zero, zero, one
    for j in range(R):
        t = (s * R + j) * CHUNK + rows
        valid = (t < T) & col_ok
        y = load_y(y_ptr, b, t, cols, sy_b, sy_t, sy_c, valid)
        observed = y == y
        info = tl.where(observed, hr * (y - h * mean), 0.0)
        moving = valid & (t > 0)
        m11, m12, m21, m22, n1, n2, n3 = tl.associative_scan(
            leaf7(tl.where(moving, decay, 1.0), tl.where(moving, noise, 0.0),
                  tl.where(observed, hr * h, 0.0), info), 0, compose7)
        p11, p12, p21, p22, e1, e2, g = compose7(
            p11, p12, p21, p22, e1, e2, g,
            last_row(m11, rows, CHUNK)[None, :], last_row(m12, rows, CHUNK)[None, :],
            last_row(m21, rows, CHUNK)[None, :], last_row(m22, rows, CHUNK)[None, :],
            last_row(n1, rows, CHUNK)[None, :], last_row(n2, rows, CHUNK)[None, :],
            last_row(n3, rows, CHUNK)[None, :])
    store7(agg_ptr + b * 7 * NS * C + s * C + cols, NS * C, p11, p12, p21, p22, e1, e2, g, col_ok)
