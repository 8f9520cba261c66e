"""Every ``python -m benchmarks run`` command of the README and docs/performance.md (and every
``python -m benchmarks.probes...`` one there) names a suite and flags its module's command line
accepts, as do the headline's own commands; and every such command of docs/performance.md is one
the headline reruns (the same options, in any order, wherever it writes)."""

import importlib
import importlib.util
import os
import re
import shlex

import pytest

from benchmarks.headline import ROOT
from benchmarks.suites import SUITES, command

DOCS = ("README.md", os.path.join("docs", "performance.md"))
RUN = re.compile(r"((?:[A-Z_]+=\S+\s+)*python -m benchmarks(?: run|\.probes\.\w+)\s[^`]*)")


def documented(path: str) -> list[str]:
    """The ``python -m benchmarks run`` commands of a markdown file: in inline code (which may wrap
    over lines) and in fenced blocks (a line each, backslash continuations joined)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    inline = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    found = [m.group(1) for chunk in inline + lines for m in RUN.finditer(" ".join(chunk.split()))]
    return [c.split("#")[0].strip() for c in found]


def without_out(words: list[str]) -> list[str]:
    """``words`` without ``--out PATH`` / ``--json PATH`` (the headline chooses where results go)."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in ("--out", "--json"):
            skip = True
        elif not w.startswith(("--out=", "--json=")):
            out.append(w)
    return out


def resolved(cmd: str) -> tuple[tuple[str, ...], str | None, list[str]]:
    """``(environment, module, flags)`` of ``[ENV=V ...] python -m benchmarks run NAME FLAGS`` (the
    module ``None`` for an unknown suite, the flags then empty) or of ``python -m MODULE FLAGS``."""
    words = shlex.split(cmd)
    i = words.index("python")
    env, module, rest = tuple(words[:i]), words[i + 2], words[i + 3:]
    if module == "benchmarks":
        suite = SUITES.get(rest[1])
        return env, suite and suite.module, rest[2:]
    return env, module, rest


def key(cmd: str):
    """What a command runs: its environment, module and parsed options (``--out`` left out)."""
    env, module, flags = resolved(cmd)
    args = vars(importlib.import_module(module).parser().parse_args(without_out(flags)))
    return env, module, sorted((k, str(v)) for k, v in args.items() if k not in ("out", "json"))


DOC_COMMANDS = [(path, cmd) for path in DOCS for cmd in documented(path)]
HEADLINE = [command(s, r) for s in SUITES.values() for r in s.headline]


@pytest.mark.parametrize("cmd", [c for _, c in DOC_COMMANDS] + HEADLINE)
def test_command_names_a_suite_and_flags_it_accepts(cmd):
    _, module, flags = resolved(cmd)
    assert module is not None, f"{cmd}: no such suite (python -m benchmarks lists them)"
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not in this checkout")
    importlib.import_module(module).parser().parse_args(flags)


def test_every_command_of_performance_md_is_rerun_by_the_headline():
    rerun = [key(c) for c in HEADLINE]
    missing = [c for path, c in DOC_COMMANDS if path.endswith("performance.md") and key(c) not in rerun]
    assert not missing, f"commands of docs/performance.md that the headline does not rerun: {missing}"


def test_documented_finds_wrapped_and_fenced_commands(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("Run `python -m benchmarks run filter\n--skip-checks --out f.json`, then\n\n```bash\n"
                   "KALMANSCAN_FLA_FIRST_CONFIG=1 python -m benchmarks run model --compile \\\n    --groups 3  # note\n"
                   "```\n")
    assert documented(str(doc)) == ["python -m benchmarks run filter --skip-checks --out f.json",
                                    "KALMANSCAN_FLA_FIRST_CONFIG=1 python -m benchmarks run model --compile --groups 3"]
    assert without_out(["a", "--out", "x", "--json=y", "b"]) == ["a", "b"]
