"""The layout's rules, checked on the source: no module imports another module's underscore names
(``from m import _x``, ``m._x``), nothing imports the removed flat modules, and ``import
kalmanscan.nn`` loads neither xarray, pandas nor matplotlib."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("kalmanscan", "kernels", "tests", "benchmarks", "evidence", "tutorials", "docs")


def _sources():
    for tree in TREES:
        yield from sorted((ROOT / tree).rglob("*.py"))


def _module_names(tree: ast.AST) -> set[str]:
    """Names bound to imported modules in ``tree`` (``import a.b as c``, ``from a import b``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [f"from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    modules = _module_names(tree) - {"torch", "np", "numpy", "triton", "tl", "os", "sys", "math", "dist",
                                     "F", "nn", "xr", "pd", "plt", "stats", "mpl"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{node.value.id}.{node.attr}")
    return [f"{path.relative_to(ROOT)}:{use}" for use in found]


def test_no_private_name_crosses_a_module_boundary():
    uses = [u for path in _sources() for u in _private_uses(path)]
    assert not uses, "\n".join(uses)


def test_no_reference_to_removed_modules():
    gone = ("kalmanscan.fused", "kalmanscan.parallel", "kalmanscan.reference", "kalmanscan.nn.scan",
            "kalmanscan.nn.kla_triton", "kalmanscan.launch", "kalmanscan.fused_smooth", "from kernels.",
            "import kernels", "filter_chain")
    hits = [f"{p.relative_to(ROOT)}: {g}" for p in _sources() if p.name != "test_layout.py"
            for g in gone if g in p.read_text()]
    assert not hits, "\n".join(hits)


@pytest.mark.slow  # about 2 s: a child process
def test_nn_imports_no_data_or_plotting_libraries():
    code = ("import sys, kalmanscan.nn as n; n.SequenceModel; n.KLA; "
            "print(sorted(m for m in ('xarray', 'pandas', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _untyped(path: Path) -> list[str]:
    """Public functions and public methods of public classes in ``path`` lacking a parameter or
    return annotation (``self``/``cls`` need none)."""
    found = []

    def check(node: ast.FunctionDef, owner: str = "") -> None:
        a = node.args
        args = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
        if owner and args and args[0].arg in ("self", "cls"):
            args = args[1:]
        if node.returns is None or any(x.annotation is None for x in args):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}:{owner}{node.name}")

    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            check(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("_"):
                    check(m, f"{node.name}.")
    return found


def test_public_functions_have_type_hints():
    gaps = [g for path in sorted((ROOT / "kalmanscan").rglob("*.py")) for g in _untyped(path)]
    assert not gaps, "\n".join(gaps)



PACKAGE = ROOT / "kalmanscan"
KERNELS = ROOT / "kernels"


def _package_modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (``kernels/`` is ``kalmanscan.kernels``)."""
    found = {}
    for base, name in ((PACKAGE, "kalmanscan"), (KERNELS, "kalmanscan.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, here: str, is_package: bool, modules: dict) -> set[str]:
    """The package's modules an ``import`` or ``from`` statement names: ``import a.b`` and ``from a
    import b`` name the module ``a.b`` when it is one, else ``from a import b`` names ``a``; a package
    is its ``__init__``. The parent packages Python runs on the way are left out: they are loaded
    before any of their modules."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    base = node.module or ""
    if node.level:
        anchor = here if is_package else here.rpartition(".")[0]
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = f"{anchor}.{base}".rstrip(".")
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names} & set(modules)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function, by a
    statement or ``importlib.import_module`` of a literal name (imports under ``if TYPE_CHECKING:``
    never run and are left out)."""
    modules = _package_modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for stmt in node.body for n in ast.walk(stmt)}
        graph[name] = {t for node in ast.walk(tree)
                       if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only
                       for t in _targets(node, name, path.name == "__init__.py", modules)} - {name}
        graph[name] |= {node.args[0].value for node in ast.walk(tree)  # importlib.import_module("a.b")
                        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
                        and node.args and isinstance(node.args[0], ast.Constant)
                        and node.args[0].value in modules} - {name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle through each module that lies on one, one per cycle found (``[a, b, a]``)."""
    cycles = []
    for start in sorted(graph):
        came = {start: None}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = v
                        break
                    if w not in came:
                        came[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        if found is None:
            continue
        path = [found]
        while came[path[-1]] is not None:
            path.append(came[path[-1]])
        cycle = list(reversed(path))
        turn = cycle.index(min(cycle))
        cycle = cycle[turn:] + cycle[:turn]
        if cycle + [cycle[0]] not in cycles:
            cycles.append(cycle + [cycle[0]])
    return cycles


def test_no_import_cycles():
    """No cycle among the package's imports, those inside functions counted."""
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_finder_names_each_cycle_once():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]


def test_function_local_imports_are_edges(tmp_path, monkeypatch):
    """An import inside a function counts; one under ``TYPE_CHECKING`` does not."""
    pkg = tmp_path / "kalmanscan"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from kalmanscan.sub import b\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from kalmanscan.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from kalmanscan.sub import a\nimport kalmanscan.sub.a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", tmp_path / "none")
    graph = import_graph()
    assert graph["kalmanscan.sub.a"] == {"kalmanscan.sub.b"}
    assert graph["kalmanscan.sub.b"] == {"kalmanscan.sub.a"}
    assert graph["kalmanscan.sub"] == {"kalmanscan.sub.b"}
    assert find_cycles(graph) == [["kalmanscan.sub.a", "kalmanscan.sub.b", "kalmanscan.sub.a"]]


def test_slow_cases_name_existing_tests():
    """Each of ``conftest.SLOW_CASES`` names a test function of an existing file (its parameters'
    ids are checked by collection alone)."""
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    cases = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SLOW_CASES")
    assert cases
    for case in cases:
        path, name = case.split("::")
        assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), case
