"""Packed documents through the KLA layer and the sequence model: one call over documents laid end
to end (``cu_seqlens``) equals one call per document, outputs and every parameter's gradient, also
with a state of one row per document (its gradients too); the causal conv reads nothing of an
earlier document."""

from __future__ import annotations

import pytest
import torch

from helpers import KERNEL_DEVICE
from kalmanscan import nn as ks_nn
from kalmanscan.nn.layer import KLAState, forward_with
LENGTHS = [1, 5, 2, 9]  # a document of one token, several shorter than the conv's width


def offsets(lengths, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)


def layer_and_input(backend, dtype=torch.float64, device="cpu", seed=0):
    torch.manual_seed(seed)
    layer = ks_nn.KLA(6, d_state=3, expand=2, backend=backend, init="kalmanscan").to(dtype=dtype, device=device)
    with torch.no_grad():  # every parameter matters: a non-zero conv bias and observation-variance rows
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(1, sum(LENGTHS), 6, dtype=dtype, device=device)
    return layer, x


def separate(layer, x, cu, **kw):
    offs = cu.tolist()
    return torch.cat([layer(x[:, a:b], **kw) if b > a else x[:, a:b] for a, b in zip(offs[:-1], offs[1:])], 1)


def grads_of(layer, out):
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device)
    params = [p for p in layer.parameters()]
    return torch.autograd.grad((out.double() * weights).sum(), params, allow_unused=True)


def assert_match(a, b, tol):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["cpu", "torch", "reference", "triton"])
def test_layer_packed_equals_separate(backend):
    """float64 on the CPU backends; the fused kernels (the interpreter on a CPU) in float32."""
    fused = backend == "triton"
    device, dtype = (KERNEL_DEVICE, torch.float32) if fused else ("cpu", torch.float64)
    layer, x = layer_and_input(backend, dtype=dtype, device=device)
    cu = offsets(LENGTHS, device)
    packed = layer(x, cu_seqlens=cu)
    alone = separate(layer, x, cu)
    assert_match(packed, alone, 2e-5 if fused else 1e-12)
    for a, b in zip(grads_of(layer, packed), grads_of(layer, alone)):
        assert_match(a, b, 1e-4 if fused else 1e-11)


def test_conv_stays_within_a_document():
    """Changing a document's tokens changes nothing outside it (offsets 0, 1, 6, 8, 17)."""
    layer, x = layer_and_input("cpu")
    cu = offsets(LENGTHS)
    changed = x.clone()
    changed[:, 6:8] += 1.0                       # the third document, two tokens
    a, b = layer(x, cu_seqlens=cu), layer(changed, cu_seqlens=cu)
    assert torch.equal(a[:, :6], b[:, :6]) and torch.equal(a[:, 8:], b[:, 8:])
    assert not torch.equal(a[:, 6:8], b[:, 6:8])


STATE_LENGTHS = [1, 5, 0, 2, 9]  # with an empty document, whose state passes through


def document_states(layer, n, seed=4):
    """A random per-document :class:`KLAState` (``n`` rows) in the layer's dtypes, as leaves."""
    g = torch.Generator().manual_seed(seed)
    M, S, K = layer.d_inner, layer.d_state, layer.d_conv
    dtype, device = layer.log_dt.dtype, layer.log_dt.device
    parts = (torch.randn(n, K - 1, M, generator=g, dtype=torch.float64),
             0.2 + torch.rand(n, M, S, generator=g, dtype=torch.float64),
             torch.randn(n, M, S, generator=g, dtype=torch.float64))
    return KLAState(*(t.to(dtype=dtype, device=device).requires_grad_() for t in parts))


def with_state_grads(layer, state, out, new):
    """Every parameter's and initial-state tensor's gradient of a fixed functional of the output
    and the new state."""
    g = torch.Generator().manual_seed(3)
    loss = sum((t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)).sum()
               for t in (out, *new))
    return torch.autograd.grad(loss, [*layer.parameters(), *state], allow_unused=True)


@pytest.mark.parametrize("backend", ["cpu", "torch", "reference", "recurrent", "triton"])
def test_layer_packed_with_states_equals_separate(backend):
    """Each document continues its own row of the state (conv window, variance, mean) and ends in
    its own row of the new state: equal to one call per document with its row, the output, the
    new state and the gradients of every parameter and of the initial state."""
    fused = backend == "triton"
    device, dtype = (KERNEL_DEVICE, torch.float32) if fused else ("cpu", torch.float64)
    layer, _ = layer_and_input(backend, dtype=dtype, device=device)
    cu = offsets(STATE_LENGTHS, device)
    x = torch.randn(1, sum(STATE_LENGTHS), 6, dtype=dtype, device=device)
    state = document_states(layer, len(STATE_LENGTHS))
    out, new = layer(x, state, cu_seqlens=cu)
    outs, news = [], []
    for d, (a, b) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])):
        row = KLAState(*(t[d:d + 1] for t in state))
        y, n = layer(x[:, a:b], row) if b > a else (x[:, a:b], row)
        outs.append(y)
        news.append(n)
    alone = torch.cat(outs, 1), KLAState(*(torch.cat(ts) for ts in zip(*news)))
    tol = 2e-5 if fused else 1e-12
    for a, b in zip((out, *new), (alone[0], *alone[1])):
        assert_match(a, b, tol)
    for a, b in zip(with_state_grads(layer, state, out, new), with_state_grads(layer, state, *alone)):
        assert_match(a, b, 1e-4 if fused else 1e-11)


def test_layer_refuses_a_state_and_bad_offsets():
    layer, x = layer_and_input("cpu")
    cu = offsets(LENGTHS)
    with pytest.raises(ValueError, match="state: packed documents take one state row per document, 4"):
        layer(x, layer.init_state(1), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.cat([x, x]), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=cu.long())
    with forward_with(lambda *args: None, [layer]), pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=cu)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_model_packed_equals_separate(backend):
    torch.manual_seed(1)
    model = ks_nn.SequenceModel(11, 8, 2, d_state=3, backend=backend).double()
    tokens = torch.randint(0, 11, (1, sum(LENGTHS)))
    cu = offsets(LENGTHS)
    packed = model(tokens, cu_seqlens=cu)
    offs = cu.tolist()
    alone = torch.cat([model(tokens[:, a:b]) for a, b in zip(offs[:-1], offs[1:])], 1)
    assert_match(packed, alone, 1e-12)
    for a, b in zip(grads_of(model, packed), grads_of(model, alone)):
        assert_match(a, b, 1e-11)


def test_model_packed_with_state_equals_separate():
    """A model's prefill of packed documents from a state of one row per document (each layer's)
    equals one call per document: logits, every layer's new state, every parameter's gradient;
    the rows then decode as a batch of ``N`` (:meth:`SequenceModel.step`) as each alone would."""
    torch.manual_seed(2)
    model = ks_nn.SequenceModel(11, 8, 2, d_state=3, backend="cpu").double()
    lengths = [3, 1, 0, 6]
    tokens = torch.randint(0, 11, (1, sum(lengths)))
    cu = offsets(lengths)
    N = len(lengths)
    start = [document_states(b.mixer, N, seed=i) for i, b in enumerate(model.blocks)]
    logits, state = model(tokens, start, cu_seqlens=cu)
    offs = cu.tolist()
    alone_logits, alone_states = [], []
    for d in range(N):
        rows = [KLAState(*(t[d:d + 1] for t in s)) for s in start]
        lo, hi = offs[d], offs[d + 1]
        out, rows = model(tokens[:, lo:hi], rows) if hi > lo else (torch.zeros(1, 0, 11, dtype=torch.float64), rows)
        alone_logits.append(out)
        alone_states.append(rows)
    assert_match(logits, torch.cat(alone_logits, 1), 1e-12)
    for i, layer_state in enumerate(state):
        for a, b in zip(layer_state, zip(*(rows[i] for rows in alone_states))):
            assert_match(a, torch.cat(b), 1e-12)
    for a, b in zip(grads_of(model, logits), grads_of(model, torch.cat(alone_logits, 1))):
        assert_match(a, b, 1e-11)
    with torch.no_grad():
        next_tokens = torch.randint(0, 11, (N,))
        stepped, _ = model.step(next_tokens, [KLAState(*(t.detach() for t in s)) for s in state])
        for d in range(N):
            one, _ = model.step(next_tokens[d:d + 1], [KLAState(*(t.detach() for t in s))
                                                       for s in alone_states[d]])
            assert_match(stepped[d:d + 1], one, 1e-12)


@pytest.mark.gpu
def test_compiled_layer_packed_on_gpu():
    """The layer with packed documents under ``torch.compile(fullgraph=True)`` equals eager (the
    offsets' host checks and the document maps trace without a break), from the initial state and
    continuing a state of one row per document (the new state and the state's gradients too).
    ``python -m benchmarks.probes.packed_compile`` tells which stage departs, if one does."""
    layer, x = layer_and_input("triton", dtype=torch.float32, device="cuda")
    cu = offsets(LENGTHS * 50, "cuda")
    x = torch.randn(1, int(cu[-1]), 6, device="cuda")
    compiled = torch.compile(layer, fullgraph=True)
    eager_out, compiled_out = layer(x, cu_seqlens=cu), compiled(x, cu_seqlens=cu)
    assert_match(compiled_out, eager_out, 1e-5)
    for a, b in zip(grads_of(layer, compiled_out), grads_of(layer, eager_out)):
        assert_match(a, b, 1e-4)
    state = document_states(layer, cu.numel() - 1)
    eager, compiled_run = layer(x, state, cu_seqlens=cu), compiled(x, state, cu_seqlens=cu)
    for a, b in zip((compiled_run[0], *compiled_run[1]), (eager[0], *eager[1])):
        assert_match(a, b, 1e-5)
    for a, b in zip(with_state_grads(layer, state, *compiled_run), with_state_grads(layer, state, *eager)):
        assert_match(a, b, 1e-4)


def test_model_checks_the_offsets_and_its_mixers():
    model = ks_nn.SequenceModel(11, 8, 2, d_state=3, backend="cpu")
    tokens = torch.randint(0, 11, (1, 6))
    with pytest.raises(ValueError, match="cu_seqlens must end at"):
        model(tokens, cu_seqlens=offsets([2, 3]))
    with pytest.raises(ValueError, match="non-decreasing"):
        model(tokens, cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.int32))
    hybrid = ks_nn.SequenceModel(11, 8, 2, mixer=["kla", "attention"], d_state=3)
    with pytest.raises(ValueError, match="cu_seqlens: the mixers \\['attention'\\]"):
        hybrid(tokens, cu_seqlens=offsets([2, 4]))
