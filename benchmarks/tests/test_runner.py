"""``python -m benchmarks``: the listing, ``run``'s dispatch to a suite's ``main``, and ``headline``
on the CPU (a tiny suite in a new process, a GPU suite skipped with a line)."""

import json
import subprocess
import sys

import pytest

from benchmarks import __main__ as cli
from benchmarks import headline, suites
from benchmarks.suites import Run, Suite

TINY = Suite("tiny", "benchmarks.tests.tiny_suite", "squares", "CPU", (Run(("--rows", "3"), gpu=False),))
ON_GPU = Suite("tiny_gpu", "benchmarks.tests.tiny_suite", "squares on a GPU", "GPU", (Run(("--rows", "5")),))


def test_listing_names_every_suite_once_with_its_device():
    out = subprocess.run([sys.executable, "-m", "benchmarks"], capture_output=True, text=True, check=True,
                         cwd=headline.ROOT).stdout
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(suites.SUITES)
    for line, suite in zip(lines, suites.SUITES.values()):
        assert line.split()[1].rstrip(",") in ("CPU", "GPU")
        assert ("is not in this checkout" in line) != suites.available(suite)


def test_run_calls_the_suites_main_with_the_arguments(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(suites.SUITES, "tiny", TINY)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = tmp_path / "r.json"
    assert cli.main(["run", "tiny", "--rows", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["argv"] == ["--rows", "4", "--out", str(out)] and len(result["rows"]) == 4
    assert cli.main(["run", "no_such_suite"]) == 2
    assert "unknown suite 'no_such_suite'" in capsys.readouterr().err


def test_run_hands_a_main_without_arguments_sys_argv(monkeypatch, tmp_path):
    (tmp_path / "argv_suite.py").write_text("import sys\nseen = []\n\n\ndef main():\n    seen.append(sys.argv[:])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(suites.SUITES, "argv", Suite("argv", "argv_suite", "-", "CPU"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli.main(["run", "argv", "--x", "1"]) == 0
    import argv_suite
    assert argv_suite.seen == [["python -m benchmarks run argv", "--x", "1"]]


def test_run_of_a_missing_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(suites.SUITES, "gone", Suite("gone", "benchmarks.no_such_module", "-", "GPU"))
    assert cli.main(["run", "gone"]) == 2
    assert "benchmarks.no_such_module is not in this checkout" in capsys.readouterr().err


def test_headline_on_the_cpu_writes_json_and_markdown_and_skips_gpu_runs(tmp_path, capsys):
    as_json = Suite("tiny_json", TINY.module, "squares", "CPU", (Run(("--rows", "1"), gpu=False),), out="--json")
    table = {"tiny": TINY, "tiny_gpu": ON_GPU, "tiny_json": as_json}
    written = headline.headline(str(tmp_path), suites=table, cuda=False)
    out = capsys.readouterr().out
    assert "skip tiny_gpu (GPU, no CUDA on this machine): python -m benchmarks run tiny_gpu --rows 5" in out
    assert "tiny suite: 3 rows" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["headline.md", "tiny.json", "tiny_json.json"]
    assert json.loads((tmp_path / "tiny_json.json").read_text())["runs"][0]["result"]["argv"][-2] == "--json"
    record = json.loads((tmp_path / "tiny.json").read_text())
    assert record == written["tiny"]
    (run,) = record["runs"]
    assert run["command"] == "python -m benchmarks run tiny --rows 3" and run["returncode"] == 0
    assert [r["n"] for r in run["result"]["rows"]] == [0, 1, 2]
    md = (tmp_path / "headline.md").read_text()
    assert "`python -m benchmarks run tiny --rows 3` (exit 0" in md
    assert "| n | square |" in md and "| 2 | 1.333 |" in md
    assert "`python -m benchmarks run tiny_gpu --rows 5`: skipped, no CUDA on this machine." in md


def test_headline_only_selects_and_rejects_unknown_names(tmp_path, capsys):
    table = {"tiny": TINY, "tiny_gpu": ON_GPU}
    assert headline.headline(str(tmp_path), only="tiny_gpu", suites=table, cuda=False) == {}
    assert "skip tiny_gpu" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown suites"):
        headline.headline(str(tmp_path), only="tiny,nope", suites=table, cuda=False)


def test_headline_gpu_only_skips_the_cpu_commands(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(headline, "machine", lambda cuda: "a GPU")
    table = {"tiny": TINY, "tiny_gpu": ON_GPU}
    written = headline.headline(str(tmp_path), suites=table, cuda=True, gpu_only=True)
    out = capsys.readouterr().out
    assert "skip tiny (CPU, --gpu-only): python -m benchmarks run tiny --rows 3" in out
    assert list(written) == ["tiny_gpu"] and written["tiny_gpu"]["runs"][0]["returncode"] == 0
    md = (tmp_path / "headline.md").read_text()
    assert "run tiny_gpu --rows 5" in md and "run tiny --rows 3" not in md
