"""The "gla" mixer on a GPU with fla installed: fla's ``chunk_gla`` against the torch fallback.

Skipped where there is no CUDA device, no fla, or the kernels run under ``TRITON_INTERPRET=1``
(as in CI); on the GPU machine: ``TRITON_INTERPRET=0 python -m pytest tests/nn/baselines/test_gla_gpu.py``.
fla's float32 kernels multiply in TF32 (10-bit mantissa, relative rounding ~5e-4 per product),
so outputs and gradients are compared to ``TF32_BOUND``, not to float32 rounding. fla autotunes
its kernels on first use: allow minutes for a fresh machine.
So run, on an H200 (2026-12-01, fla-core 0.6.0), every case passed: output, final state and every gradient within
1.9e-3 of the fallback at L = 1, 63 and 200, with and without the short conv, and the training
test. Without the switch, fla-core 0.6 tunes for minutes per shape and caches the results under
``TRITON_CACHE_DIR`` (166 MB after the L = 1 case alone).
"""

import importlib.util

import pytest
import torch

from kalmanscan.nn import SequenceModel
from kalmanscan.nn.baselines.gla import GatedLinearAttention, GLAState

pytestmark = [pytest.mark.gpu,                # a CUDA device and compiled kernels (tests/conftest.py)
              pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla")]

TF32_BOUND = 1e-2


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _run(layer, x, state):
    y, final = layer(x, GLAState(*(t.clone() for t in state)))
    grads = torch.autograd.grad((y.square().sum() + final.S.square().sum()), [x, *layer.parameters()])
    return y, final.S, grads


@pytest.mark.parametrize("d_conv", [0, 4])
@pytest.mark.parametrize("L", [1, 63, 200])
def test_fla_chunk_gla_equals_torch_fallback(L, d_conv):
    torch.manual_seed(L)
    layer = GatedLinearAttention(64, n_heads=4, d_conv=d_conv).cuda()
    x = torch.randn(2, L, 64, device="cuda", requires_grad=True)
    state = GLAState(*(0.1 * torch.randn_like(t) for t in layer.init_state(2)))
    y, final, grads = _run(layer, x, state)
    layer.use_fla = False
    y_ref, final_ref, grads_ref = _run(layer, x, state)
    errors = {"y": _rel(y, y_ref), "state": _rel(final, final_ref)}
    errors.update({f"grad{i}": _rel(a, b) for i, (a, b) in enumerate(zip(grads, grads_ref))})
    print(L, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < TF32_BOUND, errors


def test_fla_chunk_gla_equals_torch_fallback_at_mqar_2048():
    """The MQAR T = 2048 configuration whose loss stayed flat (d_model 128, the width-4 conv, keys
    of width d_model): fla's kernels against the fallback over the whole length, and the gradient
    of the last output on the 256 inputs before it alike (at the module's own initialisation it
    falls to about 4e-6 of its value at lag 0 over those lags and vanishes past lag ~1,300:
    ``python -m evidence.reach --weight-init torch``)."""
    torch.manual_seed(2048)
    layer = GatedLinearAttention(128, d_conv=4, expand_k=2.0).cuda()
    x = torch.randn(2, 2048, 128, device="cuda", requires_grad=True)
    state = GLAState(*(torch.zeros_like(t) for t in layer.init_state(2)))
    y, final, grads = _run(layer, x, state)
    far = torch.autograd.grad(layer(x, GLAState(*state))[0][:, -1].square().sum(), x)[0][:, -256:]
    layer.use_fla = False
    y_ref, final_ref, grads_ref = _run(layer, x, state)
    far_ref = torch.autograd.grad(layer(x, GLAState(*state))[0][:, -1].square().sum(), x)[0][:, -256:]
    errors = {"y": _rel(y, y_ref), "state": _rel(final, final_ref), "far": _rel(far, far_ref)}
    errors.update({f"grad{i}": _rel(a, b) for i, (a, b) in enumerate(zip(grads, grads_ref))})
    print({k: f"{v:.1e}" for k, v in errors.items()}, "far norm", float(far_ref.norm()))
    assert max(errors.values()) < TF32_BOUND, errors


def test_gla_model_trains_on_gpu():
    """A 2-layer gla model under bf16 autocast learns to copy the previous token."""
    torch.manual_seed(0)
    model = SequenceModel(16, 64, 2, mixer="gla").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        tokens = torch.randint(0, 16, (32, 64), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, 1:].float().flatten(0, 1), tokens[:, :-1].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("loss", losses[0], losses[-1])
    assert losses[-1] < 0.1 * losses[0]
