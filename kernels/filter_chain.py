"""Single-pass forward of the information-form filter for many series: a chained scan over stretches
with decoupled look-back.

The three-kernel forward of :mod:`kernels.filter_fwd` reads ``y`` twice from device memory (the
aggregate pass, then the apply pass after the carry scan). Here one kernel does both for each
(batch row, stretch ``s``, block of ``BLOCK`` channels), meant for stretches short enough (tens of
steps) that the second read of ``y`` finds it in L2. Measured on an H200 (docs/performance.md) it
is correct but no faster (0.649 against 0.658 ms at C = 4096, T = 32768 with stretches of 64; 32
and fewer steps are slower): opt-in through ``kalmanscan.fused.CHAIN``. Per program:

1. walk the stretch composing its map (:func:`kernels.filter_fwd.stretch_product`: the merged
   homogeneous form, 7 numbers per channel, trace 1), store it in ``agg[b, k, s, c]`` and raise
   the stretch's flag to 1 (*aggregate ready*);
2. look back over the earlier stretches: from ``s - 1`` down, a stretch whose flag is 2 (*state
   after it ready*) ends the search with its ``start[b, :, k + 1, c]``; one whose flag is 1 has its
   map composed into the running product and the search moves on; 0 is waited for. Slot 0 of
   ``start`` holds the initial state (no flag needed). The entering state is the running product
   read out at that state (the projective read-out of :mod:`kernels.filter_fwd`);
3. store the state after the stretch in ``start[b, :, s + 1, c]`` and raise the flag to 2;
4. walk the stretch again from the entering state writing the outputs
   (:func:`kernels.filter_fwd.walk_outputs`).

Programs take their tile from an atomic ticket, stretch-major, so every stretch a program waits for
belongs to a program that started before it and is resident: no deadlock whatever order the
hardware launches programs in. Flags are written with release semantics after a barrier (every
thread's stores of the stretch's values are done) and read with acquire semantics; the values
behind them are loaded past L1 (``.cg``). ``PUBLISH`` (a test knob, 1 in production) raises flag 2
only on stretches ``s`` with ``s % PUBLISH == PUBLISH - 1``, so the look-back composes aggregates
even where programs run one after another (the interpreter).
"""

import triton
import triton.language as tl

from .filter_fwd import _compose7, read_out7, store7, stretch_product, walk_outputs
from .filter_steps import index, static_inputs


@triton.jit
def _load7(ptr, stride):
    """The 7 numbers at ``ptr + k stride``, read past L1 (written by another program)."""
    return (tl.load(ptr, cache_modifier=".cg"), tl.load(ptr + stride, cache_modifier=".cg"),
            tl.load(ptr + 2 * stride, cache_modifier=".cg"), tl.load(ptr + 3 * stride, cache_modifier=".cg"),
            tl.load(ptr + 4 * stride, cache_modifier=".cg"), tl.load(ptr + 5 * stride, cache_modifier=".cg"),
            tl.load(ptr + 6 * stride, cache_modifier=".cg"))


@triton.jit
def filter_chain_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    agg_ptr, start_ptr, flag_ptr, ticket_ptr, mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr,
    var_ptr, pred_prec_ptr, pred_obs_mean_ptr, pred_obs_var_ptr, loglik_ptr, missing_ptr,
    B, T, C, NS, L, NCB,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    WRITE_MU: tl.constexpr, WRITE_LAM: tl.constexpr, WRITE_PRED: tl.constexpr, POSTERIOR: tl.constexpr,
    BLOCK: tl.constexpr, WIDE: tl.constexpr, UNROLL: tl.constexpr, PREFETCH: tl.constexpr,
    PUBLISH: tl.constexpr,
):
    """One (batch row, stretch, channel block) of the chained forward; outputs as
    :func:`kernels.filter_fwd.filter_fwd_kernel`. ``agg`` is ``(B, 7, NS, C)``, ``start``
    ``(B, 2, NS + 1, C)`` with slot 0 the initial state, ``flag`` ``(B, NS, NCB)`` int32 zeros,
    ``ticket`` one int32 zero."""
    ticket = tl.atomic_add(ticket_ptr, 1)
    s = ticket // (B * NCB)
    cb = ticket % NCB
    b = index((ticket // NCB) % B, WIDE)
    c = cb * BLOCK + tl.arange(0, BLOCK)
    lane_ok = c < C
    t0 = index(s + tl.zeros((BLOCK,), tl.int32), WIDE) * L   # per lane, as the walks' helpers take it
    decay_s, noise_s, obs_var_s, mean_s, h_s = static_inputs(
        t0, lane_ok, b, c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
        dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
        h_ptr, sh_b, sh_t, sh_c)
    p11, p12, p21, p22, e1, e2, f = stretch_product(
        t0, L, T, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c,
        sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c,
        mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c, decay_s, noise_s, obs_var_s, mean_s, h_s,
        TRANS_STEP, OBS_STEP, BLOCK, UNROLL, PREFETCH)
    stride = NS * C
    abase = agg_ptr + b * 7 * stride + c
    flags = flag_ptr + (b * NS) * NCB + cb
    if s != NS - 1:
        store7(abase + s * C, stride, p11, p12, p21, p22, e1, e2, f, lane_ok)
        tl.debug_barrier()
        tl.atomic_xchg(flags + s * NCB, 1, sem="release")
    # look back: q maps the state entering stretch k + 1 to the state entering stretch s
    one = tl.full((BLOCK,), 1.0, decay_s.dtype)
    zero = tl.zeros((BLOCK,), decay_s.dtype)
    q11, q12, q21, q22, g1, g2, h = one, zero, zero, one, zero, zero, one
    k = s - 1
    searching = k >= 0
    while searching:
        state = tl.atomic_add(flags + k * NCB, 0, sem="acquire")
        if state == 1:
            a11, a12, a21, a22, a1, a2, af = _load7(tl.where(lane_ok, abase + k * C, agg_ptr), stride)
            q11, q12, q21, q22, g1, g2, h = _compose7(a11, a12, a21, a22, a1, a2, af,
                                                      q11, q12, q21, q22, g1, g2, h)
            k = k - 1
        searching = (state != 2) & (k >= 0)
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
    walk_outputs(
        lam, eta, t0, L, T, C, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c,
        sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c,
        mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c, decay_s, noise_s, obs_var_s, mean_s, h_s,
        mu_ptr, lam_ptr, pred_mu_ptr, pred_var_ptr, var_ptr, pred_prec_ptr, pred_obs_mean_ptr,
        pred_obs_var_ptr, loglik_ptr, missing_ptr, TRANS_STEP, OBS_STEP,
        WRITE_MU, WRITE_LAM, WRITE_PRED, POSTERIOR, UNROLL, PREFETCH)
