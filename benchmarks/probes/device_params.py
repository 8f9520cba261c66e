"""The public ``ks.filter`` with its parameters given as CUDA tensors, against Python numbers, in one
process. A script, not a test.

    python -m benchmarks.probes.device_params --out device_params.json      # on the GPU

Shapes ``(C, T) = (4096, 32768)`` and ``(1, 2^22)``, float32 ``y`` complete and with 10% of its
values missing (NaN). Parameters as numbers; ``theta`` a ``(C,)`` CUDA tensor; ``theta, sigma,
obs_var`` tensors; those and ``init_var`` tensors (the last two only at the first shape, complete
``y``). Each with the mean and variance and, at the first shape, every field: milliseconds queued
(median of ``triton.testing.do_bench``) and alone (one synchronised call), and what one call
dispatches (torch operations, synchronisations, copies to the device). Beside them the kernels the
calls launch, timed from a CUDA graph (the device's time, no host): ``kernels_*`` rows."""

from __future__ import annotations

import argparse
import json

import torch

import kalmanscan as ks
from benchmarks.common import alone_ms, call_counts, commit, graph_ms, initial_state, median_ms
from kalmanscan.problem.prepare import prepare
from kalmanscan.ops.filter.triton import backend as triton_backend


def cases(C: int, full: bool) -> dict:
    theta, sigma, obs_var = (torch.rand(C, device="cuda") + lo for lo in (0.05, 0.1, 0.1))
    out = dict(numbers=dict(theta=0.5, sigma=0.6, obs_var=0.6),
               four_dev=dict(theta=theta, sigma=sigma, obs_var=obs_var, init_var=sigma**2 / (2 * theta)))
    if full:
        out.update(theta_dev=dict(theta=theta, sigma=0.6, obs_var=0.6),
                   three_dev=dict(theta=theta, sigma=sigma, obs_var=obs_var))
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.device_params``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    torch.manual_seed(0)
    out = dict(commit=commit())
    for T, C in ((32768, 4096), (1 << 22, 1)):
        y = torch.randn(T, C, device="cuda")
        holed = torch.where(torch.rand_like(y) < 0.1, float("nan"), y)
        for missing, data in (("", y), ("_missing10", holed)):
            p = prepare(data, backend="triton", theta=0.5, sigma=0.6, obs_var=0.6)
            views, init = triton_backend.kernel_views(p), initial_state(p)
            key = f"kernels_{C}x{T}{missing}_mean_var"
            out[key] = dict(graph=graph_ms(lambda: triton_backend.filter_forward(views, init,
                                                                                 posterior=("mean", "var"))))
            print(key, json.dumps(out[key]), flush=True)
            first = C == 4096 and not missing
            for name, kw in cases(C, first).items():
                for fields in (("mean", "var"), None) if first else (("mean", "var"),):
                    def call(kw=kw, fields=fields, data=data):
                        return ks.filter(data, backend="triton", **({"outputs": fields} if fields else {}), **kw)

                    key = f"{name}_{C}x{T}{missing}" + ("_mean_var" if fields else "_all")
                    out[key] = dict(queued=median_ms(call), alone=alone_ms(call), counts=call_counts(call))
                    print(key, json.dumps(out[key]), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
