"""What every stored result records about the code it ran: the commit."""

from __future__ import annotations

import os
import subprocess

__all__ = ["commit"]


def commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout, with ``+dirty`` when it has local changes;
    the environment variable ``BENCHMARKS_COMMIT`` overrides it (for copies without git data)."""
    if os.environ.get("BENCHMARKS_COMMIT"):
        return os.environ["BENCHMARKS_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")
