"""kla_scan: the torch, recurrent, cpu and triton backends against the float64 sequential recursion.

The triton kernels run through the interpreter on CPU (``TRITON_INTERPRET=1``, set in conftest),
which runs the programs of a launch one after another: a test costs about (programs x tokens each
walks). So every program walks at most 63 tokens, breadth comes from the channels and filters a
program holds, and the boundaries (L = 1, 63, a multiple of the chunk and not, several chunks,
several channel blocks with a partial last one, a non-power-of-two S, time split into pieces in the
forward and the backward, an initial state, batch > 1) are spread over the cases as a Latin square
instead of crossed with each other.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from helpers import KERNEL_DEVICE, device_of, max_rel_error
from kla_helpers import make_inputs, outputs_and_grads, poisoned

from kalmanscan.ops.kla import kla_scan
from kalmanscan.ops.kla.recurrent import kla_step
from kalmanscan.ops.kla.reference import kla_scan_sequential
from kalmanscan.ops.kla.triton.library import (DEFAULT_CONFIG, SPLIT_CONFIG, filled, l2_policies, launch_config, pieces,
                                               scratch_elements)
from kalmanscan.ops.kla.triton.backend import KLAConfig, kla_scan_triton

TOL = 2e-5
SMALL = KLAConfig(block_m=4, chunk=8, bwd_block_m=4)        # M = 5: two channel blocks, one partial
WIDE = KLAConfig(block_m=8, chunk=8, bwd_block_m=8)         # M = 5: one channel block
SPLIT = KLAConfig(block_m=4, chunk=4, bwd_block_m=4, pieces=3, bwd_pieces=3)  # time in 3 stretches
# the same launch shapes with each thread holding one channel's states (the [S, M] grid)
SMALL_S, WIDE_S, SPLIT_S = (dataclasses.replace(c, states_first=True) for c in (SMALL, WIDE, SPLIT))


def run_triton(xs, config=SMALL):
    lam0, eta0 = (xs[6], xs[7]) if len(xs) > 6 else (None, None)
    return kla_scan_triton(*xs[:6], lam0, eta0, config=config)


def run_torch(xs, backend="torch"):
    y, y_var, (lam, eta) = kla_scan(*xs[:6], initial_state=tuple(xs[6:]) or None,
                                    return_state=True, backend=backend)
    return y, y_var, lam, eta


def assert_matches(actual, ref, what):
    for i, (a, r) in enumerate(zip(actual, ref)):
        err = max_rel_error(a, r)
        assert err < TOL, f"{what}[{i}]: relative error {err:.2e}"


@pytest.mark.parametrize("backend", ["torch", "recurrent", "cpu"])
@pytest.mark.parametrize("L", [1, 2, 63])
def test_torch_backends_match_sequential(L, backend):
    xs = make_inputs(2, L, 5, 3, seed=L, with_state=True)
    ref = kla_scan_sequential(*xs)
    out = run_torch(xs, backend)
    for a, r in zip(out, ref):
        assert max_rel_error(a, r) < 1e-12


@pytest.mark.parametrize("backend", ["torch", "recurrent", "cpu"])
def test_torch_backends_float32_and_default_state(backend):
    xs = make_inputs(2, 40, 3, 4, seed=3)
    ref = kla_scan_sequential(*xs)
    y, y_var = kla_scan(*(x.float() for x in xs), backend=backend)
    assert y.dtype == torch.float32
    assert_matches((y, y_var), ref[:2], f"float32 {backend}")


@pytest.mark.parametrize("backend", ["torch", "recurrent", "cpu"])
def test_torch_backends_gradcheck(backend):
    xs = [x.requires_grad_() for x in make_inputs(1, 9, 2, 3, seed=4, with_state=True)]

    def fn(*a):
        y, y_var, (lam, eta) = kla_scan(*a[:6], initial_state=(a[6], a[7]), return_state=True,
                                        backend=backend)
        return y, y_var, lam, eta

    assert torch.autograd.gradcheck(fn, xs)


def test_recurrent_backend_values_and_grads_equal_the_parallel_scan():
    """float32, several filters, with an initial state: the two torch backends agree."""
    xs = [x.float() for x in make_inputs(3, 70, 6, 4, seed=13, with_state=True)]
    out, grads = outputs_and_grads(run_torch, xs)
    r_out, r_grads = outputs_and_grads(lambda a: run_torch(a, "recurrent"), xs)
    assert_matches(r_out, out, "recurrent vs torch outputs")
    assert_matches(r_grads, grads, "recurrent vs torch grads")


@pytest.mark.parametrize("B, L, with_state, config", [
    (2, 1, False, SMALL),        # one token
    (1, 24, False, SMALL),       # three whole chunks
    (2, 23, True, SPLIT),        # 3 pieces of 8, 8 and 7 tokens (2 chunks each), forward and backward
    (1, 63, True, WIDE),         # 8 chunks, the last partial
    (1, 24, True, SMALL_S),      # states first: two channel blocks, one partial
    (2, 23, True, SPLIT_S),      # states first, time in 3 stretches forward and backward
    (1, 63, False, WIDE_S),      # states first, one channel block with padding lanes
])
def test_triton_matches_sequential_values_and_grads(B, L, with_state, config):
    """Outputs, final state and every gradient (initial state included) against the float64
    recursion and the torch backend, with every buffer the wrappers allocate poisoned."""
    xs = make_inputs(B, L, 5, 3, seed=10 + L, with_state=with_state, device=KERNEL_DEVICE)
    ref_out, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a), xs)
    xs32 = [x.float() for x in xs]
    with poisoned():
        out, grads = outputs_and_grads(lambda a: run_triton(a, config), xs32)
    assert_matches(out, ref_out, "outputs")
    assert_matches(grads, ref_grads, "grads")
    t_out, t_grads = outputs_and_grads(run_torch, xs32)
    assert_matches(out, t_out, "triton vs torch outputs")
    assert_matches(grads, t_grads, "triton vs torch grads")


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("config", [SPLIT, dataclasses.replace(SPLIT_S, variance=False)])
def test_fast_decay_and_precise_values(backend, config):
    """A regime the other tests do not reach: ``decay^2`` tiny against ``noise lam`` (decay
    0.01-0.05, value precisions 10 to 1e4, as the layer's floor allows), where the precision's
    step is nearly flat and ``rho - noise lam rho^2 = decay^2 rho^2`` a difference of near-equal
    terms: outputs and gradients against the float64 recursion."""
    g = torch.Generator().manual_seed(29)
    B, L, M, S = 2, 37, 5, 4
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g, dtype=torch.float64), dim=-1)  # noqa: E731
    xs = [torch.randn(B, L, M, generator=g, dtype=torch.float64),
          10.0 ** (1.0 + 3.0 * torch.rand(B, L, M, generator=g, dtype=torch.float64)), unit(B, L, S), unit(B, L, S),
          0.01 + 0.04 * torch.rand(M, S, generator=g, dtype=torch.float64),
          0.5 + 1.5 * torch.rand(M, S, generator=g, dtype=torch.float64)]
    xs = [x.to(device_of(backend)) for x in xs]
    variance = backend == "cpu" or config.variance
    ref_out, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a)[:1 + variance], xs)
    if backend == "triton":
        run = lambda a: kla_scan_triton(*a, config=config)[:1 + variance]  # noqa: E731
    else:
        run = lambda a: kla_scan(*a, backend="cpu")[:2]  # noqa: E731
    with poisoned():
        out, grads = outputs_and_grads(run, [x.float() for x in xs])
    assert_matches(out, ref_out, "outputs")
    assert_matches(grads, ref_grads, "grads")


@pytest.mark.parametrize("config", [dataclasses.replace(c, even=True) for c in (
    SMALL, SPLIT, SPLIT_S, dataclasses.replace(SPLIT_S, variance=False))])
def test_triton_full_blocks_run_without_masks(config):
    """M = 8 channels in blocks of 4 and S = 4 states: no padding lanes, so with ``even`` the
    kernels take their unmasked form (``EVEN``), forward, backward and both map passes, against the
    float64 recursion. The launch's own configurations keep the masks."""
    assert filled(8, 4, config.block_m) and filled(8, 4, config.bwd_block_m)
    assert not DEFAULT_CONFIG.even and not SPLIT_CONFIG.even
    xs = make_inputs(2, 23, 8, 4, seed=17, with_state=True, device=KERNEL_DEVICE)
    pick = (lambda out: out) if config.variance else (lambda out: (out[0], *out[2:]))  # noqa: E731
    ref_out, ref_grads = outputs_and_grads(lambda a: pick(kla_scan_sequential(*a)), xs)
    with poisoned():
        out, grads = outputs_and_grads(lambda a: pick(run_triton(a, config)), [x.float() for x in xs])
    assert_matches(out, ref_out, "outputs")
    assert_matches(grads, ref_grads, "grads")


@pytest.mark.parametrize("config", [
    KLAConfig(),                                                   # 2 chunks; 2 backward channel blocks
    KLAConfig(chunk=4, block_m=8, bwd_block_m=16, bwd_pieces=100),  # 2 forward channel blocks; the
    SPLIT_CONFIG,                                                  # backward in 10 pieces of one chunk
    dataclasses.replace(SPLIT_CONFIG, l2_hints=False),             # the caches' default eviction
])
def test_triton_configs_and_power_of_two_state(config):
    xs = make_inputs(1, 37, 9, 4, seed=7, device=KERNEL_DEVICE)
    ref_out, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a), xs)
    with poisoned():
        out, grads = outputs_and_grads(lambda a: run_triton(a, config), [x.float() for x in xs])
    assert_matches(out, ref_out, "outputs")
    assert_matches(grads, ref_grads, "grads")


def test_launch_config_turns_the_grid_where_time_is_split():
    """SPLIT_CONFIG exactly where DEFAULT_CONFIG would split time (few channel-block programs; on a
    CPU the rule counts one multiprocessor), and a default call runs it."""
    cpu = torch.device("cpu")
    assert launch_config(1, 64, 8, cpu) == SPLIT_CONFIG        # one program: time in 4 stretches
    assert launch_config(1, DEFAULT_CONFIG.chunk, 8, cpu) == DEFAULT_CONFIG   # one chunk: nothing to split
    assert launch_config(8, 64, 64, cpu) == DEFAULT_CONFIG     # 32 programs fill one multiprocessor
    if KERNEL_DEVICE == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        want = SPLIT_CONFIG if 128 <= 2 * sms else DEFAULT_CONFIG   # B = 2, 64 blocks of 16 channels
        assert launch_config(2, 8192, 1024, torch.device("cuda")) == want
    xs = [x.float() for x in make_inputs(1, 64, 8, 16, seed=8, device=KERNEL_DEVICE)]
    ref_out, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*(x.double() for x in a)), xs)
    with poisoned():
        out, grads = outputs_and_grads(lambda a: kla_scan_triton(*a), xs)
    assert_matches(out, ref_out, "outputs")
    assert_matches(grads, ref_grads, "grads")


def test_backward_keeps_its_scratch_in_l2():
    """Both launch layouts give the backward's scratch the evict-last priority and the data it uses
    once evict-first; ``l2_hints=False`` leaves the caches' defaults (both run against float64 in
    ``test_triton_configs_and_power_of_two_state``)."""
    assert DEFAULT_CONFIG.l2_hints and SPLIT_CONFIG.l2_hints
    assert l2_policies(SPLIT_CONFIG) == {"KEEP": "evict_last", "STREAM": "evict_first"}
    assert l2_policies(dataclasses.replace(SPLIT_CONFIG, l2_hints=False)) == {"KEEP": "", "STREAM": ""}


def test_default_split_aims_at_programs_per_multiprocessor():
    """``pieces(None, ...)`` cuts time into ``per_sm x SMs / programs`` whole chunks where there
    are at most ``2 x SMs`` programs (on a CPU one multiprocessor), and the split layout's backward
    aims at one wave of its programs (8 a multiprocessor, where 12 fit)."""
    cpu = torch.device("cpu")
    assert pieces(None, 16, 32, 1, 1024, 16, cpu) == (8, 128)             # 8 a multiprocessor
    assert pieces(None, 16, 32, 1, 1024, 16, cpu, per_sm=16) == (16, 64)
    assert pieces(None, 16, 32, 1, 100, 16, cpu, per_sm=16) == (4, 32)    # at most one a chunk
    assert pieces(None, 16, 32, 1, 1024, 48, cpu) == (1, 1024)            # 3 programs: no split
    assert pieces(5, 16, 32, 1, 1024, 48, cpu) == (5, 224)                # asked for: whole chunks
    assert (DEFAULT_CONFIG.bwd_per_sm, SPLIT_CONFIG.bwd_per_sm) == (16, 8)


def test_backward_scratch_of_the_model_shapes_fits_l2(monkeypatch):
    """The backward's recompute scratch (``CHUNK x bwd_block_m x S`` floats of ``lam`` and ``eta`` a
    program) of all its programs at the model's shapes, split as on a 132-multiprocessor H100, stays
    within 40 MB, inside the 50 MB L2 (at 32-token chunks the split layout's was 64 MB, and the step
    slower)."""
    h100 = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h100)
    cuda = torch.device("cuda")
    M, S = 1024, 16
    for B, L, want in ((2, 8192, SPLIT_CONFIG), (8, 2048, DEFAULT_CONFIG)):
        config = launch_config(B, L, M, cuda)
        assert config == want
        n_pieces = pieces(config.bwd_pieces, config.bwd_block_m, config.chunk, B, L, M, cuda, config.bwd_per_sm)[0]
        scratch = 2 * 4 * scratch_elements(config, B, M, S, n_pieces)       # lam and eta, float32
        assert scratch <= 40 * 2**20, (config, scratch / 2**20)


@pytest.mark.parametrize("backend", ["reference", "torch", "recurrent", "cpu", "triton"])
def test_split_and_carry(backend):
    xs = make_inputs(2, 29, 5, 3, seed=21, device=device_of(backend))
    xs = [x.float() for x in xs]
    full = kla_scan(*xs, return_state=True, backend=backend)
    cut = 13
    head = [x[:, :cut] for x in xs[:4]] + xs[4:]
    tail = [x[:, cut:] for x in xs[:4]] + xs[4:]
    y1, v1, state = kla_scan(*head, return_state=True, backend=backend)
    y2, v2, (lam, eta) = kla_scan(*tail, initial_state=state, return_state=True, backend=backend)
    assert_matches((torch.cat([y1, y2], 1), torch.cat([v1, v2], 1), lam, eta),
                   (full[0], full[1], *full[2]), "split and carry")


def test_triton_without_grad_and_half_inputs():
    xs = make_inputs(2, 17, 5, 3, seed=6, device=KERNEL_DEVICE)
    ref = kla_scan_sequential(*xs)
    with torch.no_grad():
        y, y_var = kla_scan(*(x.float() for x in xs), backend="triton")
    assert_matches((y, y_var), ref[:2], "no-grad outputs")
    xb = [x.to(torch.bfloat16) for x in xs[:4]] + [x.float() for x in xs[4:]]
    ref_b = kla_scan_sequential(*xb)
    for backend in ("torch", "recurrent", "cpu", "triton"):
        yb, y_varb = kla_scan(*(x.to(device_of(backend)) for x in xb), backend=backend)
        assert yb.dtype == torch.bfloat16 and y_varb.dtype == torch.bfloat16
        assert max_rel_error(yb, ref_b[0]) < 1e-2
        assert max_rel_error(y_varb, ref_b[1]) < 1e-2


@pytest.mark.parametrize("backend", ["torch", "recurrent", "cpu", "triton", "reference"])
def test_empty_sequence_returns_the_initial_state(backend):
    xs = [x.float() for x in make_inputs(2, 0, 3, 2, seed=2, with_state=True, device=device_of(backend))]
    y, y_var, (lam, eta) = kla_scan(*xs[:6], initial_state=(xs[6], xs[7]), return_state=True,
                                    backend=backend)
    assert y.shape == y_var.shape == (2, 0, 3)
    assert torch.equal(lam.to(xs[6].dtype), xs[6]) and torch.equal(eta.to(xs[7].dtype), xs[7])
    before = xs[6].clone()
    lam.mul_(2)  # new tensors: writing the returned state leaves the caller's as it was
    assert torch.equal(xs[6], before)
    _, _, state = kla_scan(*xs[:6], return_state=True, backend=backend)
    state.var.fill_(7.0)  # the default state's four tensors do not alias each other
    assert torch.all(state[0] == 1) and torch.all(state.mu == 0)


def test_auto_backend_on_cpu_is_the_compiled_loops():
    xs = [x.float() for x in make_inputs(1, 3, 4, 16, seed=8)]
    for a, b in zip(kla_scan(*xs), kla_scan(*xs, backend="cpu")):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="backend='cpu' needs CPU tensors"):
        kla_scan(*(x.to("meta") for x in xs), backend="cpu")


@pytest.mark.parametrize("index, bad, name", [
    (1, lambda x: -x, "lam_v"),
    (4, lambda x: x + 1.0, "decay"),
    (4, lambda x: 0.0 * x, "decay"),
    (5, lambda x: -x, "noise"),
    (0, lambda x: x[:, :, :-1], "lam_v"),
    (3, lambda x: x[:, :-1], "q"),
    (2, lambda x: x[..., :-1], "q"),
    (5, lambda x: x[:-1], "noise"),
    (0, lambda x: x[0], "v"),
])
def test_bad_inputs_raise(index, bad, name):
    xs = [x.float() for x in make_inputs(1, 5, 3, 2, seed=9)]
    xs[index] = bad(xs[index])
    with pytest.raises(ValueError, match=name):
        kla_scan(*xs)


def test_bad_backend_and_state_raise():
    xs = [x.float() for x in make_inputs(1, 5, 3, 2, seed=9)]
    with pytest.raises(ValueError, match="backend"):
        kla_scan(*xs, backend="cuda")
    with pytest.raises(ValueError, match="initial_state"):
        kla_scan(*xs, initial_state=(torch.ones(1, 3, 2),))
    with pytest.raises(ValueError, match="initial_state lam"):
        kla_scan(*xs, initial_state=(-torch.ones(1, 3, 2), torch.zeros(1, 3, 2)))


@pytest.mark.parametrize("backend", ["torch", "recurrent", "cpu", "triton"])
def test_no_process_noise_stays_finite(backend):
    """noise = 0 (the GLA limit): the exact precision grows like decay^(-2t), past float32's range
    within this sequence; y and y_var and all gradients must stay finite and exact. The triton
    backend hands such filters to the torch one.

    The noise gradient is checked against one-sided finite differences of the float64 recursion:
    that recursion's own autograd loses it to cancellation between terms of size lam^2 (4e19
    instead of -20.6 at L = 120 in a one-filter case, where finite differences of both forward
    passes agree on -20.6459 to 6 digits).
    """
    dev = device_of(backend)
    xs = make_inputs(2, 120, 3, 4, seed=9, device=dev)
    xs[4] = 0.2 + 0.6 * torch.rand(3, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dev)
    xs[5] = torch.zeros(3, 4, dtype=torch.float64, device=dev)
    ref_out, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a)[:2], xs)
    out, grads = outputs_and_grads(lambda a: kla_scan(*a, backend=backend), [x.float() for x in xs])
    for got in out + grads:
        assert torch.isfinite(got).all()
    assert_matches(out, ref_out, "outputs")
    assert_matches(grads[:5], ref_grads[:5], "gradients")
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(dev) for o in ref_out]

    def functional(noise):
        y, y_var = kla_scan_sequential(*xs[:5], noise)[:2]
        return float((y * weights[0]).sum() + (y_var * weights[1]).sum())

    h = 1e-8
    base = functional(xs[5])
    fd = torch.zeros(3, 4, dtype=torch.float64, device=dev)
    for i in range(3):
        for j in range(4):
            bumped = xs[5].clone()
            bumped[i, j] = h
            fd[i, j] = (functional(bumped) - base) / h
    assert max_rel_error(grads[5], fd) < TOL  # measured 1.4e-7 (float32), 2e-8 (float64: the FD error)


def noiseless_inputs(B, L, M, S, seed, dtype, device="cpu"):
    """Inputs without process noise whose decays span [0.2, 0.95]: the exact precision of the
    fastest-decaying filters leaves float32's range within 30 tokens and float64's within 230."""
    xs = make_inputs(B, L, M, S, seed=seed, dtype=dtype, device=device)
    xs[4] = torch.linspace(0.2, 0.95, M * S, dtype=dtype, device=device).reshape(M, S)
    xs[5] = torch.zeros_like(xs[4])
    return xs


def split(xs, cut):
    head = [x[:, :cut] for x in xs[:4]] + xs[4:]
    tail = [x[:, cut:] for x in xs[:4]] + xs[4:]
    return head, tail


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["torch", "recurrent", "cpu", "triton"])
def test_no_process_noise_state_continues(dtype, backend):
    """noise = 0 past the overflow of the precision: the returned state carries the variance and
    the mean, so the split scan continues it exactly; its pair ``(lam, eta)`` equals the float64
    recursion where that is in range and is inf, never NaN, where the exact precision is not."""
    xs = noiseless_inputs(2, 300, 3, 4, seed=11, dtype=dtype, device=device_of(backend))
    y, y_var, state = kla_scan(*xs, return_state=True, backend=backend)
    head, tail = split(xs, 250)
    y1, v1, mid = kla_scan(*head, return_state=True, backend=backend)
    y2, v2, end = kla_scan(*tail, initial_state=mid, return_state=True, backend=backend)
    assert_matches((torch.cat([y1, y2], 1), torch.cat([v1, v2], 1), end.var, end.mu),
                   (y, y_var, state.var, state.mu), "split and carry without process noise")
    lam, eta = state
    lam_ref, eta_ref = kla_scan_sequential(*xs)[2:]       # NaN once past float64's range
    finite = torch.isfinite(lam)
    assert finite.any() and not finite.all()
    assert not (lam_ref[~finite] <= torch.finfo(dtype).max).any()
    # inf exactly where 1 / var overflows: var is 0 or, on the recurrent backend, subnormal
    assert not torch.isnan(eta).any() and (state.var[~finite] <= 1 / torch.finfo(dtype).max).all()
    assert max_rel_error(lam[finite] / lam_ref[finite], torch.ones(int(finite.sum()), device=lam.device)) < TOL
    assert_matches((eta[finite],), (eta_ref[finite],), "eta in range")


def test_no_process_noise_state_gradcheck():
    """Gradients through a state carried past float64's overflow of the precision (noise = 0)."""
    xs = noiseless_inputs(1, 260, 1, 2, seed=12, dtype=torch.float64)

    def fn(v, lam_v, k, q, decay):
        first = kla_scan(v[:, :250], lam_v[:, :250], k[:, :250], q[:, :250], decay, xs[5],
                         return_state=True, backend="torch")
        y, y_var, end = kla_scan(v[:, 250:], lam_v[:, 250:], k[:, 250:], q[:, 250:], decay, xs[5],
                                 initial_state=first[2], return_state=True, backend="torch")
        assert (first[2].var == 0).any()
        return first[0], first[1], y, y_var, end.var, end.mu

    args = [x.requires_grad_() for x in xs[:5]]
    assert torch.autograd.gradcheck(fn, args, fast_mode=True)


def test_mean_step_is_affine_in_the_mean_with_gate_in_zero_decay():
    """Given the variance, one token maps the mean affinely, ``mu <- g mu + c`` with ``0 <= g <=
    decay``: the diagonal, input-gated class of GLA and Mamba (docs/results.md, A5)."""
    g = torch.Generator().manual_seed(5)
    B, M, S = 3, 4, 5
    r = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    v = torch.randn(B, M, generator=g, dtype=torch.float64)
    lam_v, k, q = 10 * r(B, M), r(B, S), r(B, S)
    decay, noise, var = r(M, S), torch.cat([torch.zeros(M, 1), r(M, S - 1)], 1).double(), r(B, M, S)
    mu0, mu1 = (torch.randn(B, M, S, generator=g, dtype=torch.float64) for _ in range(2))
    step = lambda mu: kla_step(v, lam_v, k, q, decay, noise, var, mu)[3]  # noqa: E731
    base = step(torch.zeros_like(mu0))
    gate = (step(mu1) - step(mu0)) / (mu1 - mu0)
    torch.testing.assert_close(step(mu0), base + gate * mu0, rtol=1e-12, atol=1e-12)
    assert (gate >= 0).all() and (gate <= decay + 1e-15).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy on the overflowing kernels
def test_kernels_launched_before_the_checks_are_read(monkeypatch):
    """On a GPU the public call launches the fused kernels before reading its checks: the same
    result, a bad value still raises naming its argument, and filters needing the mean form get
    the torch backend's result (here under the interpreter, the launch order forced)."""
    from kalmanscan.ops.kla import dispatch

    xs = [x.float() for x in make_inputs(1, 9, 3, 2, seed=4, device=KERNEL_DEVICE)]
    plain = kla_scan(*xs, backend="triton")
    monkeypatch.setattr(dispatch, "_launch_first", lambda v: True)
    for a, b in zip(kla_scan(*xs, backend="triton"), plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    bad = list(xs)
    bad[1] = -bad[1]
    with pytest.raises(ValueError, match="lam_v"):
        kla_scan(*bad, backend="triton")
    quiet = list(xs)
    quiet[5] = torch.zeros_like(quiet[5])
    for a, b in zip(kla_scan(*quiet, backend="triton"), kla_scan(*quiet, backend="torch")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
def test_checks_beside_the_kernels_see_the_inputs_just_made():
    """The checks run on a stream beside the kernels': they wait for inputs still being computed
    on the caller's stream (behind a long matrix product), and the call returns only once they
    are read, with the caller's stream current again."""
    xs = [x.float() for x in make_inputs(2, 300, 64, 16, seed=9, device="cuda")]
    plain = kla_scan(*xs, backend="triton")
    for sign, raises in ((1.0, False), (-1.0, True)):
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            busy = busy @ busy / 64.0
        lam_v = xs[1] * sign + 0.0 * busy[0, 0]      # made on the caller's stream after the products
        stream = torch.cuda.current_stream()
        if raises:
            with pytest.raises(ValueError, match="lam_v"):
                kla_scan(xs[0], lam_v, *xs[2:], backend="triton")
        else:
            for a, b in zip(kla_scan(xs[0], lam_v, *xs[2:], backend="triton"), plain):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert torch.cuda.current_stream() == stream


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_form_exactly_when_a_decaying_filter_lacks_noise(dtype):
    """``validate`` asks for the mean form when a filter with ``decay < 1`` has noise below the
    bound, or an initial variance is below it; not for a noise-free filter with ``decay = 1``."""
    from kalmanscan.model import mobius
    from kalmanscan.ops.kla import dispatch
    from kalmanscan.ops.kla.state import FilterState

    v, lam_v, k, q, decay, noise = [x.to(dtype) for x in make_inputs(2, 5, 3, 2, seed=6)[:6]]
    bound = mobius.noise_bound(dtype)
    check = lambda d, n, s=None: dispatch.validate(v, lam_v, k, q, d, n, s, "torch")  # noqa: E731
    assert not check(decay, noise)
    steady, quiet = decay.clone(), noise.clone()
    steady[1, 0], quiet[1, 0] = 1.0, 0.0
    assert not check(steady, quiet)          # the noise-free filter does not decay
    assert check(decay, quiet)               # it decays
    quiet[1, 0] = bound / 2
    assert check(decay, quiet) and not check(steady, quiet)
    var = torch.ones(2, 3, 2, dtype=dtype)
    state = lambda: FilterState(1 / var, torch.zeros_like(var), var=var, mu=torch.zeros_like(var))  # noqa: E731
    assert not check(decay, noise, state())
    var[0, 2, 1] = bound / 2
    assert check(decay, noise, state())
