"""The KLA layer reads no device value on the host: no synchronisation in its forward or backward,
the noise-free flag and the kernels' noise floor that replace the value checks, and torch.compile
of a model around it (fullgraph; on the CPU through the triton interpreter, else on the GPU)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import device_of

from kalmanscan.nn import KLA, SequenceModel
from kalmanscan.ops.kla import NOISE_FLOOR, kla_scan

HOST_READS = {"tolist", "item", "__bool__", "__float__", "__int__", "__index__", "numpy"}


class HostReads(TorchDispatchMode):
    """Counts what reads a tensor's value on the host: ``_local_scalar_dense`` (``.item()``,
    ``bool``/``float`` of a tensor: the device-to-host synchronisation on CUDA), and the Python
    calls that reach it or copy out without dispatching it on the CPU (``tolist``, ``numpy``)."""

    def __init__(self):
        super().__init__()
        self.reads = Counter()
        outer = self

        class Methods(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in HOST_READS:
                    outer.reads[name] += 1
                return func(*args, **(kwargs or {}))

        self.methods = Methods()

    def __enter__(self):
        self.methods.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.methods.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.reads["_local_scalar_dense"] += 1
        return func(*args, **(kwargs or {}))


def make_layer(backend, seed=0, **kwargs):
    """A KLA layer with perturbed parameters, on ``backend``'s device (the triton backend's on the
    GPU where there is one)."""
    torch.manual_seed(seed)
    layer = KLA(8, d_state=3, backend=backend, **kwargs)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer.to(device_of(backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_and_backward_read_nothing_on_the_host(backend):
    layer = make_layer(backend)
    device = device_of(backend)
    x = torch.randn(2, 9, 8, device=device, requires_grad=True)
    with HostReads() as counter, torch.autocast(device.type, dtype=torch.bfloat16):
        y, y_var, state = layer(x, state=layer.init_state(2), return_variance=True)
    with HostReads() as counter_bwd:
        (y.float().square().sum() + y_var.sum() + state.var.sum()).backward()
    assert counter.reads == Counter() and counter_bwd.reads == Counter()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())


def test_the_public_scan_checks_with_one_host_read():
    """The counter sees the public call's one check (the detector works)."""
    layer = make_layer("torch")
    z = torch.randn(2, 9, layer.d_inner)
    with torch.no_grad():
        v, lam_v, k, q = layer.sensors(z)
        decay, noise = layer.discretized()
    with HostReads() as counter:
        kla_scan(v, lam_v, k, q, decay, noise)
    assert sum(counter.reads.values()) == 1


def noise_free_layer(backend):
    """Process noise fixed at 0 (sigma = 0) with decays down to 0.3: the exact precision of the
    fastest filters passes float32's range within 40 tokens."""
    layer = make_layer(backend)
    M, S = layer.d_inner, layer.d_state
    decay = torch.linspace(0.3, 0.95, M * S, device=device_of(backend)).reshape(M, S)
    with torch.no_grad():
        layer.noise_parameter().fill_(-math.inf)
        layer.log_theta.zero_()
        layer.log_dt.copy_(torch.log(-torch.log(decay)))
    return layer


def test_noise_free_layer_runs_in_mean_form_on_the_triton_backend():
    """With ``noise_free`` set the triton layer gives the torch backend's mean form exactly (past
    the overflow of the precision); unset, the kernels' noise floor keeps it finite and close."""
    x = torch.randn(1, 50, 8, device=device_of("triton"), requires_grad=True)
    ref = noise_free_layer("torch").to(x.device)
    y_ref = ref(x)
    flagged = noise_free_layer("triton")
    flagged.noise_free = True
    torch.testing.assert_close(flagged(x), y_ref, rtol=0, atol=0)
    floored = noise_free_layer("triton")
    y = floored(x)
    grads = torch.autograd.grad(y.square().sum(), [x, *floored.parameters()], allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    assert NOISE_FLOOR < 1e-8 * torch.finfo(torch.float32).eps


def test_compiled_model_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) of a KLA SequenceModel: no graph break (the scan is the
    ``kalmanscan::kla_scan_fwd`` operator, run here by the interpreter); forward and gradients
    equal eager."""
    torch.manual_seed(0)
    model = SequenceModel(11, 8, 1, mixer="kla", d_state=3, backend="triton").to(device_of("triton"))
    tokens = torch.randint(0, 11, (2, 6)).to(device_of("triton"))
    params = list(model.parameters())

    def loss_and_grads(m):
        logits = m(tokens)
        return logits, torch.autograd.grad(logits.square().mean(), params)

    logits, grads = loss_and_grads(model)
    logits_c, grads_c = loss_and_grads(torch.compile(model, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(logits_c, logits, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
