"""Rerun the published tables on the machine at hand.

``python -m benchmarks headline --out DIR [--only a,b] [--gpu-only] [--dry-run]`` runs, for each suite (or those
named by ``--only``), the commands of its published tables (:data:`benchmarks.suites.SUITES`), each
in its own process, and writes ``DIR/<suite>.json`` (``suite``, ``measures`` and one entry per
command: the command, its exit status, its wall time in seconds and the JSON the suite wrote) and
``DIR/headline.md`` (the tables, one section per command, after a line naming the machine, the
commit and the date). A command that needs CUDA is skipped on a machine without it, with a line
saying so; ``--gpu-only`` skips the CPU commands (their tables name the CPU machine they come
from); ``--dry-run`` prints the commands without running them.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

from benchmarks.common import commit
from benchmarks.suites import SUITES, Run, Suite, available, command
from benchmarks.tables import markdown

__all__ = ["parser", "execute", "headline", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks headline``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks headline", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the JSON files and headline.md")
    ap.add_argument("--only", default=None, help="comma-separated suites (default: all)")
    ap.add_argument("--gpu-only", action="store_true",
                    help="run only the commands that need CUDA (the CPU tables come from the CPU machine they name)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return ap


def selected(only: str | None, suites: Mapping[str, Suite]) -> list[Suite]:
    """The suites named in ``only`` (comma-separated), or all; a ValueError names an unknown one."""
    if only is None:
        return list(suites.values())
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in suites]
    if unknown:
        raise ValueError(f"--only: unknown suites {unknown}; choose from {sorted(suites)}")
    return [suites[n] for n in names]


def machine(cuda: bool) -> str:
    """The device the GPU suites run on, else the processor."""
    if cuda:
        import torch
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def execute(suite: Suite, run: Run, python: str = sys.executable) -> dict:
    """Run ``suite``'s module with ``run``'s flags and environment in a new process from the
    repository root, its output passed through; its exit status, wall time, JSON result (``None``
    if it wrote none) and, when it failed, the last lines it printed."""
    tail = collections.deque(maxlen=40)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        argv = [python, "-m", run.module or suite.module, *run.flags, "--out" if run.module else suite.out, path]
        t0 = time.perf_counter()
        with subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **dict(run.env)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                print(line, end="", flush=True)
                tail.append(line)
        seconds = time.perf_counter() - t0
        result = None
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
    out = dict(command=command(suite, run), returncode=proc.returncode, seconds=round(seconds, 1), result=result)
    if proc.returncode:
        out["output_tail"] = "".join(tail)
    return out


def write(out_dir: str, written: Mapping[str, dict], lines: list[str]) -> None:
    """``out_dir/<suite>.json`` for each suite run so far and ``out_dir/headline.md``."""
    os.makedirs(out_dir, exist_ok=True)
    for name, record in written.items():
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(record, f, indent=1)
    with open(os.path.join(out_dir, "headline.md"), "w") as f:
        f.write("\n".join(lines))


def headline(out_dir: str, only: str | None = None, suites: Mapping[str, Suite] = SUITES,
             cuda: bool | None = None, dry_run: bool = False, gpu_only: bool = False) -> dict[str, dict]:
    """Run the published tables' commands of the suites ``only`` names (all by default) and write
    their JSON and ``headline.md`` into ``out_dir``, after each command (a run stopped early keeps
    what finished); GPU commands are skipped, with a line, when ``cuda`` is false (default: whether
    torch sees a CUDA device); with ``gpu_only`` the CPU commands are skipped, with a line. Returns
    the JSON of each suite."""
    chosen = selected(only, suites)
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = ["# Benchmark tables", "", f"Machine: {machine(cuda)}; commit {commit()}; {now}.", ""]
    written = {}
    for suite in chosen:
        if not available(suite):
            print(f"skip {suite.name}: {suite.module} is not in this checkout", flush=True)
            continue
        if not suite.headline and only is not None:
            print(f"skip {suite.name}: no published table", flush=True)
        for run in suite.headline:
            cmd = command(suite, run)
            if gpu_only and not run.gpu:
                print(f"skip {suite.name} (CPU, --gpu-only): {cmd}", flush=True)
                continue
            lines += [f"## {suite.name}: {suite.measures}", ""]
            if run.gpu and not cuda:
                print(f"skip {suite.name} (GPU, no CUDA on this machine): {cmd}", flush=True)
                lines += [f"`{cmd}`: skipped, no CUDA on this machine.", ""]
                continue
            print(f"run {cmd}", flush=True)
            if dry_run:
                continue
            r = execute(suite, run)
            written.setdefault(suite.name, dict(suite=suite.name, measures=suite.measures, runs=[]))["runs"].append(r)
            lines += [f"`{cmd}` (exit {r['returncode']}, {r['seconds']:.0f} s)", ""]
            lines += markdown(r["result"]) if r["result"] is not None else ["No JSON written.", ""]
            write(out_dir, written, lines)
    if not dry_run:
        write(out_dir, written, lines)
        print(f"wrote {os.path.join(out_dir, 'headline.md')} and {len(written)} JSON files", flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        written = headline(args.out, args.only, dry_run=args.dry_run, gpu_only=args.gpu_only)
    except ValueError as err:
        ap.error(str(err))
    failed = [r["command"] for w in written.values() for r in w["runs"] if r["returncode"]]
    for cmd in failed:
        print(f"failed: {cmd}", flush=True)
    return 1 if failed else 0
