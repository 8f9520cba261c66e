"""The built wheel ships the library, the kernels under the package's own name
(``kalmanscan.kernels``, no top-level ``kernels`` module) and the bundled data, and the demo runs
from the installed wheel (not from the source tree)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 50 s: builds and installs the wheel
def test_demo_runs_from_installed_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    (wheel,) = (tmp_path / "dist").glob("kalmanscan-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kalmanscan/kernels/__init__.py" in names
    assert "kalmanscan/kernels/filter/fwd.py" in names and "kalmanscan/kernels/kla/fwd.py" in names
    assert not any(n.startswith(("kernels/", "evidence/", "benchmarks/", "tests/")) for n in names), names
    assert "kalmanscan/datasets/nile.csv" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True)
    env = dict(os.environ, PYTHONPATH=str(site), MPLBACKEND="Agg")
    code = ("import importlib.util, kalmanscan, kalmanscan.kernels.filter.fwd as fwd, sys; "
            "from kalmanscan.cli import main; "
            "assert kalmanscan.__file__.startswith(sys.argv[1]), kalmanscan.__file__; "
            "assert fwd.__file__.startswith(sys.argv[1]), fwd.__file__; "
            "assert importlib.util.find_spec('kernels') is None; "
            "sys.exit(main(['demo', '--out', sys.argv[2]]))")
    png = tmp_path / "demo.png"
    out = subprocess.run([sys.executable, "-c", code, str(site), str(png)], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Nile" in out.stdout and "log-likelihood" in out.stdout
    assert png.stat().st_size > 10_000
