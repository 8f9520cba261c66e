"""What one small ks.filter call dispatches: torch operations outside the kernels, scalar reads
back to the host (a device synchronisation each on a GPU) and kernel launches. Upper bounds, so
a regression of the call's fixed cost shows here (the GPU timings are benchmarks/bench_api.py's)."""

import collections

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter
from helpers import device_of, synchronisations
from torch.utils._python_dispatch import TorchDispatchMode

import kalmanscan as ks


class _Dispatched(TorchDispatchMode):
    """Counts the torch operations dispatched outside kernel launches, and the launches."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.launches = 0
        self.in_kernel = 0
        self.device = None  # set: scalar reads of tensors elsewhere (host checks) are not reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.in_kernel:
            if (func is torch.ops.aten._local_scalar_dense.default and self.device is not None
                    and args[0].device != self.device):
                self.ops["host scalar read"] += 1
                return out
            self.ops[str(func)] += 1
            if func is torch.ops.aten.copy_.default:
                src, dst = args[1], args[0]
            elif func is torch.ops.aten._to_copy.default:
                src, dst = args[0], out
            else:
                return out
            if src.device.type != "cpu" and dst.device.type == "cpu":
                self.ops["device-to-host copy"] += 1
        return out

    @property
    def reads(self) -> int:
        """Values read back to the host: scalar reads (of a CPU tensor under the interpreter: the
        device's synchronisation in the same code on a GPU) and device-to-host copies."""
        return self.ops["aten._local_scalar_dense.default"] + self.ops["device-to-host copy"]


@pytest.fixture
def dispatched(monkeypatch):
    """A :class:`_Dispatched` mode; the interpreter's own operations inside a launch are not counted."""
    mode = _Dispatched()
    launch = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        mode.launches += 1
        mode.in_kernel += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            mode.in_kernel -= 1

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    return mode


# (backend, outputs, parameters) -> most torch operations per call (measured: 20, 17, 186, 681, 46, 29, 177;
# with parameters as tensors about 20 of them check that the stationary variance and the process noise
# fit the dtype and that the result is finite).
# On a GPU the triton cases dispatch more (measured 25, 22, 208: each host value goes to the device
# through page-locked memory, y's check is a reduction beside the kernels): GPU_BOUNDS.
BOUNDS = {("triton", None, "host"): 23, ("triton", ("mean", "var"), "host"): 20, ("triton", None, "tensor"): 205,
          ("torch", None, "host"): 750, ("cpu", None, "host"): 55, ("cpu", ("mean", "var"), "host"): 36,
          ("cpu", None, "tensor"): 195}
GPU_BOUNDS = {("triton", None, "host"): 28, ("triton", ("mean", "var"), "host"): 25, ("triton", None, "tensor"): 225}


@pytest.mark.parametrize("backend, outputs, params", list(BOUNDS))
def test_small_call_dispatches_few_operations_and_one_scalar_read(dispatched, backend, outputs, params):
    """Parameters as host values (checked with NumPy) or as a ``(1, C)`` tensor on ``y``'s device
    (checked there, with ``y``'s check in the same read): one synchronisation either way."""
    y = torch.randn(63, 5, generator=torch.Generator().manual_seed(0)).to(device_of(backend))
    sigma = np.full(5, 0.7) if params == "host" else torch.full((1, 5), 0.7, device=y.device)
    kw = dict(theta=0.3, sigma=sigma, obs_var=0.4, backend=backend, outputs=outputs)
    ks.filter(y, **kw)  # first call: imports and compiles
    dispatched.device = y.device
    with dispatched:
        post = ks.filter(y, **kw)
    assert dispatched.reads <= 1, dict(dispatched.ops)  # at most one synchronisation
    bound = GPU_BOUNDS.get((backend, outputs, params)) if y.is_cuda else None
    assert sum(dispatched.ops.values()) <= (bound or BOUNDS[backend, outputs, params]), dispatched.ops.most_common()
    if backend == "triton":
        assert dispatched.launches <= 3
    assert torch.isfinite(post.mean).all()


def test_parameters_and_times_are_made_when_read(dispatched):
    y = torch.randn(40, 3, generator=torch.Generator().manual_seed(1))
    post = ks.filter(y, theta=0.3, sigma=0.7, obs_var=0.4, backend="cpu")
    with dispatched:
        post.params["theta"]
    assert 0 < sum(dispatched.ops.values()) <= 2
    assert post.params["theta"].shape == (40, 3)
    assert set(post.params) >= {"theta", "decay", "times", "n_diffuse", "times_given"}


@pytest.mark.parametrize("backend", ["triton", "torch", "cpu"])
@pytest.mark.parametrize("outputs", [None, ("mean", "var"), ("var",), ("loglik",)])
@pytest.mark.parametrize("at", [0, 31, 62])
def test_inf_in_y_is_still_caught(backend, outputs, at):
    y = torch.randn(63, 2, generator=torch.Generator().manual_seed(2)).to(device_of(backend))
    y[at, 1] = float("inf")
    with pytest.raises(ValueError, match="y must be finite"):
        ks.filter(y, theta=0.3, sigma=0.7, obs_var=0.4, backend=backend, outputs=outputs)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on inf
@pytest.mark.parametrize("backend", ["triton", "torch", "cpu"])
def test_check_finite_false_reads_nothing_back(dispatched, backend):
    """``check_finite=False``: no scalar read at all (calls on a device queue without waiting), the
    same result, and an ``inf`` in ``y`` shows in the result instead of raising."""
    y = torch.randn(63, 5, generator=torch.Generator().manual_seed(3)).to(device_of(backend))
    kw = dict(theta=0.3, sigma=np.full(5, 0.7), obs_var=0.4, backend=backend)  # host parameters: checked there
    checked = ks.filter(y, **kw)
    with dispatched:
        post = ks.filter(y, check_finite=False, **kw)
    assert dispatched.reads == 0
    for name in ("mean", "var", "loglik"):
        assert torch.equal(getattr(post, name), getattr(checked, name)), name
    y[40, 2] = float("inf")
    post = ks.filter(y, check_finite=False, **kw)
    assert not torch.isfinite(post.loglik[2]) and torch.isfinite(post.loglik[[0, 1, 3, 4]]).all()
    assert not torch.isfinite(ks.smooth(y, check_finite=False, **kw).mean[40:, 2]).all()
    with pytest.raises(ValueError, match="y must be finite"):
        ks.smooth(y, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("call", ["filter", "smooth"])
@pytest.mark.parametrize("params", ["remembered", "new", "tensor"])
def test_gpu_calls_synchronise_once_checked_and_never_unchecked(call, params):
    """On a GPU an unchecked call with host parameters queues behind the previous one (no
    synchronisation: they go to the device from page-locked memory) and a checked call waits
    once, whether or not its parameters were remembered from an earlier call. A parameter given
    as a device tensor is checked there: one synchronisation either way, the other parameters'
    copies to the device not waiting."""
    y = torch.randn(64, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    fn = getattr(ks, call)
    fn(y, theta=0.2, sigma=0.5, obs_var=0.3, backend="triton")  # the kernels' first launch compiles them
    for check in (False, True):
        theta = {"remembered": 0.3, "new": float(np.random.default_rng().uniform(0.1, 1.0)),
                 "tensor": torch.full((8,), 0.3, device="cuda")}[params]
        kw = dict(theta=theta, sigma=np.full(8, 0.7), obs_var=0.4, backend="triton", check_finite=check)
        if params == "remembered":
            fn(y, **kw)
        torch.cuda.synchronize()
        expected = 1 if params == "tensor" else int(check)
        assert synchronisations(lambda: fn(y, **kw)) == expected, (call, params, check)


@pytest.mark.gpu
def test_host_tensor_parameters_of_gpu_data_keep_their_gradient():
    """A CPU tensor parameter of CUDA data reaches the device through page-locked memory and its
    gradient comes back to it, equal to the one with the parameter on the device."""
    y = torch.randn(50, 3, device="cuda", dtype=torch.float64, generator=torch.Generator("cuda").manual_seed(5))
    grads = []
    for device in ("cpu", "cuda"):
        theta = torch.tensor([0.2, 0.4, 0.6], dtype=torch.float64, device=device, requires_grad=True)
        ks.filter(y, theta=theta, sigma=0.5, obs_var=0.3, backend="triton").loglik.sum().backward()
        grads.append(theta.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=0)


@pytest.mark.gpu
def test_remembered_rows_are_copied_into_new_tensors_each_call():
    """A call with the host parameters of a recent one reuses their checked rows but copies them
    into new tensors: the same result, and writing into what one call returned changes neither
    the remembered rows nor the next call's result."""
    y = torch.randn(63, 5, device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    kw = dict(theta=0.3, sigma=np.full(5, 0.7), obs_var=0.4, backend="triton")
    first, second = ks.filter(y, **kw), ks.filter(y, **kw)
    assert torch.equal(first.mean, second.mean) and torch.equal(first.var, second.var)
    second.params["init_mean"].add_(1.0)
    second.params["init_var"].mul_(3.0)
    third = ks.filter(y, **kw)
    assert torch.equal(first.mean, third.mean) and torch.equal(first.var, third.var)
    assert torch.equal(first.params["init_mean"], third.params["init_mean"])
