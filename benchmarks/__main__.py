"""The benchmarks' one command.

    python -m benchmarks                             # the suites, one line each
    python -m benchmarks run SUITE [ARGS...]         # the suite's main(ARGS); ARGS --help for its options
    python -m benchmarks headline --out DIR [--only a,b] [--gpu-only] [--dry-run]   # rerun the published tables
"""

from __future__ import annotations

import importlib
import inspect
import sys

from benchmarks.suites import SUITES, available


def listing() -> str:
    """One line per suite: its name, CPU or GPU, what it measures (or that its module is missing)."""
    width = max(len(name) for name in SUITES)
    lines = []
    for s in SUITES.values():
        what = s.measures if available(s) else f"skipped: {s.module} is not in this checkout"
        lines.append(f"{s.name:<{width}}  {s.device:<8}  {what}")
    return "\n".join(lines)


def run(name: str, args: list[str]) -> int:
    """Call suite ``name``'s ``main(args)`` (``main()`` reading ``sys.argv`` for a module whose ``main``
    takes no arguments); 2, with a line saying why, for an unknown or missing suite."""
    suite = SUITES.get(name)
    if suite is None:
        print(f"unknown suite {name!r}; the suites are {', '.join(SUITES)}", file=sys.stderr)
        return 2
    if not available(suite):
        print(f"suite {name!r}: {suite.module} is not in this checkout", file=sys.stderr)
        return 2
    sys.argv = [f"python -m benchmarks run {name}", *args]   # what the suite's usage line and sys.argv show
    main = importlib.import_module(suite.module).main
    if inspect.signature(main).parameters:
        main(args)
    else:
        main()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "list":
        print(listing())
        return 0
    if argv[0] == "run" and len(argv) >= 2:
        return run(argv[1], argv[2:])
    if argv[0] == "headline":
        from benchmarks import headline
        return headline.main(argv[1:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
