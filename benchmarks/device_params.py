"""The public ``ks.filter`` with its parameters given as CUDA tensors, against Python numbers, in one
process. A script, not a test.

    python -m benchmarks.device_params --out device_params.json      # on the GPU

At (C, T) = (4096, 32768), float32 ``y``: parameters as numbers; ``theta`` a ``(C,)`` CUDA tensor;
``theta, sigma, obs_var`` tensors; those and ``init_var`` tensors. Each with the mean and variance
and with every field: milliseconds queued (median of ``triton.testing.do_bench``) and alone (one
synchronised call), and what one call dispatches (torch operations, synchronisations, copies to the
device)."""

from __future__ import annotations

import argparse
import json

import torch

import kalmanscan as ks
from benchmarks.bench_api import alone_ms, call_counts, median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    T, C = 32768, 4096
    y = torch.randn(T, C, device="cuda")
    theta, sigma, obs_var = (torch.rand(C, device="cuda") + lo for lo in (0.05, 0.1, 0.1))
    cases = {
        "numbers": dict(theta=0.5, sigma=0.6, obs_var=0.6),
        "theta_dev": dict(theta=theta, sigma=0.6, obs_var=0.6),
        "three_dev": dict(theta=theta, sigma=sigma, obs_var=obs_var),
        "four_dev": dict(theta=theta, sigma=sigma, obs_var=obs_var, init_var=sigma**2 / (2 * theta)),
    }
    out = {}
    for name, kw in cases.items():
        for fields in (("mean", "var"), None):
            def call(kw=kw, fields=fields):
                return ks.filter(y, backend="triton", **({"outputs": fields} if fields else {}), **kw)

            key = name + ("_mean_var" if fields else "_all")
            out[key] = dict(queued=median_ms(call), alone=alone_ms(call), counts=call_counts(call))
            print(key, json.dumps(out[key]), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
