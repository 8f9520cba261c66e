"""Packed documents through the KLA layer and the sequence model: one call over documents laid end
to end (``cu_seqlens``) equals one call per document, outputs and every parameter's gradient; the
causal conv reads nothing of an earlier document."""

from __future__ import annotations

import pytest
import torch

from helpers import KERNEL_DEVICE
from kalmanscan import nn as ks_nn
from kalmanscan.nn.layer import forward_with
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


def test_layer_refuses_a_state_and_bad_offsets():
    layer, x = layer_and_input("cpu")
    cu = offsets(LENGTHS)
    with pytest.raises(ValueError, match="cu_seqlens"):
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


@pytest.mark.gpu
def test_compiled_layer_packed_on_gpu():
    """The layer with packed documents under ``torch.compile(fullgraph=True)`` equals eager (the
    offsets' host checks and the document maps trace without a break)."""
    layer, x = layer_and_input("triton", dtype=torch.float32, device="cuda")
    cu = offsets(LENGTHS * 50, "cuda")
    x = torch.randn(1, int(cu[-1]), 6, device="cuda")
    compiled = torch.compile(layer, fullgraph=True)
    eager_out, compiled_out = layer(x, cu_seqlens=cu), compiled(x, cu_seqlens=cu)
    assert_match(compiled_out, eager_out, 1e-5)
    for a, b in zip(grads_of(layer, compiled_out), grads_of(layer, eager_out)):
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
