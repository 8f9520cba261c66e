import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one process per core: threads inside each would only contend


def _patch_language_once_per_launch() -> None:
    """Under ``TRITON_INTERPRET=1`` Triton's interpreter patches ``triton.language`` with its numpy
    implementations at each launch (undone when the launch ends) and again at every call of one
    jit function from another, walking the modules' members each time: about half of the
    interpreter's time in these tests. Here each launch patches the two modules any jit function
    sees (``triton.language``, as the kernels import it, and ``triton.language.core``, as Triton's
    own jit functions do) and the nested calls skip it; the kernels run the same operations. This
    replaces a private function of Triton's interpreter, so it is left out where that differs."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    import triton.runtime.interpreter

    patch = getattr(triton.runtime.interpreter, "_patch_lang", None)
    empty_scope = getattr(triton.runtime.interpreter, "_LangPatchScope", None)
    if patch is None or empty_scope is None or not hasattr(empty_scope, "restore"):
        return
    both = eval("lambda: None", {"tl": tl, "core": tl.core})  # its globals hold both modules
    depth = [0]

    class LaunchScope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            depth[0] -= 1
            self.scope.restore()

    def patch_once(fn):
        if depth[0]:
            return empty_scope()
        scope = patch(both)
        depth[0] += 1
        return LaunchScope(scope)

    triton.runtime.interpreter._patch_lang = patch_once


_patch_language_once_per_launch()


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the wrappers allocate starts as NaN: an element left unwritten shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", nan_empty)
