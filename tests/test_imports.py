"""No import cycles in ``model/`` or ``service/``, and the layering the packages promise: the network
never imports inference, interop or the command-line tools; ``model/`` never imports ``service/``;
the translator never imports the HTTP package. Imports are read from the source (every ``import``
statement, inside functions too), not by importing; imports under ``if TYPE_CHECKING:`` are type-only
and skipped."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "service")
CLI = {"model.train", "model.evaluate", "model.translate", "model.average", "model.convert"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if "static" not in p.parts}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    out.add(f"{target}.{a.name}")
                elif target in modules:
                    out.add(target)
    # importing a.b.c runs a/__init__ and a/b/__init__ first: a cycle through a package's __init__ is a cycle too
    for target in list(out):
        parts = target.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
    out = {m for m in out if not name.startswith(m + ".") and m != name}   # a module's own packages run before it
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module's project imports, read once (every test here only reads the graph)."""
    modules = _modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(edges):
        if n not in state and (cycle := visit(n)):
            return cycle
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_relative_imports_resolve_to_project_modules():
    g = graph()
    assert "model.transformer" in g["model.inference.step"]
    assert "model.inference.kernels" in g["model.inference.linear"]


def test_no_import_cycles_in_model_or_service():
    cycle = find_cycle(graph())
    assert not cycle, " -> ".join(cycle)


def test_the_layers_import_only_downwards():
    g = graph()
    network = {"model.config", "model.attention", "model.layers", "model.transformer"}
    for name in network:
        assert {m for m in g[name] if m not in network} == set(), name
    for name, deps in g.items():
        if name.startswith("model"):
            assert not any(d.startswith("service") for d in deps), name
        if name not in CLI:
            assert not deps & CLI, f"{name} imports a command-line tool: {deps & CLI}"
        if name.startswith("service.translator") or name.startswith("service.engine"):
            assert not any(d.startswith("service.api") for d in deps), f"{name} imports the HTTP package"
