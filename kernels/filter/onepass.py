"""Single-pass forward of the filter for many series: each stretch of ``y`` read once, held in
registers, with a decoupled look-back over the stretches.

The three-kernel forward of :mod:`kalmanscan.kernels.filter.fwd` reads ``y`` twice from device
memory (its aggregate pass, then its apply pass after the carry scan): 16 bytes per element
moved for the 12 of the mean and precision. Here one program per (stretch ``s`` of ``R`` steps,
batch row, block of ``BLOCK`` channels)

1. loads its ``R`` rows of ``y`` at once (``R`` loads of ``[BLOCK]`` issued together, kept in
   registers as a tuple: :func:`load_stretch`);
2. composes its stretch's map from those registers (the merged form of
   :mod:`kalmanscan.kernels.filter.fwd`, 7 numbers per channel, trace 1), stores it in
   ``agg[b, k, s, c]`` and raises its flag to 1 (*map ready*);
3. looks back over the earlier stretches, ``W`` flags at a time (:func:`look_back`): from ``s - 1``
   down, a flag of 2 (*state after it ready*) ends the search with ``start[b, :, k + 1, c]``; the
   maps of the stretches with a flag of 1 before it are composed into the running product; a 0
   is waited for. Slot 0 of ``start`` holds the initial state. The entering state is the product
   read out at that state;
4. stores the state after its stretch in ``start[b, :, s + 1, c]`` and raises its flag to 2;
5. walks its stretch again from the entering state, from the same registers, writing the
   outputs (:func:`kalmanscan.kernels.filter.steps.emit_step`): ``y`` is read once.

Programs take their work from an atomic ticket, stretch-major, so a stretch a program waits for
belongs to a program that started before it and is resident: no deadlock whatever order the
hardware starts programs in. Flags are written with release semantics after a barrier (every
thread's stores are done) and read with acquire semantics; the values behind them are loaded
past L1 (``.cg``). ``PUBLISH`` (a test knob, 1 in production) raises flag 2 only on stretches
with ``s % PUBLISH == PUBLISH - 1``, so that the look-back composes maps even where programs run
one after another (the interpreter). The per-step arithmetic is the walks' (same helpers), so
the outputs equal the three-kernel forward's up to the rounding of the stretch products.
"""

import triton
import triton.language as tl

from .fwd import compose7, last7, output_step, product_step, read_out7, store7
from .steps import index, load_y, static_inputs


@triton.jit
def load_stretch(y_ptr, b, t0, c, sy_b, sy_t, sy_c, lane_ok, T, R: tl.constexpr):
    """``y`` at steps ``t0 .. t0 + R - 1`` as a tuple of ``R`` ``[BLOCK]`` vectors (NaN past ``T``),
    every load issued before any is used."""
    ys = ()
    for i in tl.static_range(R):
        ys = ys + (load_y(y_ptr, b, t0 + i, c, sy_b, sy_t, sy_c, lane_ok & (t0 + i < T)),)
    return ys


@triton.jit
def _scan7(a11, a12, a21, a22, a1, a2, af, b11, b12, b21, b22, b1, b2, bf):
    """Combine of the look-back's scan over a window ordered from later to earlier stretches:
    the accumulated (later) map ``a`` after the next (earlier) one ``b``."""
    return compose7(b11, b12, b21, b22, b1, b2, bf, a11, a12, a21, a22, a1, a2, af)


@triton.jit
def look_back(flags, abase, agg_ptr, stride, s, C, NCB, lane_ok, one, zero, BLOCK: tl.constexpr, W: tl.constexpr):
    """The stretch ``k < s`` whose published state ends the look-back (-1: the initial state) and
    the product ``q`` of the maps of stretches ``k + 1 .. s - 1`` (7 numbers per lane).

    Reads the flags of ``W`` earlier stretches at once (acquire): stretches before 0 count as
    published (slot 0 of ``start``). When every flag up to the nearest published state (2) is
    set, the maps of the stretches before it (flag 1) are loaded as ``[W, BLOCK]`` tiles and
    composed by one scan; with no published state in the window all ``W`` maps are composed and
    the window moves back; a flag still 0 before it means reading the window again."""
    j = tl.arange(0, W)
    q11, q12, q21, q22, g1, g2, h = one, zero, zero, one, zero, zero, one
    k = s - 1
    searching = k >= 0
    while searching:
        ks = k - j
        fl = tl.atomic_add(flags + ks * NCB, tl.zeros((W,), tl.int32), sem="acquire", mask=ks >= 0)
        fl = tl.where(ks >= 0, fl, 2)
        first2 = tl.min(tl.where(fl == 2, j, W), axis=0)
        first0 = tl.min(tl.where(fl == 0, j, W), axis=0)
        if first0 >= first2:
            m = (j < first2)[:, None] & lane_ok[None, :]
            o = tl.where(m, abase[None, :] + ks[:, None] * C, agg_ptr)
            a11, a12, a21, a22, a1, a2, af = tl.associative_scan(
                (tl.load(o, mask=m, other=1.0, cache_modifier=".cg"),
                 tl.load(o + stride, mask=m, other=0.0, cache_modifier=".cg"),
                 tl.load(o + 2 * stride, mask=m, other=0.0, cache_modifier=".cg"),
                 tl.load(o + 3 * stride, mask=m, other=1.0, cache_modifier=".cg"),
                 tl.load(o + 4 * stride, mask=m, other=0.0, cache_modifier=".cg"),
                 tl.load(o + 5 * stride, mask=m, other=0.0, cache_modifier=".cg"),
                 tl.load(o + 6 * stride, mask=m, other=1.0, cache_modifier=".cg")), 0, _scan7)
            w11, w12, w21, w22, w1, w2, wf = last7(a11, a12, a21, a22, a1, a2, af, (j == W - 1)[:, None])
            q11, q12, q21, q22, g1, g2, h = compose7(w11, w12, w21, w22, w1, w2, wf, q11, q12, q21, q22, g1, g2, h)
            k = k - first2
            searching = first2 == W
    return k, q11, q12, q21, q22, g1, g2, h


@triton.jit
def filter_onepass_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    agg_ptr, start_ptr, flag_ptr, mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr,
    var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr,
    B, T, C, NS, NCB,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr,
    BLOCK: tl.constexpr, WIDE: tl.constexpr, R: tl.constexpr, PUBLISH: tl.constexpr, W: tl.constexpr,
    loglik_sum_ptr=None, SUM_LOGLIK: tl.constexpr = False,
):
    """One (stretch, batch row, channel block); outputs as
    :func:`kalmanscan.kernels.filter.fwd.filter_fwd_kernel`'s. ``agg`` is ``(B, 7, NS, C)``,
    ``start`` ``(B, 2, NS + 1, C)`` with slot 0 the initial state; ``flag`` is ``1 + B NS NCB``
    int32 zeros: the ticket counter, then the flags ``[b, s, cb]``. With ``SUM_LOGLIK`` the
    stretch's log-likelihoods summed in float64 go to ``loglik_sum[b, s, c]`` (``(B, NS, C)``)."""
    ticket = tl.atomic_add(flag_ptr, 1)
    s = ticket // (B * NCB)
    cb = ticket % NCB
    b = index((ticket // NCB) % B, WIDE)
    c = cb * BLOCK + tl.arange(0, BLOCK)
    lane_ok = c < C
    t0 = index(s + tl.zeros((BLOCK,), tl.int32), WIDE) * R  # per lane, as the walks' helpers take it
    decay_s, noise_s, obs_var_s, mean_s, h_s = static_inputs(
        t0, lane_ok, b, c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
        dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
        h_ptr, sh_b, sh_t, sh_c)
    ys = load_stretch(y_ptr, b, t0, c, sy_b, sy_t, sy_c, lane_ok, T, R)
    one = tl.full((BLOCK,), 1.0, decay_s.dtype)
    zero = tl.zeros((BLOCK,), decay_s.dtype)
    stride = NS * C
    abase = agg_ptr + b * 7 * stride + c
    flags = flag_ptr + 1 + (b * NS) * NCB + cb
    p11, p12, p21, p22, e1, e2, f = one, zero, zero, one, zero, zero, one
    if s != NS - 1:  # the last stretch's map is never looked at
        for i in tl.static_range(R):
            t = t0 + i
            p11, p12, p21, p22, e1, e2, f = product_step(
                p11, p12, p21, p22, e1, e2, f, t, lane_ok & (t < T), b, c, ys[i],
                theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
                dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
                h_ptr, sh_b, sh_t, sh_c, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
        store7(abase + s * C, stride, p11, p12, p21, p22, e1, e2, f, lane_ok)
        tl.debug_barrier()
        tl.atomic_xchg(flags + s * NCB, 1, sem="release")
    k, q11, q12, q21, q22, g1, g2, h = look_back(flags, abase, agg_ptr, stride, s, C, NCB, lane_ok, one, zero,
                                                 BLOCK, W)
    sstride = (NS + 1) * C
    sbase = start_ptr + b * 2 * sstride + c
    lam0 = tl.load(sbase + (k + 1) * C, mask=lane_ok, other=1.0, cache_modifier=".cg")
    eta0 = tl.load(sbase + sstride + (k + 1) * C, mask=lane_ok, other=0.0, cache_modifier=".cg")
    lam, eta = read_out7(q11, q12, q21, q22, g1, g2, h, lam0, eta0)
    if s != NS - 1:
        if s % PUBLISH == PUBLISH - 1:
            lam1, eta1 = read_out7(p11, p12, p21, p22, e1, e2, f, lam, eta)
            tl.store(sbase + (s + 1) * C, lam1, mask=lane_ok)
            tl.store(sbase + sstride + (s + 1) * C, eta1, mask=lane_ok)
            tl.debug_barrier()
            tl.atomic_xchg(flags + s * NCB, 2, sem="release")
    out = b * T * C + c
    total = tl.zeros((BLOCK,), tl.float64)
    for i in tl.static_range(R):
        t = t0 + i
        lam, eta, total = output_step(
            lam, eta, total, t, lane_ok & (t < T), b, c, ys[i], out + t * C,
            theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
            dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
            h_ptr, sh_b, sh_t, sh_c, decay_s, noise_s, obs_var_s, mean_s, h_s,
            mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
            pred_obs_var_ptr, loglik_ptr, missing_ptr, TRANS_STEP, OBS_STEP,
            WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR, SUM_LOGLIK)
    if SUM_LOGLIK:
        tl.store(loglik_sum_ptr + (b * NS + s) * C + c, total, mask=lane_ok)
