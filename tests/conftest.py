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


SLOW_CASES = (
    "tests/ops/filter/test_tiles_closed.py::test_float64_equals_the_composed_branch[1e-06]",
    "tests/ops/filter/test_tiles_closed.py::test_extreme_parameters_float32[1e-06]",
    "tests/ops/filter/test_tiles_closed.py::test_extreme_parameters_float32[1000000.0]",
    "tests/ops/filter/test_walks_closed.py::test_extreme_parameters_float32[1e-06]",
    "tests/ops/filter/test_walks_closed.py::test_stretch_boundaries_and_every_field[83]",
    "tests/ops/filter/test_triton.py::test_gradcheck_float64[steps-times-one]",
    "tests/ops/filter/test_triton_smooth.py::test_fused_smoother_equals_reference[T201-ns41-step1-f64]",
    "tests/ops/filter/test_triton_backward.py::test_tile_backward_equals_walk_backward[T131-row8-step1-wide1-1cot]",
    "tests/ops/filter/test_triton_backward.py::test_tile_backward_equals_walk_backward[T63-row8-step1-wide0-2cot]",
    "tests/ops/filter/test_triton_backward.py::test_tile_backward_gradients_equal_torch_autograd"
    "[T101-row8-step1-times0-5fields]",
    "tests/ops/filter/test_triton_backward.py::test_tile_backward_gradients_equal_torch_autograd"
    "[T101-row4-step1-times1-1fields]",
    "tests/ops/filter/test_triton_backward.py::test_absent_cotangents_gradients_equal_torch_autograd"
    "[pred_mean-T37-L37-step1]",
    "tests/ops/filter/test_y_check.py::test_public_calls_refuse_an_inf_and_search_clean_y_never[smooth-None-200]",
    "tests/ops/kla/test_library.py::test_opcheck_forward[True-True-config2]",
    "tests/ops/kla/test_no_variance.py::test_without_variance_equals_with_it_and_the_reference[2-23-True-config2]",
    "tests/test_scale.py::test_gradients_scale[triton]",
    "tests/test_scale.py::test_backend_sweep[triton-rich]",
    "tests/test_scale.py::test_kernel_paths_sweep[stretches_closed]",
    "tests/test_scan.py::test_scan_gradients_match_the_loop[False-64]",
    "tests/test_scan.py::test_scan_gradients_match_the_loop[True-64]",
    "tests/test_diffuse.py::test_leading_gaps_run_as_window_and_rest_equal_one_run[outputs1-triton]",
    "tests/test_diffuse.py::test_leading_gaps_run_as_window_and_rest_equal_one_run[outputs2-triton]",
    "tests/test_fit_objective.py::test_cpu_fit_equals_torch_fit[dtype1]",
    "tests/test_scale.py::test_float32_sweep[triton]",
    "tests/test_diffuse.py::test_leading_gaps_of_every_length_against_a_vague_prior[triton]",
    "tests/test_outputs.py::test_gradients_of_selected_fields_equal_the_full_call[diffuse-triton]",
    "tests/ops/kla/test_no_variance.py::test_without_variance_equals_with_it_and_the_reference[2-23-True-config1]",
    "tests/ops/kla/test_library.py::test_opcheck_forward[False-True-config0]",
    "tests/ops/kla/test_library.py::test_opcheck_backward[config1-v_dtype1]",
    "tests/ops/kla/test_library.py::test_opcheck_backward[config2-v_dtype2]",
    "tests/ops/filter/test_triton_backward.py::test_tile_backward_equals_walk_backward[T37-row16-step1-wide0-2cot]",
    "tests/ops/filter/test_triton_backward.py::test_absent_cotangents_gradients_equal_torch_autograd"
    "[logliks-T37-L37-step1]",
    "tests/ops/filter/test_triton_backward.py::test_absent_cotangents_gradients_equal_torch_autograd"
    "[mean-T63-L5-step1]",
    "tests/ops/filter/test_triton_backward.py::test_filter_loss_on_one_field_gradients_equal_torch_autograd[var]",
    "tests/ops/filter/test_y_check.py::test_the_aggregate_pass_is_not_finite_exactly_where_y_holds_an_inf[1000]",
    "tests/ops/filter/test_y_check.py::test_public_calls_refuse_an_inf_and_search_clean_y_never[smooth-None-63]",
    "tests/ops/filter/test_walks_closed.py::test_stretch_boundaries_and_every_field[80]",
    "tests/ops/filter/test_triton_smooth.py::test_fused_smoother_equals_reference[T201-ns41-step0-f32]",
    "tests/ops/kla/test_kla_scan.py::test_fast_decay_and_precise_values[config1-triton]",
    "tests/test_scale.py::test_kernel_paths_sweep[tiles]",
)
"""The deepest cases of parametrized tests (each about 1.3-6 s on a 2-core machine, or the only
float32 user of a compiled CPU loop there), marked ``slow``: ``-m "not slow"`` keeps the test's other
cases."""


def pytest_collection_modifyitems(items):
    slow = set(SLOW_CASES)
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the wrappers allocate starts as NaN: an element left unwritten shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", nan_empty)
