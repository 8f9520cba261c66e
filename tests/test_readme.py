"""The README's example runs as written (on the CPU: the compiled loop, the default there)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has a Python example"
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)
    assert scope["post"].mean.shape == (1000, 4)
    assert scope["level"].params["obs_var"].shape == (4,)
