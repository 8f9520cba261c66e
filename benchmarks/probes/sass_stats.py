"""Compile kernels for a GPU target without a GPU and count the instructions of their loops.

    python -m benchmarks.probes.sass_stats                 # every kernel below, for sm_90 (H100/H200)
    python -m benchmarks.probes.sass_stats kla_fwd --dump  # one kernel, its SASS printed
    python -m benchmarks.probes.sass_stats --save before/  # every kernel's SASS to before/<name>.sass
    python -m benchmarks.probes.sass_stats kla_fwd_split_novar --pointer v_ptr=bf16   # v in bf16

Uses Triton's bundled ``ptxas`` and ``nvdisasm``, so it runs on a CPU-only machine: a kernel that
does not compile for the GPU fails here, and the instruction mix of each loop body (the code between
a loop label and its backward branch) shows what a change to a kernel costs before any GPU time.
Static counts, not timings: a loop's count is per iteration of its body as compiled (after
unrolling), for each thread; each kernel's registers per thread and local memory (spills) come
first, and each loop's asynchronous copies (``LDGSTS``, the loads Triton's software pipeliner issues
ahead) beside its plain loads (``LDG``, which the loop waits on), since a load the pipeliner could
not make asynchronous (a 16-bit value a lane is below the 4 bytes a copy moves) costs its latency
every iteration. ``--pointer NAME=TYPE`` compiles with those pointer arguments of another element
type (``v_ptr=bf16``), to see what a dtype costs before any GPU time. ``--save`` writes each
kernel's SASS without addresses, so that two checkouts compiled by the same Triton compare with
``diff -r``: a change whose SASS is identical at every launch shape listed here cannot change the
kernels' speed (run it with the GPU machine's Triton, installed with ``pip install --target DIR
triton==<version>`` and put first on ``PYTHONPATH``). The kernels compiled are always this
checkout's (:func:`this_checkout`), also where another checkout is installed in editable mode. The
test suite runs it (``benchmarks/tests/test_sass.py``), so a kernel that compiles only under the
interpreter fails CI.
"""

import argparse
import collections
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


ALIGNED = "aligned"  # a runtime argument specialised as divisible by 16 (a pointer: 16-byte aligned)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def this_checkout():
    """Make ``kalmanscan`` and ``kalmanscan.kernels`` this checkout's (``ROOT``), and return the
    kernels' directory.

    The kernels live in ``ROOT/kernels`` (``package-dir`` in pyproject.toml). With another checkout
    installed in editable mode, its import finder would supply ``kalmanscan.kernels`` even when
    ``kalmanscan`` itself comes from here, and two checkouts' SASS would silently be one's.
    """
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import kalmanscan
    if not os.path.abspath(kalmanscan.__file__).startswith(ROOT + os.sep):
        raise SystemExit(f"kalmanscan is imported from {kalmanscan.__file__}, not from {ROOT}: "
                         "run from the checkout's root")
    kernels = os.path.join(ROOT, "kernels")
    if "kalmanscan.kernels" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "kalmanscan.kernels", os.path.join(kernels, "__init__.py"), submodule_search_locations=[kernels])
        module = importlib.util.module_from_spec(spec)
        sys.modules["kalmanscan.kernels"] = module
        spec.loader.exec_module(module)
    found = os.path.dirname(os.path.abspath(sys.modules["kalmanscan.kernels"].__file__))
    if found != kernels:
        raise SystemExit(f"kalmanscan.kernels was already imported from {found}, not {kernels}")
    return kernels


POINTER_TYPES = {"loglik_sum_ptr": "*fp64", "starts_ptr": "*i32", "ends_ptr": "*i32"}
"""Pointer arguments whose element type is not float32 in a float32 launch."""


def _pointer_types(specs):
    """``{"v_ptr": "*bf16", ...}`` from ``["v_ptr=bf16", ...]`` (``--pointer``)."""
    types = {}
    for spec in specs:
        name, sep, ty = spec.partition("=")
        if not sep or not name.endswith("_ptr") or not ty:
            raise SystemExit(f"--pointer takes NAME_ptr=TYPE (e.g. v_ptr=bf16), got {spec!r}")
        types[name] = "*" + ty
    return types


def _signature(fn, const):
    """Triton signature, constexprs and attributes of ``fn``: ``*fp32`` for ``*_ptr`` arguments
    (those of :data:`POINTER_TYPES` excepted),
    ``i32`` for the other runtime ones, ``constexpr`` for the compile-time ones (``const`` keeps only
    those ``fn`` takes). ``const`` may also specialise runtime arguments as a launch does: a value
    makes it a constexpr (Triton specialises integers equal to 1), :data:`ALIGNED` marks it divisible
    by 16, and ``"*_ptr": ALIGNED`` marks every pointer 16-byte aligned."""
    sig, attrs = {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        ptr = name.endswith("_ptr")
        if p.is_constexpr or (name in const and const[name] != ALIGNED):
            sig[name] = "constexpr"
        else:
            sig[name] = POINTER_TYPES.get(name, "*fp32") if ptr else "i32"
            if const.get(name) == ALIGNED or (ptr and const.get("*_ptr") == ALIGNED):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, {k: v for k, v in const.items() if sig.get(k) == "constexpr"}, attrs


def kernels(fc=None, cfg=None):
    """``name -> (jit function, constexprs, num_warps)``: every kernel at its production launch shape,
    and the hot ones again with the other values of their feature switches (``*_variants``). Launch
    shapes from the filter's :class:`~kalmanscan.ops.filter.triton.config.FilterConfig` ``fc`` and KLA's
    :class:`~kalmanscan.ops.kla.triton.KLAConfig` ``cfg`` (default: their ``DEFAULT_CONFIG``)."""
    from kalmanscan.kernels.filter.bwd import filter_bwd_agg_kernel, filter_bwd_carry_kernel, filter_bwd_kernel
    from kalmanscan.kernels.filter.fwd import (filter_agg_kernel, filter_carry_kernel, filter_fwd_kernel,
                                               filter_total_kernel)
    from kalmanscan.kernels.filter.rts import rts_agg_kernel, rts_kernel
    from kalmanscan.kernels.filter.tiles import filter_tile_agg_kernel, filter_tile_fwd_kernel
    from kalmanscan.kernels.filter.tiles_bwd import filter_tile_bwd_agg_kernel, filter_tile_bwd_kernel
    from kalmanscan.kernels.kla.adjoint_map import kla_adjoint_map_kernel
    from kalmanscan.kernels.kla.bwd import kla_bwd_kernel
    from kalmanscan.kernels.kla.fwd import kla_fwd_kernel
    from kalmanscan.kernels.kla.split import kla_piece_map_kernel
    from kalmanscan.ops.filter.triton.config import DEFAULT_CONFIG as FILTER_DEFAULT
    from kalmanscan.ops.kla.triton.library import SPLIT_CONFIG, l2_policies
    from kalmanscan.ops.kla.triton.backend import DEFAULT_CONFIG as KLA_DEFAULT
    fc = fc or FILTER_DEFAULT
    cfg = cfg or KLA_DEFAULT
    common = dict(TRANS_STEP=False, OBS_STEP=False, WIDE=False, WRITE_MU=True, WRITE_LAM=True,
                  WRITE_PRED=False, POSTERIOR=False)
    other = dict(TRANS_STEP=True, OBS_STEP=True, WIDE=True, POSTERIOR=True)
    walk = dict(common, BLOCK=fc.block, UNROLL=fc.unroll, PREFETCH=fc.prefetch)
    # tiles as launched for one contiguous series (C = 1, unit strides, aligned, T a multiple of 16):
    # the loads and stores of y and the outputs are then vectors (unspecialised, they are not, and
    # the old one-step-per-lane tile scan compiled to about 2.5x its launched instruction count)
    tile = dict(common, TILE=fc.tile, ROW=fc.tile_row, C=1, sy_b=ALIGNED, sy_t=1, sy_c=1, T=ALIGNED,
                **{"*_ptr": ALIGNED})
    bwd = dict(common, BLOCK=fc.block, UNROLL=fc.bwd_unroll,
               HAS_G_MU=True, HAS_G_LAM=True, HAS_G_PM=True, HAS_G_PV=True)
    loglik = dict(bwd, HAS_G_MU=False, HAS_G_LAM=False)
    tile_fwd = dict(tile, CLOSED=fc.tile_closed)
    tile_bwd = dict(tile, HAS_G_MU=True, HAS_G_LAM=True, HAS_G_PM=True, HAS_G_PV=True)
    # KLA as launched at M = 1024, S = 16: Triton specialises the 16-byte aligned pointers, the
    # integers divisible by 16 and those equal to 1. DEFAULT_CONFIG at B = 8, L = 2048 walks time in one
    # stretch (n_pieces = 1); SPLIT_CONFIG at B = 2, L = 8192 on 132 multiprocessors splits the
    # forward into 16 stretches and the backward into 8 (not a multiple of 16: not specialised).
    launched = {"*_ptr": ALIGNED, "L": ALIGNED, "M": ALIGNED, "S": ALIGNED, "n_chunks": ALIGNED,
                "n_mblocks": ALIGNED, "piece_len": ALIGNED}
    kla = dict(launched, n_pieces=1, CHUNK=cfg.chunk, BLOCK_S=16, HAS_INIT=False, SAVE=False,
               STATES_FIRST=cfg.states_first, VAR=True, EVEN=False, **l2_policies(cfg))
    kla_fwd = dict(kla, BLOCK_M=cfg.block_m, STAGES=cfg.stages, UNROLL=cfg.unroll or 1)
    kla_bwd = dict(kla, BLOCK_M=cfg.bwd_block_m, STAGES=cfg.bwd_stages, UNROLL=cfg.bwd_unroll or 1)
    split = SPLIT_CONFIG  # as launched where time is split: a training forward saves checkpoints
    split_fwd = dict(kla, BLOCK_M=split.block_m, STAGES=split.stages, UNROLL=split.unroll or 1, SAVE=True,
                     STATES_FIRST=split.states_first, n_pieces=ALIGNED)
    split_bwd = {k: v for k, v in kla.items() if k != "n_pieces"}
    split_bwd.update(BLOCK_M=split.bwd_block_m, STAGES=split.bwd_stages, UNROLL=split.bwd_unroll or 1,
                     STATES_FIRST=split.states_first)
    carry = dict(CH=fc.carry_chunk)
    return {
        "filter_agg": (filter_agg_kernel, dict(walk, CLOSED=fc.walk_closed, CHUNK=fc.closed_chunk), fc.num_warps),
        "filter_fwd": (filter_fwd_kernel, walk, fc.num_warps),
        "filter_tile_agg": (filter_tile_agg_kernel, tile_fwd, fc.tile_warps),
        "filter_tile_fwd": (filter_tile_fwd_kernel, tile_fwd, fc.tile_warps),
        "filter_bwd_agg": (filter_bwd_agg_kernel, bwd, fc.num_warps),
        "filter_bwd": (filter_bwd_kernel, bwd, fc.num_warps),
        "filter_carry": (filter_carry_kernel, carry, fc.carry_warps),
        "filter_bwd_carry": (filter_bwd_carry_kernel, carry, fc.carry_warps),
        "filter_total": (filter_total_kernel, carry, fc.carry_warps),
        "kla_fwd": (kla_fwd_kernel, kla_fwd, cfg.num_warps),
        "kla_bwd": (kla_bwd_kernel, kla_bwd, cfg.bwd_num_warps),
        "kla_adjoint_map": (kla_adjoint_map_kernel, kla_bwd, cfg.bwd_num_warps),
        "kla_piece_map": (kla_piece_map_kernel, kla_fwd, cfg.num_warps),
        "kla_fwd_split": (kla_fwd_kernel, split_fwd, split.num_warps),
        "kla_bwd_split": (kla_bwd_kernel, split_bwd, split.bwd_num_warps),
        "kla_adjoint_map_split": (kla_adjoint_map_kernel, split_bwd, split.bwd_num_warps),
        "kla_piece_map_split": (kla_piece_map_kernel, split_fwd, split.num_warps),
        # as the layer launches them: without y_var, with bounds masks (KLAConfig.even off)
        "kla_fwd_novar": (kla_fwd_kernel, dict(kla_fwd, SAVE=True, VAR=False), cfg.num_warps),
        "kla_bwd_novar": (kla_bwd_kernel, dict(kla_bwd, VAR=False), cfg.bwd_num_warps),
        "kla_adjoint_map_novar": (kla_adjoint_map_kernel, dict(kla_bwd, VAR=False), cfg.bwd_num_warps),
        "kla_fwd_split_novar": (kla_fwd_kernel, dict(split_fwd, VAR=False), split.num_warps),
        "kla_bwd_split_novar": (kla_bwd_kernel, dict(split_bwd, VAR=False), split.bwd_num_warps),
        "kla_adjoint_map_split_novar": (kla_adjoint_map_kernel, dict(split_bwd, VAR=False), split.bwd_num_warps),
        # KLAConfig(even=True) at M = 1024, S = 16: the same without the bounds masks of full blocks
        "kla_fwd_split_even": (kla_fwd_kernel, dict(split_fwd, VAR=False, EVEN=True), split.num_warps),
        "kla_bwd_split_even": (kla_bwd_kernel, dict(split_bwd, VAR=False, EVEN=True), split.bwd_num_warps),
        "kla_adjoint_map_split_even": (kla_adjoint_map_kernel, dict(split_bwd, VAR=False, EVEN=True),
                                       split.bwd_num_warps),
        "kla_piece_map_split_even": (kla_piece_map_kernel, dict(split_fwd, EVEN=True), split.num_warps),
        # KLAConfig(l2_hints=False): the backward with the caches' default eviction
        "kla_bwd_split_no_hints": (kla_bwd_kernel, dict(split_bwd, VAR=False, **l2_policies(dataclasses.replace(
            split, l2_hints=False))), split.bwd_num_warps),
        "rts_agg": (rts_agg_kernel, walk, fc.num_warps),
        "rts": (rts_kernel, walk, fc.num_warps),
        "rts_wide": (rts_kernel, dict(walk, WIDE=True), fc.num_warps),
        "filter_fwd_variants": (filter_fwd_kernel, dict(walk, **other, PREFETCH=False), fc.num_warps),
        "filter_fwd_posterior": (filter_fwd_kernel, dict(walk, POSTERIOR=1023, SUM_LOGLIK=True), fc.num_warps),
        "filter_tile_fwd_variants": (filter_tile_fwd_kernel, dict(tile_fwd, **other), fc.tile_warps),
        "filter_tile_posterior": (filter_tile_fwd_kernel, dict(tile_fwd, POSTERIOR=True), fc.tile_warps),
        "filter_bwd_variants": (filter_bwd_kernel, dict(bwd, **other), fc.num_warps),
        "filter_bwd_agg_loglik": (filter_bwd_agg_kernel, loglik, fc.num_warps),
        "filter_tile_bwd_agg": (filter_tile_bwd_agg_kernel, tile_bwd, fc.tile_warps),
        "filter_tile_bwd": (filter_tile_bwd_kernel, tile_bwd, fc.tile_warps),
        "filter_tile_bwd_variants": (filter_tile_bwd_kernel, dict(tile_bwd, **other), fc.tile_warps),
        "filter_tile_bwd_loglik": (filter_tile_bwd_kernel, dict(tile_bwd, HAS_G_MU=False, HAS_G_LAM=False),
                                   fc.tile_warps),
        "filter_tile_bwd_mean": (filter_tile_bwd_kernel,
                                 dict(tile_bwd, HAS_G_LAM=False, HAS_G_PM=False, HAS_G_PV=False), fc.tile_warps),
        "filter_bwd_loglik": (filter_bwd_kernel, loglik, fc.num_warps),
        "filter_bwd_mean": (filter_bwd_kernel, dict(bwd, HAS_G_LAM=False, HAS_G_PM=False, HAS_G_PV=False),
                            fc.num_warps),
        "kla_fwd_variants": (kla_fwd_kernel, dict(kla_fwd, HAS_INIT=True, SAVE=True), cfg.num_warps),
        # packed documents (cu_seqlens): the state reset and stored per document, time split too
        "kla_fwd_varlen": (kla_fwd_kernel, dict(split_fwd, HAS_INIT=True, VARLEN=True), split.num_warps),
        "kla_bwd_varlen": (kla_bwd_kernel, dict(split_bwd, HAS_INIT=True, VARLEN=True), split.bwd_num_warps),
        "kla_adjoint_map_varlen": (kla_adjoint_map_kernel, dict(split_bwd, HAS_INIT=True, VARLEN=True),
                                   split.bwd_num_warps),
        "kla_piece_map_varlen": (kla_piece_map_kernel, dict(split_fwd, HAS_INIT=True, VARLEN=True), split.num_warps),
    }


def _tool(name):
    """Path of one of Triton's bundled CUDA tools."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sass(fn, const, num_warps, arch=90):
    """``(SASS text, resources)`` of ``fn`` compiled for ``sm_<arch>``; ``resources`` is
    ``cuobjdump -res-usage``'s line for it (``REG``: registers per thread, ``LOCAL``: bytes of
    local memory per thread, that is spills when the kernel has no local arrays)."""
    sig, const, attrs = _signature(fn, const)
    compiled = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps))
    path = f"/tmp/sass_stats_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        text = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    finally:
        os.remove(path)
    return text, dict(_RESOURCE.findall(usage.split("Function", 1)[-1].splitlines()[1]))


_RESOURCE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def loops(text):
    """``[(label, Counter of opcodes)]`` for each loop: a label with a later branch back to it."""
    lines = text.splitlines()
    where = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line.strip())
        if m:
            where[m.group(1)] = i
    out = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and m.group(1) in where and where[m.group(1)] < i:
            body = lines[where[m.group(1)]:i + 1]
            out.append((m.group(1), collections.Counter(
                x.group(1) for x in map(_INSTR.search, body) if x)))
    return out


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.probes.sass_stats``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="kernels to compile (default: all)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", action="store_true", help="print the SASS")
    ap.add_argument("--list", action="store_true", help="only print the kernels' names")
    ap.add_argument("--save", metavar="DIR", help="write each kernel's SASS, addresses removed, to DIR/<name>.sass")
    ap.add_argument("--pointer", action="append", default=[], metavar="NAME=TYPE",
                    help="type a pointer argument's elements otherwise, e.g. v_ptr=bf16 (repeatable)")
    return ap


def main(argv: list[str] | None = None):
    args = parser().parse_args(argv)
    POINTER_TYPES.update(_pointer_types(args.pointer))
    print(f"kernels from {this_checkout()}, Triton {triton.__version__}", file=sys.stderr)
    table = kernels()
    if args.list:
        print("\n".join(table))
        return
    if args.save:
        os.makedirs(args.save, exist_ok=True)
    for name in args.names or table:
        text, res = sass(*table[name], arch=args.arch)
        if args.dump:
            print(text)
        if args.save:
            with open(os.path.join(args.save, f"{name}.sass"), "w") as f:
                f.write(_ADDRESS.sub("", text))
        print(f"{name:16s} registers {res['REG']}, local (spills) {res['LOCAL']} B, shared {res['SHARED']} B")
        for label, ops in loops(text):
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
            print(f"{name:16s} loop {label:8s} {sum(ops.values()):5d} instructions: {top}; "
                  f"async copies {ops['LDGSTS']}, plain loads {ops['LDG']}")


if __name__ == "__main__":
    main()
