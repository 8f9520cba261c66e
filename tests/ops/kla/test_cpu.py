"""The KLA scan's ``"cpu"`` backend (compiled loops) against the float64 sequential recursion.

Chunk boundaries (the backward recomputes stretches of ``CHUNK`` tokens), channel blocks (tasks of
``BLOCK`` channels, the last one partial), every gradient including the initial state's, buffers
poisoned with NaN, thread counts, the operators' registrations and the backend's refusals.
"""

from __future__ import annotations

import numba
import pytest
import torch
from helpers import max_rel_error
from kla_helpers import make_inputs, outputs_and_grads, poisoned

from kalmanscan.tuning import tuned
from kalmanscan.ops.kla import kla_scan
from kalmanscan.ops.kla.cpu import backend as cpu
from kalmanscan.ops.kla.cpu.loops import BLOCK
from kalmanscan.ops.kla.reference import kla_scan_sequential

CHUNK = cpu.CHUNK
TOL = 2e-5  # float32 against the float64 recursion, as for the other backends (test_kla_scan.py)


def run(xs, backend="cpu"):
    """``(y, y_var, lam, eta)`` from ``xs = v, lam_v, k, q, decay, noise[, lam0, eta0]``."""
    y, y_var, (lam, eta) = kla_scan(*xs[:6], initial_state=tuple(xs[6:]) or None, return_state=True,
                                    backend=backend)
    return y, y_var, lam, eta


def assert_close(actual, ref, tol, what):
    for i, (a, r) in enumerate(zip(actual, ref)):
        err = max_rel_error(a, r)
        assert err < tol, f"{what}[{i}]: relative error {err:.2e}"


@pytest.mark.parametrize("B, L, M, S, with_state", [
    (2, 1, 5, 3, True),                     # one token, one partial block
    (1, CHUNK - 1, BLOCK + 5, 4, False),    # one partial chunk, a whole block and a partial one
    (3, CHUNK, 7, 16, True),                # exactly one chunk
    (1, 2 * CHUNK + 1, 2 * BLOCK, 3, True),  # three chunks, the last one token; two whole blocks
    (1, 1000, 3, 2, True),                  # many chunks, the last partial
])
def test_float64_values_and_every_gradient_equal_the_recursion(B, L, M, S, with_state):
    xs = make_inputs(B, L, M, S, seed=L + M, with_state=with_state)
    ref_out, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a), xs)
    with poisoned():
        out, grads = outputs_and_grads(run, xs)
    assert_close(out, ref_out, 1e-12, "outputs")
    assert_close(grads, ref_grads, 1e-11, "gradients")


def test_float32_within_the_tolerance_of_float64():
    xs = make_inputs(2, 3 * CHUNK + 5, BLOCK + 3, 5, seed=5, with_state=True)
    ref_out, ref_grads = outputs_and_grads(lambda a: kla_scan_sequential(*a), xs)
    with poisoned():
        out, grads = outputs_and_grads(run, [x.float() for x in xs])
    assert all(o.dtype == torch.float32 for o in out + grads)
    assert_close(out, ref_out, TOL, "float32 outputs")
    assert_close(grads, ref_grads, TOL, "float32 gradients")


@pytest.mark.parametrize("cut", [CHUNK, CHUNK + 7])
def test_split_and_carry_across_chunk_boundaries(cut):
    xs = make_inputs(2, 2 * CHUNK + 3, 6, 3, seed=cut)
    full = run(xs)
    head = [x[:, :cut] for x in xs[:4]] + xs[4:]
    tail = [x[:, cut:] for x in xs[:4]] + xs[4:]
    y1, v1, state = kla_scan(*head, return_state=True, backend="cpu")
    y2, v2, (lam, eta) = kla_scan(*tail, initial_state=state, return_state=True, backend="cpu")
    assert_close((torch.cat([y1, y2], 1), torch.cat([v1, v2], 1), lam, eta), full, 1e-13, "split and carry")


def test_strided_inputs_are_read_and_left_as_they_were():
    xs = make_inputs(2, 40, 9, 4, seed=3)
    xs[2] = xs[2].transpose(0, 1).contiguous().transpose(0, 1)      # k not contiguous
    xs[4] = xs[4].t().contiguous().t()                             # decay column-major
    before = [x.clone() for x in xs]
    ref = kla_scan_sequential(*xs)
    assert_close(run(xs), ref, 1e-12, "strided inputs")
    assert all(torch.equal(a, b) for a, b in zip(xs, before))


def test_without_grad_keeps_no_checkpoints_and_agrees():
    xs = make_inputs(1, 70, 5, 3, seed=4)
    with torch.no_grad():
        _, _, _, _, ckpt_var, _ = cpu.kla_scan_cpu(*xs[:6], torch.ones(1, 5, 3, dtype=torch.float64),
                                                   torch.zeros(1, 5, 3, dtype=torch.float64), False,
                                                   *NO_DOCUMENTS)
        out = run(xs)
    assert ckpt_var.numel() == 0
    assert_close(out, kla_scan_sequential(*xs), 1e-12, "no grad")


def test_thread_counts_give_identical_bits():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has a single thread here")
    with tuned(small_work=0):  # small problems run on one thread otherwise
        xs = make_inputs(3, 2 * CHUNK + 9, BLOCK + 9, 5, seed=6, with_state=True)
        before = numba.get_num_threads()
        runs = []
        try:
            for threads in (1, 2):
                numba.set_num_threads(threads)
                runs.append(outputs_and_grads(run, [x.float() for x in xs]))
        finally:
            numba.set_num_threads(before)
        for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
            assert torch.equal(a, b)


def test_second_derivatives_raise():
    xs = [x.requires_grad_() for x in make_inputs(1, 5, 2, 3, seed=7)]
    y, _ = kla_scan(*xs, backend="cpu")
    (g,) = torch.autograd.grad(y.sum(), xs[0], create_graph=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        g.sum().backward()


def test_operators_refuse_mixed_dtypes():
    args = op_args(False)
    with pytest.raises(ValueError, match="one dtype"):
        cpu.kla_scan_cpu(args[0].double(), *args[1:])


NO_DOCUMENTS = (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32))  # starts, ends


def op_args(save):
    xs = [x.float() for x in make_inputs(2, CHUNK + 3, BLOCK + 2, 3, seed=8, with_state=True)]
    var0, mu0 = 1.0 / xs[6], xs[7] / xs[6]
    args = (*xs[:6], var0, mu0)
    if save:
        args = tuple(x.requires_grad_() for x in args)
    return (*args, save, *NO_DOCUMENTS)


@pytest.mark.parametrize("save", [True, False])
def test_opcheck_forward(save):
    torch.library.opcheck(cpu.kla_scan_cpu, op_args(save))


@pytest.mark.parametrize("strided", [False, True])
def test_opcheck_backward(strided):
    """Also with transposed (non-contiguous) inputs: the fake returns contiguous gradients, as the
    operator does."""
    args = op_args(True)
    with torch.no_grad():
        y, y_var, var, mu, ckpt_var, ckpt_mu = cpu.kla_scan_cpu(*args)
    g = torch.Generator().manual_seed(2)
    cot = [torch.randn(x.shape, generator=g) for x in (y, y_var, var, mu)]
    inputs = [x.detach() for x in args[:6]]
    if strided:
        inputs = [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in inputs]
        assert not inputs[0].is_contiguous()
    state0 = [x.detach() for x in args[6:8]]
    torch.library.opcheck(cpu.kla_scan_cpu_backward, (*inputs, ckpt_var, ckpt_mu, *cot, *state0, *NO_DOCUMENTS))
