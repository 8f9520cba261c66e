"""Complete stretches of the walks in closed form: the aggregate pass's fast branch (docs/math.md §10).

With static parameters a *complete* stretch (every ``y`` observed, not the series' first, no step
past ``T``) has the merged map :func:`kalmanscan.kernels.filter.tiles_closed.closed_agg7` of two
weighted sums of its information, ``s1 = sum_j f*^(L-1-j) (1 - u_j) info_j`` and
``s2 = sum_j f*^(L-1-j) (u_j - x- / x+) info_j`` (``u_j = rho^(j+1)``; the row's weight over ``x+``, so
the sum scales as the information does). A lane walks them in Horner
form, ``s <- f* s + c_j info_j``, so a step costs a load and a few FMAs where composing the
seven-number maps costs about twenty operations and a reciprocal:

- ``f*`` enters as ``f_hi + f_lo`` (float64 split in two of the compute dtype): ``f*^n`` from a
  rounded ``f*`` would carry ``n`` times its rounding error;
- the *head* of the stretch, while ``u_j`` matters, takes ``c_j`` from
  :func:`kalmanscan.kernels.filter.tiles_closed.one_minus_exp` (``1 - u`` without cancellation);
  from the step where ``u_j max(1, x+ / |x-|) < 2^-26`` on (:func:`walk_constants`) the weights are
  ``c = (1, -x- / x+)`` to within float32 rounding.

Steps go in chunks of ``CHUNK``; after each the program looks at its lanes' missing values, and the
first chunk with one is not summed: :func:`closed_prefix` returns the map of the steps summed so
far (a stretch of that length in closed form) and the caller composes the rest of the stretch step
by step, so a stretch with a gap costs its steps once plus one chunk.
"""

import triton
import triton.language as tl

from kalmanscan.kernels.filter.steps import load_y
from kalmanscan.kernels.filter.tiles_closed import closed_agg7, closed_constants64, one_minus_exp, rounded_constants


@triton.jit
def walk_constants(decay, noise, obs_var, h, lane_ok, complete):
    """``(xp, xm, inv_d, log2_f, nlr, f_hi, f_lo, head, closed)`` of a program's lanes: the constants
    of :func:`kalmanscan.kernels.filter.tiles_closed.closed_constants` (from one float64 evaluation),
    ``f*`` split in two, the
    program's head (steps while the weights differ from their limit, the largest over its lanes;
    a float, ``inf`` where ``x- = 0``) and whether every lane may take the closed form (``complete``
    and usable)."""
    xp64, xm64, f64, omf64, nlr64, c_lam64, c_var64, usable = closed_constants64(decay, noise, obs_var, h)
    xp, xm, inv_d, log2_f, nlr, c_lam, c_var, var_star = rounded_constants(xp64, xm64, nlr64, c_lam64, c_var64,
                                                                           decay.dtype)
    f_hi = f64.to(decay.dtype)
    f_lo = (f64 - f_hi.to(tl.float64)).to(decay.dtype)
    ratio = tl.maximum(xp64 / tl.maximum(-xm64, 1e-300 * xp64), 1.0)  # x+ / |x-|, at most 1e300
    head_lane = (18.021826694558577 + tl.log(ratio)) / tl.where(nlr64 > 0, nlr64, 1e-300)  # 26 ln 2
    head = tl.max(tl.where(lane_ok, head_lane, 0.0), axis=0)
    closed = tl.min(tl.where(lane_ok, (complete & usable).to(tl.int32), 1), axis=0) == 1
    return xp, xm, inv_d, log2_f, nlr, f_hi, f_lo, head, closed


@triton.jit
def horner(s, f_hi, f_lo, x):
    """``f* s + x`` with ``f* = f_hi + f_lo``."""
    return f_hi * s + (f_lo * s + x)


@triton.jit
def closed_chunk(s1, s2, j0, t0, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, hm, hr, xp, xm, nlr, f_hi, f_lo,
                 HEAD: tl.constexpr, CHUNK: tl.constexpr):
    """Steps ``j0 .. j0 + CHUNK - 1`` of the stretch starting at ``t0`` added to the Horner sums;
    also returns the lanes' count of missing values among them. ``HEAD``: the exact weights."""
    gaps = tl.zeros(s1.shape, tl.int32)
    for k in tl.static_range(CHUNK):
        y = load_y(y_ptr, b, t0 + j0 + k, c, sy_b, sy_t, sy_c, lane_ok)
        gaps += ((y != y) & lane_ok).to(tl.int32)
        info = hr * (y - hm)
        if HEAD:
            u, omu = one_minus_exp((j0 + k + 1).to(nlr.dtype) * nlr)
            s1 = horner(s1, f_hi, f_lo, omu * info)
            s2 = horner(s2, f_hi, f_lo, (u - xm / xp) * info)
        else:
            s1 = horner(s1, f_hi, f_lo, info)
            s2 = horner(s2, f_hi, f_lo, -(xm / xp) * info)
    return s1, s2, gaps


@triton.jit
def closed_prefix(t0, L, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, decay_s, noise_s, obs_var_s, mean_s, h_s,
                  complete, CHUNK: tl.constexpr):
    """The merged map (7 numbers, trace 1) of the first ``done`` steps of each lane's stretch in
    closed form, and ``done``: whole chunks up to the first with a missing value in any lane, or
    ``0`` where a lane is not ``complete`` or its map has no closed form. The caller composes
    steps ``done .. L - 1`` after it."""
    xp, xm, inv_d, log2_f, nlr, f_hi, f_lo, head, closed = walk_constants(
        decay_s, noise_s, obs_var_s, h_s, lane_ok, complete)
    hr = h_s / obs_var_s
    hm = h_s * mean_s
    s1 = tl.zeros_like(xp)
    s2 = tl.zeros_like(xp)
    done = tl.zeros([], tl.int32)
    stop = (~closed).to(tl.int32)
    while (stop == 0) & (done + CHUNK <= L):
        if done < head:
            n1, n2, gaps = closed_chunk(s1, s2, done, t0, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, hm, hr,
                                        xp, xm, nlr, f_hi, f_lo, True, CHUNK)
        else:
            n1, n2, gaps = closed_chunk(s1, s2, done, t0, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, hm, hr,
                                        xp, xm, nlr, f_hi, f_lo, False, CHUNK)
        stop = tl.max(gaps, axis=0)
        clean = stop == 0
        s1 = tl.where(clean, n1, s1)
        s2 = tl.where(clean, n2, s2)
        done += tl.where(clean, CHUNK, 0)
    p11, p12, p21, p22, e1, e2, f = closed_agg7(s1, s2, done, xp, xm, inv_d, log2_f, nlr)
    return p11, p12, p21, p22, e1, e2, f, done
