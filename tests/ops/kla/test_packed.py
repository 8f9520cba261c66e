"""Packed documents (``cu_seqlens``) in the KLA scan: one call over documents laid end to end equals
one call per document, outputs, final states and every gradient (``v, lam_v, k, q, decay, noise``
and the per-document initial state), on every backend, with documents of length 1, odd lengths,
an empty document, and NaN-poisoned outputs (:mod:`kalmanscan.ops.kla.documents`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import KERNEL_DEVICE
from kla_helpers import make_inputs, outputs_and_grads, poisoned
from kalmanscan.ops.kla import FilterState, kla_scan, kla_scan_unchecked
from kalmanscan.ops.kla.documents import boundaries, token_documents
from kalmanscan.ops.kla.triton.backend import kla_scan_triton
from kalmanscan.ops.kla.triton.library import DEFAULT_CONFIG, SPLIT_CONFIG


# document lengths: 1s, odd lengths, an empty one, more than one checkpoint chunk (16 and 64 tokens)
LENGTHS = [1, 7, 0, 1, 70, 3, 19]


def packed_inputs(lengths, M=5, S=3, seed=0, dtype=torch.float64, device="cpu"):
    """Inputs ``(1, total, ...)``, a per-document initial state ``(lam, eta)`` ``(N, M, S)`` and the
    int32 offsets."""
    total, N = sum(lengths), len(lengths)
    xs = make_inputs(1, total, M, S, seed=seed, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed + 100)
    lam0 = (0.5 + torch.rand(N, M, S, generator=g, dtype=torch.float64)).to(dtype=dtype, device=device)
    eta0 = torch.randn(N, M, S, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    return xs, [lam0, eta0], cu


def packed(backend, cu):
    def run(a):
        y, y_var, (lam, eta) = kla_scan(*a[:6], initial_state=(a[6], a[7]), return_state=True, backend=backend,
                                        cu_seqlens=cu)
        return y, y_var, lam, eta
    return run


def separate(backend, cu):
    """One call per document, the outputs concatenated (an empty document: its initial state)."""
    def run(a):
        offs = cu.tolist()
        ys, y_vars, lams, etas = [], [], [], []
        for d in range(len(offs) - 1):
            lo, hi = offs[d], offs[d + 1]
            y, y_var, (lam, eta) = kla_scan(*(x[:, lo:hi] for x in a[:4]), *a[4:6],
                                            initial_state=(a[6][d:d + 1], a[7][d:d + 1]), return_state=True,
                                            backend=backend)
            ys.append(y)
            y_vars.append(y_var)
            lams.append(lam)
            etas.append(eta)
        return torch.cat(ys, 1), torch.cat(y_vars, 1), torch.cat(lams), torch.cat(etas)
    return run


def assert_all_close(got, want, rtol, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all(), f"{what}: entry {i} not finite"
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=rtol, msg=f"{what}: entry {i}")


@pytest.mark.parametrize("backend", ["reference", "torch", "recurrent", "cpu"])
def test_packed_equals_separate_float64(backend):
    xs, state, cu = packed_inputs(LENGTHS, seed=1)
    with poisoned():
        out, grads = outputs_and_grads(packed(backend, cu), xs + state)
    ref_out, ref_grads = outputs_and_grads(separate("reference", cu), xs + state)
    assert_all_close(out, ref_out, 1e-12, f"{backend} outputs")
    assert_all_close(grads, ref_grads, 1e-11, f"{backend} gradients")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_packed_without_initial_state(backend):
    """Every document starts from ``lam = 1, eta = 0``; the final state has one row per document."""
    xs, _, cu = packed_inputs([3, 1, 5], seed=2)
    y, y_var, state = kla_scan(*xs, return_state=True, backend=backend, cu_seqlens=cu)
    ref = [kla_scan(*(x[:, a:b] for x in xs[:4]), *xs[4:], return_state=True, backend="reference")
           for a, b in ((0, 3), (3, 4), (4, 9))]
    assert_all_close((y, y_var), (torch.cat([r[0] for r in ref], 1), torch.cat([r[1] for r in ref], 1)), 1e-12,
                     "outputs")
    assert state.var.shape == (3, 5, 3)
    assert_all_close((state.var, state.mu), (torch.cat([r[2].var for r in ref]), torch.cat([r[2].mu for r in ref])),
                     1e-12, "state")


def test_packed_continues_from_a_filter_state():
    xs, (lam0, eta0), cu = packed_inputs([4, 6], seed=3)
    state = FilterState.from_information(lam0, eta0)
    a = kla_scan(*xs, initial_state=state, return_state=True, backend="cpu", cu_seqlens=cu)
    b = kla_scan(*xs, initial_state=(lam0, eta0), return_state=True, backend="reference", cu_seqlens=cu)
    assert_all_close((a[0], a[2].var, a[2].mu), (b[0], b[2].var, b[2].mu), 1e-12, "FilterState")


@pytest.mark.parametrize("lengths", [[1] * 5, [9], [0, 4, 0]])
def test_boundaries(lengths):
    _, _, cu = packed_inputs(lengths)
    total = sum(lengths)
    starts, ends = boundaries(cu, total)
    doc, first = token_documents(cu, total)
    offs = cu.tolist()
    want_starts, want_ends = [-1] * total, [-1] * total
    for d in range(len(lengths)):
        if lengths[d]:
            want_starts[offs[d]] = d
            want_ends[offs[d + 1] - 1] = d
    assert starts.tolist() == want_starts and ends.tolist() == want_ends
    assert doc.tolist() == [d for d, n in enumerate(lengths) for _ in range(n)]
    assert first.tolist() == [s >= 0 for s in want_starts]


def test_no_tokens():
    """``total = 0``: every document is empty, its final state its initial state."""
    xs, state, cu = packed_inputs([0, 0], seed=4)
    for backend in ("reference", "torch", "cpu", "recurrent"):
        y, _, (lam, eta) = kla_scan(*xs, initial_state=tuple(state), return_state=True, backend=backend,
                                    cu_seqlens=cu)
        assert y.shape == (1, 0, 5)
        assert_all_close((lam, eta), state, 1e-15, backend)


@pytest.mark.parametrize("bad, match", [
    (lambda cu: cu.long(), "int32"),
    (lambda cu: cu[None], "1-d"),
    (lambda cu: cu[:1], "N \\+ 1 >= 2"),
    (lambda cu: cu + 1, "start at 0"),
    (lambda cu: torch.cat([cu[:-1], cu[-1:] + 1]), "end at"),
    (lambda cu: torch.tensor([0, 5, 3, 10], dtype=torch.int32), "non-decreasing"),
])
def test_bad_cu_seqlens_raise(bad, match):
    xs, _, cu = packed_inputs([3, 7])
    with pytest.raises(ValueError, match="cu_seqlens"):
        kla_scan(*xs, backend="cpu", cu_seqlens=bad(cu))
    with pytest.raises(ValueError, match=match):
        kla_scan(*xs, backend="cpu", cu_seqlens=bad(cu))


def test_cu_seqlens_needs_one_row_and_per_document_state():
    xs, state, cu = packed_inputs([3, 7])
    two = [torch.cat([x, x]) if x.ndim == 3 else x for x in xs]
    with pytest.raises(ValueError, match="cu_seqlens"):
        kla_scan(*two, backend="torch", cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state lam"):
        kla_scan(*xs, initial_state=(state[0][:1], state[1][:1]), backend="torch", cu_seqlens=cu)


@pytest.mark.parametrize("variance", [True, False])
def test_packed_triton(variance):
    """The fused kernels (forward, backward; the interpreter on a CPU) against the float64
    reference, with the launch shape the wrapper picks."""
    xs, state, cu = packed_inputs([1, 17, 0, 2, 23], seed=5, device=KERNEL_DEVICE)

    def run(a):
        y, y_var, (lam, eta) = kla_scan_unchecked(*a[:6], initial_state=(a[6], a[7]), return_state=True,
                                                  backend="triton", cu_seqlens=cu, variance=variance)
        return (y, y_var, lam, eta) if variance else (y, lam, eta)

    def ref(a):
        out = packed("reference", cu.cpu())([x.cpu() for x in a])
        return out if variance else (out[0], *out[2:])

    with poisoned():
        out, grads = outputs_and_grads(run, [x.float() for x in xs + state])
    ref_out, ref_grads = outputs_and_grads(ref, xs + state)
    assert_all_close(out, ref_out, 2e-5, "outputs")
    assert_all_close(grads, ref_grads, 2e-4, "gradients")


def test_packed_triton_checked_call():
    """The public (checked) call on the fused kernels with per-document initial states, an empty
    document among them, against the float64 reference (forward; the gradients are the
    operator's, tested above)."""
    xs, state, cu = packed_inputs([1, 7, 0, 3], seed=3, device=KERNEL_DEVICE)
    with torch.no_grad(), poisoned():
        out = packed("triton", cu)([x.float() for x in xs + state])
    ref = packed("reference", cu.cpu())([x.cpu() for x in xs + state])
    assert_all_close([x.cpu() for x in out], ref, 2e-5, "outputs")


@pytest.mark.parametrize("split", [False, True])
def test_packed_triton_time_split(split):
    """Stretches of time run by separate programs (the piece maps, the adjoint maps), documents
    starting and ending inside and at the stretches' edges, both grid orientations."""
    base = SPLIT_CONFIG if split else DEFAULT_CONFIG
    config = dataclasses.replace(base, pieces=3 if split else 1, bwd_pieces=4 if split else 1)
    xs, state, cu = packed_inputs([16, 1, 5, 0, 26, 3], seed=6, device=KERNEL_DEVICE)

    def run(a):
        return kla_scan_triton(*a, config=config, cu_seqlens=cu)

    with poisoned():
        out, grads = outputs_and_grads(run, [x.float() for x in xs + state])
    ref_out, ref_grads = outputs_and_grads(lambda a: packed("reference", cu.cpu())([x.cpu() for x in a]), xs + state)
    assert_all_close(out, ref_out, 2e-5, "outputs")
    assert_all_close(grads, ref_grads, 2e-4, "gradients")


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True])
def test_packed_compiled_kernels_on_gpu(grad):
    """Thousands of tokens in documents of 1 to 2048 tokens (the launch the wrapper picks for one
    row: time split across stretches) against the float64 torch backend's segmented scan, and
    the final states against one call per document."""
    lengths = [1, 1000, 3, 517, 1, 2048, 77, 0, 600, 1]
    xs, state, cu = packed_inputs(lengths, M=64, S=16, seed=7, device="cuda")
    fn = packed("triton", cu)
    if grad:
        out, grads = outputs_and_grads(fn, [x.float() for x in xs + state])
        ref_out, ref_grads = outputs_and_grads(packed("torch", cu), xs + state)
        for name, a, b in zip(("v", "lam_v", "k", "q", "decay", "noise", "lam0", "eta0"), grads, ref_grads):
            assert (a.double() - b).norm() <= 1e-4 * b.norm(), name
    else:
        with torch.no_grad():
            out, ref_out = fn([x.float() for x in xs + state]), packed("torch", cu)(xs + state)
        alone = separate("triton", cu)([x.float() for x in xs + state])
        for a, b in zip(out[2:], alone[2:]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(out, ref_out):
        assert (a.double() - b).norm() <= 1e-5 * b.norm()


def test_document_search_reads_the_whole_offsets():
    """The search for each token's document is over the offsets tensor itself, never a view into
    it: Inductor's Triton lowering of ``searchsorted`` has read a sliced sorted sequence from its
    storage's start (the GPU test below; CI has no GPU, so the form is checked here)."""
    seen = []

    class Searches(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket == torch.ops.aten.searchsorted:
                seen.append(args[0].storage_offset())
            return func(*args, **(kwargs or {}))

    _, _, cu = packed_inputs([2, 0, 3])
    with Searches():
        token_documents(cu, 5)
    assert seen == [0]


@pytest.mark.gpu
def test_compiled_token_documents_on_gpu():
    """Inductor lowers ``searchsorted`` to Triton on a GPU: each token's document and position
    compiled equal eager (documents of 1 to 9 tokens, empty ones at the start, inside and at the end)."""
    cu = torch.tensor([0, 0, 1, 6, 6, 8, 17, 18, 18], dtype=torch.int32, device="cuda")

    def documents(cu):
        doc, first = token_documents(cu, 18)
        return doc, first, torch.arange(18, device=cu.device) - cu[doc]

    for a, b in zip(torch.compile(documents, fullgraph=True)(cu), documents(cu)):
        assert torch.equal(a, b)
