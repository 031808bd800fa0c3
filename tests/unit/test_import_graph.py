"""Layers only look down: no import cycle among the files of src/rlhfkit (every import, at module level or inside a
function: a lazy import that dodges a cycle is a cycle), and `algos/` (the pure math) imports only torch and the
standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "rlhfkit"


def modules() -> dict[str, Path]:
    """{dotted name: file}; a package is named by its folder (its __init__.py)."""
    return {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
            for p in (SRC / PACKAGE).rglob("*.py")}


def imported_names(name: str, path: Path, files=()) -> set[str]:
    """Every dotted name `path` imports (relative imports resolved): `from a import b` is a.b where that is a module
    (of `files`), else a (b is a name a defines)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, with an edge to every package whose __init__ the import runs."""
    files = modules()
    graph = {name: set() for name in files}
    for name, path in files.items():
        for target in imported_names(name, path, files):
            while target and target not in files:  # `from a.b import f`: the module a.b
                target = target.rpartition(".")[0]
            if not target or target == name or not target.startswith(PACKAGE):
                continue
            graph[name].add(target)
            parts = target.split(".")
            for i in range(2, len(parts)):  # importing a.b.c runs a/b/__init__ first (not one's own package)
                parent = ".".join(parts[:i])
                if parent in files and parent != name and not name.startswith(parent + "."):
                    graph[name].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycles_are_found_by_hand():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_src():
    graph = import_graph()
    assert "rlhfkit.speed.registry" in graph and "rlhfkit.models.forward" in graph["rlhfkit.models.prefix"]
    assert cycles(graph) == []


def test_algos_imports_only_torch_and_the_standard_library():
    allowed_roots = {"torch", "__future__", *sys.stdlib_module_names}
    for name, path in modules().items():
        if not name.startswith(f"{PACKAGE}.algos"):
            continue
        for imported in imported_names(name, path):
            root = imported.split(".")[0]
            assert root in allowed_roots or imported.startswith(f"{PACKAGE}.algos"), (name, imported)


# docs/architecture.md's layers, bottom to top: a package (or top-level module) imports only from its own row and
# the rows below it, lazily or not. `__init__` is rlhfkit/__init__.py.
LAYERS = [
    {"__init__", "compat", "compat_site", "errors", "run_files", "metric_names", "user_code"},
    {"algos", "tasks"},
    {"registry", "monitors"},
    {"config"},
    {"data"},
    {"lora"},
    {"engine"},
    {"accel"},
    {"models"},
    {"tools"},
    {"envs"},
    {"rollout"},
    {"speed"},
    {"remote", "report"},
    {"stages"},
    {"score", "chat"},
    {"demo"},
    {"commands"},
    {"cli", "__main__"},
]
# Upward imports still to be removed, each named with the module that makes it: none. A new one fails the test.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def unit_of(module: str) -> str:
    """rlhfkit.lora -> models; rlhfkit.errors -> errors; rlhfkit -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports() -> set[tuple[str, str]]:
    """(importing module, the unit it imports) for every import of a unit in a higher layer than the importer's."""
    layer = {unit: i for i, row in enumerate(LAYERS) for unit in row}
    files = modules()
    found = set()
    for name, path in files.items():
        for target in imported_names(name, path, files):
            if not target.startswith(PACKAGE):
                continue
            here, there = unit_of(name), unit_of(target)
            if here != there and layer[there] > layer[here]:
                found.add((name, there))
    return found


def test_every_package_is_in_a_layer():
    units = {unit_of(name) for name in modules()}
    assert units == set().union(*LAYERS), (units ^ set().union(*LAYERS))


def test_layers_only_look_down():
    assert upward_imports() == KNOWN_UPWARD


def test_an_upward_import_added_on_purpose_is_caught(tmp_path, monkeypatch):
    """The test above fails on an import from a lower layer of a higher one (here config -> stages, in a function:
    a lazy import that dodges a cycle is still one)."""
    files = dict(modules())
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from rlhfkit.stages.ppo import run_ppo\n    return run_ppo\n")
    files["rlhfkit.config.planted"] = planted
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: files)
    assert ("rlhfkit.config.planted", "stages") in upward_imports() - KNOWN_UPWARD
