"""Where ``torch.compile`` of the KLA layer with packed documents (``cu_seqlens``) departs from
eager: each stage of the layer's packed path compiled with ``aot_eager`` (the traced graph and the
operators' fake and autograd registrations, run by eager kernels) and with ``inductor`` (the
generated kernels as well), against eager. A script, not a test.

    python -m benchmarks.probes.packed_compile [--lengths 1,5,2,9 --repeat 50] [--out packed_compile.json]

Stages: ``sliced_search``, ``searchsorted`` over the view ``cu_seqlens[1:]`` (the pattern the
layer's document map used before, which Inductor's Triton lowering has read from the storage's
start: https://github.com/pytorch/pytorch/issues/182343; not counted below); then in the order
the layer runs them: ``documents`` (each token's document and position,
:func:`kalmanscan.ops.kla.documents.token_documents`), ``conv`` (the causal conv within documents,
:func:`kalmanscan.nn.packed.document_conv`), ``scan`` (``kla_scan_unchecked`` with ``cu_seqlens``
on the layer's inputs: outputs and every input's gradient), ``windows`` (the conv continuing
per-document windows, and the windows after each document), ``layer`` (the whole block: output
and every parameter's gradient), ``layer_state`` (the block continuing a state of one row per
document: output, new state, the parameters' and the state's gradients). Prints the largest
absolute difference of each stage and compiler, and the first stage that departs by more than
``--tol`` (relative to the stage's largest value)."""

from __future__ import annotations

import argparse

import torch
import triton

from benchmarks.common import save
from kalmanscan import nn as ks_nn
from kalmanscan.nn.layer import KLAState
from kalmanscan.nn.packed import document_conv, document_windows
from kalmanscan.ops.kla import kla_scan_unchecked
from kalmanscan.ops.kla.documents import token_documents

COMPILERS = ("aot_eager", "inductor")


def layer_and_inputs(lengths: list[int], device: torch.device, backend: str):
    """The test's layer (every parameter perturbed), its packed input and the int32 offsets."""
    torch.manual_seed(0)
    layer = ks_nn.KLA(6, d_state=3, expand=2, backend=backend, init="kalmanscan").to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    x = torch.randn(1, sum(lengths), 6, device=device)
    return layer, x, cu


def stages(layer, x, cu):
    """``name -> (fn, args, wrt)``: ``fn(*args)`` returns a tuple of tensors; the gradients of a
    fixed functional of them with respect to the tensors ``wrt`` are compared too."""
    total = x.shape[1]
    z = layer.in_proj(x).chunk(2, -1)[0].detach().requires_grad_()
    with torch.no_grad():
        _, _, _, sensors = layer.observe(x, cu_seqlens=cu)
        decay, noise = (p.detach() for p in layer.discretized())
    scan_args = [t.detach().requires_grad_() for t in (*sensors, decay, noise)]
    n = cu.numel() - 1
    g = torch.Generator().manual_seed(4)
    start = layer.init_state(n)
    state = KLAState(*(t + 0.5 * torch.rand(t.shape, generator=g).to(t.device) for t in start))
    state = KLAState(*(t.detach().requires_grad_() for t in state))

    def sliced_search(cu):
        return (torch.searchsorted(cu[1:], torch.arange(total, device=cu.device, dtype=cu.dtype), right=True),)

    def documents(cu):
        doc, first = token_documents(cu, total)
        return doc, first, torch.arange(total, device=cu.device) - cu[doc]

    def conv(z, cu):
        return (document_conv(z, layer.conv, cu),)

    def scan(*args):
        *inputs, cu = args
        y, y_var, state = kla_scan_unchecked(*inputs, return_state=True, backend=layer.backend, cu_seqlens=cu)
        return (y, y_var, *state)

    def windows(z, window, cu):
        return document_conv(z, layer.conv, cu, window), document_windows(z, cu, window)

    def whole(x, cu):
        return (layer(x, cu_seqlens=cu),)

    def continued(x, conv, var, mu, cu):
        out, new = layer(x, KLAState(conv, var, mu), cu_seqlens=cu)
        return (out, *new)

    return {"sliced_search": (sliced_search, (cu,), []), "documents": (documents, (cu,), []),
            "conv": (conv, (z, cu), [z]), "scan": (scan, (*scan_args, cu), scan_args),
            "windows": (windows, (z, state.conv, cu), [z, state.conv]),
            "layer": (whole, (x, cu), list(layer.parameters())),
            "layer_state": (continued, (x, *state, cu), [*layer.parameters(), *state])}


def with_gradients(outs, wrt):
    """``outs`` and the gradients of a fixed random functional of them with respect to ``wrt``."""
    if not wrt:
        return tuple(outs)
    g = torch.Generator().manual_seed(3)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return tuple(outs) + tuple(torch.zeros_like(x) if d is None else d for x, d in zip(wrt, grads))


def compare(fn, args, wrt, compiler: str) -> tuple[float, float]:
    """``(largest |compiled - eager|, largest |eager|)`` over every output of ``fn`` and gradient."""
    torch._dynamo.reset()
    eager = with_gradients(fn(*args), wrt)
    compiled = with_gradients(torch.compile(fn, fullgraph=True, backend=compiler)(*args), wrt)
    compiled, eager = ([x.detach().double() for x in xs] for xs in (compiled, eager))
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(compiled, eager))
    scale = max(float(b.abs().max()) if b.numel() else 0.0 for b in eager)
    return diff, scale


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.packed_compile``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1,5,2,9", help="document lengths, repeated --repeat times")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--backend", default="auto", help="the layer's scan backend")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compilers", default=",".join(COMPILERS))
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--out")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")] * args.repeat
    layer, x, cu = layer_and_inputs(lengths, torch.device(args.device), args.backend)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {args.device}, backend {args.backend}, "
          f"{len(lengths)} documents, {sum(lengths)} tokens")
    rows, first = {}, None
    for name, (fn, fn_args, wrt) in stages(layer, x, cu).items():
        for compiler in args.compilers.split(","):
            diff, scale = compare(fn, fn_args, wrt, compiler)
            rows[f"{name}/{compiler}"] = dict(max_abs_diff=diff, max_abs=scale)
            departs = diff > args.tol * max(scale, 1.0)
            print(f"{name:>13} {compiler:>9}: max |compiled - eager| {diff:.3e} (largest value {scale:.3e})"
                  + ("  DEPARTS" if departs else ""))
            if departs and first is None and name != "sliced_search":
                first = f"{name}/{compiler}"
    print(f"first stage that departs from eager: {first or 'none'}")
    result = dict(torch=torch.__version__, device=args.device, backend=args.backend, stages=rows, first=first)
    save(args.out, result)
    return result


if __name__ == "__main__":
    main()
