"""fla's kernels at the first of their autotuning configs, for benchmark and evidence runs only.

fla autotunes each kernel on first use (minutes per shape on a fresh machine). With the
environment variable ``KALMANSCAN_FLA_FIRST_CONFIG=1``, :func:`import_fla` imports fla's GLA
kernels while ``triton.autotune`` keeps only the first config it is given: seconds, the same values
(they do not depend on the config), untuned speed (a lower bound on fla's). The harness calls it
before anything imports fla (``benchmarks.bench_model``, ``evidence.train``); the library itself
(:mod:`kalmanscan.nn.baselines.gla`) patches nothing and finds fla already imported. Without the
variable, or with fla imported before, fla tunes as usual.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENV", "import_fla"]

ENV = "KALMANSCAN_FLA_FIRST_CONFIG"


def import_fla() -> bool:
    """Import ``fla.ops.gla`` with first configs when :data:`ENV` is ``1`` and fla is installed and
    not imported yet; whether the switch applied. ``triton.autotune`` is restored afterwards."""
    if os.environ.get(ENV) != "1" or "fla" in sys.modules:
        return False
    try:
        import triton
    except ImportError:
        return False
    autotune = triton.autotune
    triton.autotune = lambda configs, *args, **kwargs: autotune(configs[:1], *args, **kwargs)
    try:
        import fla.ops.gla  # noqa: F401
    except ImportError:
        return False
    finally:
        triton.autotune = autotune
    return True
