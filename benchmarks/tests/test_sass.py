"""Every kernel compiles for the GPU (sm_90, the H100/H200), not only under the interpreter.

The interpreter runs the kernels' Python; some code it accepts does not compile (a jit function
returning different types from two branches, say). ``benchmarks.probes.sass_stats`` compiles every kernel
and the other values of its feature switches with Triton's bundled ``ptxas``, no GPU needed, in a
process without ``TRITON_INTERPRET`` (the hardware reciprocal of :mod:`kalmanscan.kernels.fast_math` is
chosen at import). The kernels are compiled in :data:`SHARDS` processes (one test each), so that
pytest-xdist spreads the minute of compilation over its workers.
"""

import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDS = 2


def _sass_stats(*args, cache=None):
    """The output of ``python -m benchmarks.probes.sass_stats *args`` without ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=ROOT)
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.probes.sass_stats", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@functools.cache
def _kernel_names():
    return tuple(sorted(_sass_stats("--list").split()))


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_every_kernel_compiles_for_sm90(shard, tmp_path):
    assert len(_kernel_names()) >= 20
    names = _kernel_names()[shard::SHARDS]
    out = _sass_stats(*names, cache=tmp_path)
    assert {line.split()[0] for line in out.splitlines() if " loop " in line} == set(names)
    assert "MUFU" in out


def test_no_nested_tuple_targets_in_kernels():
    """Triton 3.6 (the GPU image's) fails at the first launch of a jit function that assigns to a
    nested tuple (``a, (b, c) = f()``: "unhashable type: 'list'" while hashing its dependencies);
    newer Triton, which CI and the interpreter use, accepts it. Unpack in two statements instead."""
    import ast
    import glob

    nested = []
    for path in sorted(glob.glob(os.path.join(ROOT, "kernels", "**", "*.py"), recursive=True)):
        for node in ast.walk(ast.parse(open(path).read())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.For, ast.AnnAssign)) else []
            nested += [f"{os.path.relpath(path, ROOT)}:{node.lineno}" for t in targets if isinstance(t, ast.Tuple)
                       and any(isinstance(e, (ast.Tuple, ast.List)) for e in t.elts)]
    assert not nested, nested
