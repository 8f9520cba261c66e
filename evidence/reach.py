"""How far back a mixer can hear at initialisation: the gradient of its last output with respect to
each earlier input, by lag (one layer, random inputs, float32).

    python -m evidence.reach --mixers gla_conv_k2 kla --len 2048 --d-model 128 [--out reach.json]

For each mixer spec (:data:`evidence.protocols.MIXER_SPECS`), ``|d y[T-1] / d x[T-1-lag]|`` (the
Frobenius norm over the batch and channels of the gradient of ``|y[T-1]|^2``) relative to its value
at lag 0, at lags 1, 4, 16, ... and ``T - 1``, and the longest lag at which it is non-zero in
float32. Training gets no signal to recall across a distance at which this gradient has vanished:
MQAR at T = 2048 asks for recall across up to about 2,000 tokens.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import commit, save
from evidence.protocols import MIXER_SPECS
from evidence.train import mixer_options
from kalmanscan.nn.init import WEIGHT_INIT_DEFAULT, WEIGHT_INITS, normal_init_
from kalmanscan.nn.mixers import MIXERS

__all__ = ["mixer_from_spec", "reach", "lags", "main"]


def mixer_from_spec(spec: str, d_model: int, device: str = "cpu",
                    weight_init: str = WEIGHT_INIT_DEFAULT) -> torch.nn.Module:
    """One layer of the mixer that ``spec`` (a key of ``MIXER_SPECS``) names, with its options,
    initialised as a :class:`kalmanscan.nn.SequenceModel` initialises its mixers (``"normal"``:
    :func:`kalmanscan.nn.init.normal_init_`, the training harness's default)."""
    if weight_init not in WEIGHT_INITS:
        raise ValueError(f"weight_init must be one of {WEIGHT_INITS}, got {weight_init!r}")
    if spec not in MIXER_SPECS:
        raise ValueError(f"mixers: unknown spec {spec!r}; choose from {sorted(MIXER_SPECS)}")
    argv = MIXER_SPECS[spec]
    if argv[0] != "--mixer" or any(a.startswith("--") and a != "--mixer-opt" for a in argv[2::2]):
        raise ValueError(f"mixers: {spec!r} sets more than the mixer and its options ({argv})")
    layer = MIXERS[argv[1]](d_model, **mixer_options(argv[3::2]), device=device)
    if weight_init == "normal":
        normal_init_(layer)
    return layer


def reach(layer: torch.nn.Module, d_model: int, length: int, batch: int = 4, seed: int = 0) -> np.ndarray:
    """``(length,)``: the norm of the gradient of ``|y[:, -1]|^2`` on ``x[:, -1 - lag]`` for each
    lag, ``x`` standard normal ``(batch, length, d_model)`` on the layer's device."""
    device = next(layer.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, length, d_model, generator=g, device=device, requires_grad=True)
    y = layer(x)
    y = y[0] if isinstance(y, tuple) else y
    (grad,) = torch.autograd.grad(y[:, -1].square().sum(), x)
    return grad.norm(dim=(0, 2)).flip(0).double().cpu().numpy()


def lags(length: int) -> list[int]:
    """0, the powers of 4 below ``length`` and ``length - 1``."""
    return sorted({0, length - 1} | {4 ** k for k in range(length.bit_length()) if 4 ** k < length})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m evidence.reach", description=__doc__.splitlines()[0])
    ap.add_argument("--mixers", nargs="+", default=["gla_conv_k2", "kla"], help="keys of MIXER_SPECS")
    ap.add_argument("--len", type=int, default=2048, dest="length")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="a layer and inputs per seed")
    ap.add_argument("--weight-init", choices=WEIGHT_INITS, default=WEIGHT_INIT_DEFAULT,
                    help="as the training harness (--weight-init of evidence.train)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="JSON file")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.length < 2:
        raise SystemExit("--len must be at least 2")
    at = lags(args.length)
    rows = []
    for spec in args.mixers:
        for seed in args.seeds:
            torch.manual_seed(seed)
            layer = mixer_from_spec(spec, args.d_model, args.device, args.weight_init)
            norms = reach(layer, args.d_model, args.length, args.batch, seed)
            nonzero = np.nonzero(norms)[0]
            rows.append(dict(mixer=spec, seed=seed, lags=at, relative=[float(norms[lag] / norms[0]) for lag in at],
                             longest_nonzero_lag=int(nonzero.max()) if nonzero.size else -1))
            print(f"{spec} seed {seed}: " + " ".join(f"{lag}:{r:.1e}" for lag, r in zip(at, rows[-1]["relative"]))
                  + f"; non-zero up to lag {rows[-1]['longest_nonzero_lag']}", flush=True)
    out = dict(length=args.length, d_model=args.d_model, batch=args.batch, weight_init=args.weight_init,
               device=args.device, rows=rows,
               torch=torch.__version__, commit=commit())
    save(args.out, out)
    return out


if __name__ == "__main__":
    main()
