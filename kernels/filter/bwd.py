"""Exact backward of the fused filter: reverse adjoint walks over the forward's saved states.

The forward writes the filtered centred mean ``mu_t`` and precision ``lam_t`` of every step (its
outputs); the backward reads them back as the state before and after each step (``eta = mu lam``;
before step 0, the initial ``(lam0, eta0)``) and recomputes everything else of the step —
``decay, noise`` from ``theta, sigma, dt``, ``phi, info`` from ``y, obs_var, mean, h``. Nothing
else per step is stored. With cotangents ``g_mu, g_lam, g_pm, g_pv`` of the four outputs, the
adjoints ``(gl, ge)`` of ``(lam_{t-1}, eta_{t-1})`` follow from those of ``(lam_t, eta_t)`` by the
transpose of the scalar recursion (docs/math.md §2; never through the normalised 2x2 products):

    L = gl + g_lam - g_mu mu / lam,     E = ge + g_mu / lam          (totals at step t)
    rho = 1 / (decay^2 + noise lam_p)
    gl' = alpha L + beta E + gamma,     ge' = delta E + eps
    alpha = (decay rho)^2,  beta = -(decay rho)(noise lam_p rho) mu_p,  delta = decay rho,
    gamma = -decay (g_pm mu_p + g_pv decay / lam_p) / lam_p,  eps = g_pm decay / lam_p

and the step's inputs get ``d phi = L``, ``d info = E`` (0 when ``y`` is missing),
``d decay = -2 (decay rho)(lam_p rho) L + mu_p (lam_p rho)(noise lam_p - decay^2) rho E
+ g_pm mu_p + 2 decay g_pv / lam_p`` and ``d noise = -(lam_p rho)^2 (L + decay mu_p E) + g_pv``
(none at step 0, which has no transition). Every factor ``decay rho``, ``noise lam_p rho`` and
``lam_p rho`` is bounded (by ``1/decay``, 1 and ``1/noise``), so nothing cancels or overflows
that the exact derivative does not.

Each cotangent is optional: the kernels take one ``(B, T, C)`` array per output and a
``HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV`` constexpr flag each. An absent one (flag off: the
output was not used) is never read and its terms are not compiled, so a loss on the
log-likelihood alone (``g_pm, g_pv``) or on the mean alone (``g_mu``) reads 8 or 4 bytes of
cotangents per element and pass, not 16.

The map ``(gl, ge) -> (gl', ge')`` is affine with an upper-triangular matrix: five numbers
``(g11, g12, g22, v1, v2)``. Time splits across programs as in the forward: per-stretch maps
(:func:`filter_bwd_agg_kernel`), a reverse scan of them over stretches
(:func:`filter_bwd_carry_kernel`) giving the adjoints entering each stretch from above, then the
walk that writes the gradients (:func:`filter_bwd_kernel`).
"""

import triton
import triton.language as tl

from kalmanscan.kernels.filter.steps import index, lane_setup, load_y, pick, step_inputs


@triton.jit
def compose5(a11, a12, a22, av1, av2, b11, b12, b22, bv1, bv2):
    """Affine maps ``x -> G x + v`` (G upper-triangular 2x2): ``b`` after ``a``."""
    return (b11 * a11, b11 * a12 + b12 * a22, b22 * a22,
            b11 * av1 + b12 * av2 + bv1, b22 * av2 + bv2)


@triton.jit
def _saved_states(k, t, valid, b, c, T, C, mu_ptr, lam_ptr, lam0, mu0, lam_next, mu_next):
    """``(lam_t, mu_t, lam_{t-1}, mu_{t-1})`` from the forward's outputs (initial state at t=0).

    Walking backwards, ``(lam_t, mu_t)`` is the previous iteration's ``(lam_{t-1}, mu_{t-1})``
    (``lam_next, mu_next``), loaded afresh only at the first step of the walk and at ``t = T-1``.
    """
    o = b * T * C + t * C + c
    fresh = valid & ((k == 0) | (t == T - 1))
    lam = tl.where(fresh, tl.load(lam_ptr + o, mask=fresh, other=1.0), lam_next)
    mu = tl.where(fresh, tl.load(mu_ptr + o, mask=fresh, other=0.0), mu_next)
    prev = valid & (t > 0)
    lam_p = tl.where(prev, tl.load(lam_ptr + o - C, mask=prev, other=1.0), lam0)
    mu_p = tl.where(prev, tl.load(mu_ptr + o - C, mask=prev, other=0.0), mu0)
    return lam, mu, lam_p, mu_p


@triton.jit
def _reverse_step(k, L, t0, T, C, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, params, decay_s, noise_s, obs_var_s,
                  mean_s, h_s, mu_ptr, lam_ptr, lam0, mu0, lam_p, mu_p, TRANS_STEP: tl.constexpr,
                  OBS_STEP: tl.constexpr):
    """Step ``k`` of a reverse walk over the stretch from ``t0``: ``(t, valid, decay, noise, observed,
    yc, hr, lam, mu, lam_p, mu_p)``, the step's inputs
    (:func:`kalmanscan.kernels.filter.steps.step_inputs`) and the states after and before it
    (:func:`_saved_states`; ``lam_p, mu_p`` those of the walk's previous step)."""
    t = t0 + L - 1 - k
    valid = lane_ok & (t < T)
    decay, noise, observed, yc, hr, phi, info, obs_var, mean, h = step_inputs(
        t, valid, b, c, load_y(y_ptr, b, t, c, sy_b, sy_t, sy_c, valid),
        params, decay_s, noise_s, obs_var_s, mean_s, h_s, TRANS_STEP, OBS_STEP)
    lam, mu, lam_p, mu_p = _saved_states(k, t, valid, b, c, T, C, mu_ptr, lam_ptr, lam0, mu0, lam_p, mu_p)
    return t, valid, decay, noise, observed, yc, hr, lam, mu, lam_p, mu_p


@triton.jit
def _cotangent(g, o, valid, LOAD: tl.constexpr):
    """``g[o]`` (0 where ``valid`` is off) when ``LOAD``, else ``g`` itself (a value)."""
    if LOAD:
        x = tl.load(g + o, mask=valid, other=0.0)
    else:
        x = g
    return x


@triton.jit
def adjoint_step(gl, ge, lam, mu, lam_p, mu_p, decay, noise, t, o, valid,
                  g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr,
                  HAS_G_MU: tl.constexpr, HAS_G_LAM: tl.constexpr, HAS_G_PM: tl.constexpr,
                  HAS_G_PV: tl.constexpr, LOAD: tl.constexpr = True):
    """Step ``t`` of the reverse walk (module docstring): ``(L, E, gl', ge', d decay, d noise,
    alpha, beta, delta)`` from the adjoints ``(gl, ge)`` of ``(lam_t, eta_t)`` from later steps.

    The cotangents are read at offset ``o`` of ``(B, T, C)`` arrays (masked by ``valid``); one
    whose ``HAS_G_*`` flag is off is never loaded and its terms are not compiled (a zero
    cotangent). Without ``LOAD`` the ``g_*_ptr`` arguments are the cotangents' values instead
    (elementwise with the other inputs; ``o, valid`` unused): :mod:`kalmanscan.kernels.filter.tiles_bwd`
    loads them as blocks. The map ``(gl, ge) -> (gl', ge')`` is affine; with ``decay = 1``,
    ``noise = 0`` and zero cotangents it is exactly the identity.
    """
    inv_lam_p = 1.0 / lam_p
    rho = 1.0 / (decay * decay + noise * lam_p)
    delta = decay * rho
    lr = lam_p * rho
    beta = -delta * (noise * lr) * mu_p
    tot_l = gl
    tot_e = ge
    if HAS_G_LAM:
        tot_l += _cotangent(g_lam_ptr, o, valid, LOAD)
    if HAS_G_MU:
        g_mu_inv_lam = _cotangent(g_mu_ptr, o, valid, LOAD) / lam
        tot_l -= g_mu_inv_lam * mu
        tot_e += g_mu_inv_lam
    gl_next = delta * delta * tot_l + beta * tot_e
    ge_next = delta * tot_e
    d_decay = -2.0 * delta * lr * tot_l + mu_p * lr * (noise * lam_p - decay * decay) * rho * tot_e
    d_noise = -lr * (lr * (tot_l + decay * mu_p * tot_e))  # lr^2 alone would leave the range
    if HAS_G_PM:
        g_pm = _cotangent(g_pm_ptr, o, valid, LOAD)
        eps = g_pm * decay * inv_lam_p
        gl_next -= eps * mu_p
        ge_next += eps
        d_decay += g_pm * mu_p
    if HAS_G_PV:
        g_pv = _cotangent(g_pv_ptr, o, valid, LOAD)
        gl_next -= g_pv * decay * decay * inv_lam_p * inv_lam_p
        d_decay += 2.0 * decay * g_pv * inv_lam_p
        d_noise += g_pv
    moving = t > 0
    return (tot_l, tot_e, gl_next, ge_next, tl.where(moving, d_decay, 0.0), tl.where(moving, d_noise, 0.0),
            delta * delta, beta, delta)


@triton.jit
def emit_gradients(tot_l, tot_e, d_decay, d_noise, observed, yc, hr, o, valid, TC,
                    grad_y_ptr, obs_grad_ptr, trans_grad_ptr, s_phi, s_info, s_info_yc, s_decay, s_noise,
                    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr):
    """Write the gradients of the steps at offsets ``o`` (where ``valid``) from their
    :func:`adjoint_step` totals ``(L, E)`` and transition adjoints; returns the running sums
    ``(s_phi, s_info, s_info_yc, s_decay, s_noise)`` with those steps added where a flag keeps
    them summed (see :func:`filter_bwd_kernel`). ``d phi = L``, ``d info = E`` (0 when missing),
    ``grad_y = E hr``; ``TC = B T C``, the stride of the stacked per-step arrays."""
    d_phi = tl.where(observed, tot_l, 0.0)
    d_info = tl.where(observed, tot_e, 0.0)
    tl.store(grad_y_ptr + o, d_info * hr, mask=valid)
    if OBS_STEP:
        tl.store(obs_grad_ptr + o, d_phi, mask=valid)
        tl.store(obs_grad_ptr + TC + o, d_info, mask=valid)
        tl.store(obs_grad_ptr + 2 * TC + o, d_info * yc, mask=valid)
    else:
        s_phi += tl.where(valid, d_phi, 0.0)
        s_info += tl.where(valid, d_info, 0.0)
        s_info_yc += tl.where(valid, d_info * yc, 0.0)
    if TRANS_STEP:
        tl.store(trans_grad_ptr + o, d_decay, mask=valid)
        tl.store(trans_grad_ptr + TC + o, d_noise, mask=valid)
    else:
        s_decay += tl.where(valid, d_decay, 0.0)
        s_noise += tl.where(valid, d_noise, 0.0)
    return s_phi, s_info, s_info_yc, s_decay, s_noise


@triton.jit
def filter_bwd_agg_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    mu_ptr, lam_ptr, init_ptr, g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr, agg_ptr, T, C, NS, L,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    HAS_G_MU: tl.constexpr, HAS_G_LAM: tl.constexpr, HAS_G_PM: tl.constexpr, HAS_G_PV: tl.constexpr,
    BLOCK: tl.constexpr, WIDE: tl.constexpr, UNROLL: tl.constexpr,
):
    """Each lane's reverse map over its stretch (5 numbers) into ``agg[b, k, s, c]``.

    The map ``x -> G x + v`` is built step by step: ``G`` by the step's upper-triangular matrix,
    ``v`` by the whole step (:func:`adjoint_step` applied to ``v``). Cotangents as in
    :func:`filter_bwd_kernel`.
    """
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    b, g, lane_ok, s, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s = lane_setup(C, NS, L, params, BLOCK, WIDE)
    lam0 = tl.load(init_ptr + b * 2 * C + c, mask=lane_ok, other=1.0)
    mu0 = tl.load(init_ptr + b * 2 * C + C + c, mask=lane_ok, other=0.0) / lam0
    one = tl.full((BLOCK,), 1.0, decay_s.dtype)
    zero = tl.zeros((BLOCK,), decay_s.dtype)
    g11, g12, g22, v1, v2 = one, zero, one, zero, zero
    lam_p, mu_p = one, zero
    for k in tl.range(0, L, loop_unroll_factor=UNROLL):
        t, valid, decay, noise, observed, yc, hr, lam, mu, lam_p, mu_p = _reverse_step(
            k, L, t0, T, C, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, params, decay_s, noise_s, obs_var_s, mean_s,
            h_s, mu_ptr, lam_ptr, lam0, mu0, lam_p, mu_p, TRANS_STEP, OBS_STEP)
        _, _, n1, n2, _, _, alpha, beta, delta = adjoint_step(
            v1, v2, lam, mu, lam_p, mu_p, decay, noise, t, b * T * C + t * C + c, valid,
            g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr, HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV)
        g11 = tl.where(valid, alpha * g11, g11)
        g12 = tl.where(valid, alpha * g12 + beta * g22, g12)
        g22 = tl.where(valid, delta * g22, g22)
        v1 = tl.where(valid, n1, v1)
        v2 = tl.where(valid, n2, v2)
    base = agg_ptr + b * 5 * NS * C + g
    stride = NS * C
    tl.store(base, g11, mask=lane_ok)
    tl.store(base + stride, g12, mask=lane_ok)
    tl.store(base + 2 * stride, g22, mask=lane_ok)
    tl.store(base + 3 * stride, v1, mask=lane_ok)
    tl.store(base + 4 * stride, v2, mask=lane_ok)


@triton.jit
def filter_bwd_carry_kernel(agg_ptr, top_ptr, C, NS, CH: tl.constexpr):
    """Adjoints entering each stretch from above, ``top[b, 0/1, s, c]`` (zero for the last one).

    One program per ``(b, c)``; stretches last to first in chunks of ``CH``, each an inclusive
    ``tl.associative_scan`` of :func:`compose5` (padding is the identity map). ``top`` must hold
    zeros in slot ``NS - 1``.
    """
    pid = tl.program_id(0)
    b = pid // C
    c = pid % C
    tbase = top_ptr + b * 2 * NS * C + c
    abase = agg_ptr + b * 5 * NS * C + c
    stride = NS * C
    idx = tl.arange(0, CH)
    gl = tl.load(tbase + (NS - 1) * C)
    ge = tl.load(tbase + NS * C + (NS - 1) * C)
    for k0 in range(0, NS - 1, CH):
        r = k0 + idx
        m = r < NS - 1
        s = NS - 1 - r
        o = abase + s * C
        g11 = tl.load(o, mask=m, other=1.0)
        g12 = tl.load(o + stride, mask=m, other=0.0)
        g22 = tl.load(o + 2 * stride, mask=m, other=1.0)
        v1 = tl.load(o + 3 * stride, mask=m, other=0.0)
        v2 = tl.load(o + 4 * stride, mask=m, other=0.0)
        g11, g12, g22, v1, v2 = tl.associative_scan((g11, g12, g22, v1, v2), 0, compose5)
        gl_s = g11 * gl + g12 * ge + v1
        ge_s = g22 * ge + v2
        tl.store(tbase + (s - 1) * C, gl_s, mask=m)
        tl.store(tbase + NS * C + (s - 1) * C, ge_s, mask=m)
        last = idx == CH - 1
        gl = pick(gl_s, last)
        ge = pick(ge_s, last)


@triton.jit
def filter_bwd_kernel(
    y_ptr, sy_b, sy_t, sy_c, theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c,
    dt_ptr, sdt_b, sdt_t, sdt_c, obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c,
    h_ptr, sh_b, sh_t, sh_c,
    mu_ptr, lam_ptr, init_ptr, g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr, top_ptr,
    grad_y_ptr, obs_grad_ptr, trans_grad_ptr, sums_ptr, grad_init_ptr,
    B, T, C, NS, L,
    TRANS_STEP: tl.constexpr, OBS_STEP: tl.constexpr,
    HAS_G_MU: tl.constexpr, HAS_G_LAM: tl.constexpr, HAS_G_PM: tl.constexpr, HAS_G_PV: tl.constexpr,
    BLOCK: tl.constexpr, WIDE: tl.constexpr, UNROLL: tl.constexpr,
):
    """Walk each stretch backwards from its ``top`` adjoints and write the gradients.

    The cotangents ``g_mu, g_lam, g_pm, g_pv`` of ``(mu, lam, pred_mu, pred_var)`` are contiguous
    ``(B, T, C)`` arrays, each read only when its ``HAS_G_*`` flag is on (else zero; any pointer).
    ``grad_y[b, t, c] = E hr`` (0 when missing). Observation adjoints ``(d phi, d info,
    d info * yc)`` go per step to ``obs_grad[k, b, t, c]`` when ``OBS_STEP``, else summed over the
    stretch to ``sums[b, k, s, c]`` (k = 0, 1, 2); transition adjoints ``(d decay, d noise)`` per
    step to ``trans_grad[k, b, t, c]`` when ``TRANS_STEP``, else to ``sums[b, 3 + k, s, c]``.
    Lanes of stretch 0 write the initial state's adjoints ``grad_init[b, 0/1, c]``.
    """
    params = (theta_ptr, sth_b, sth_t, sth_c, sigma_ptr, ssg_b, ssg_t, ssg_c, dt_ptr, sdt_b, sdt_t, sdt_c,
              obs_var_ptr, sov_b, sov_t, sov_c, mean_ptr, smn_b, smn_t, smn_c, h_ptr, sh_b, sh_t, sh_c)
    b, g, lane_ok, s, c, t0, decay_s, noise_s, obs_var_s, mean_s, h_s = lane_setup(C, NS, L, params, BLOCK, WIDE)
    lam0 = tl.load(init_ptr + b * 2 * C + c, mask=lane_ok, other=1.0)
    mu0 = tl.load(init_ptr + b * 2 * C + C + c, mask=lane_ok, other=0.0) / lam0
    tbase = top_ptr + b * 2 * NS * C + g
    gl = tl.load(tbase, mask=lane_ok, other=0.0)
    ge = tl.load(tbase + NS * C, mask=lane_ok, other=0.0)
    zero = tl.zeros((BLOCK,), decay_s.dtype)
    s_phi, s_info, s_info_yc, s_decay, s_noise = zero, zero, zero, zero, zero
    lam_p, mu_p = zero + 1.0, zero
    TC = index(B, WIDE) * T * C
    for k in tl.range(0, L, loop_unroll_factor=UNROLL):
        t, valid, decay, noise, observed, yc, hr, lam, mu, lam_p, mu_p = _reverse_step(
            k, L, t0, T, C, b, c, lane_ok, y_ptr, sy_b, sy_t, sy_c, params, decay_s, noise_s, obs_var_s, mean_s,
            h_s, mu_ptr, lam_ptr, lam0, mu0, lam_p, mu_p, TRANS_STEP, OBS_STEP)
        o = b * T * C + t * C + c
        tot_l, tot_e, gl_next, ge_next, d_decay, d_noise, _, _, _ = adjoint_step(
            gl, ge, lam, mu, lam_p, mu_p, decay, noise, t, o, valid,
            g_mu_ptr, g_lam_ptr, g_pm_ptr, g_pv_ptr, HAS_G_MU, HAS_G_LAM, HAS_G_PM, HAS_G_PV)
        s_phi, s_info, s_info_yc, s_decay, s_noise = emit_gradients(
            tot_l, tot_e, d_decay, d_noise, observed, yc, hr, o, valid, TC, grad_y_ptr, obs_grad_ptr,
            trans_grad_ptr, s_phi, s_info, s_info_yc, s_decay, s_noise, TRANS_STEP, OBS_STEP)
        gl = tl.where(valid, gl_next, gl)
        ge = tl.where(valid, ge_next, ge)
    sbase = sums_ptr + b * 5 * NS * C + g
    stride = NS * C
    if not OBS_STEP:
        tl.store(sbase, s_phi, mask=lane_ok)
        tl.store(sbase + stride, s_info, mask=lane_ok)
        tl.store(sbase + 2 * stride, s_info_yc, mask=lane_ok)
    if not TRANS_STEP:
        tl.store(sbase + 3 * stride, s_decay, mask=lane_ok)
        tl.store(sbase + 4 * stride, s_noise, mask=lane_ok)
    first = lane_ok & (s == 0)
    tl.store(grad_init_ptr + b * 2 * C + c, gl, mask=first)
    tl.store(grad_init_ptr + b * 2 * C + C + c, ge, mask=first)
