"""A suite small enough for the runner's tests: ``--rows N`` rows of ``(n, square)``, written to
``--out`` (or ``--json``) as ``{"rows": [...], "argv": [...]}``."""

from __future__ import annotations

import argparse
import json
import sys


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--out", "--json", dest="out", default=None)
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    result = dict(argv=sys.argv[1:] if argv is None else list(argv),
                  rows=[dict(n=n, square=float(n * n) / 3) for n in range(args.rows)])
    print(f"tiny suite: {args.rows} rows", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
