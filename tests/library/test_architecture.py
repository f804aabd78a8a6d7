"""The package's shape, read from its source: layers imported one way, no cycles, no private names across modules.

`lint-imports` (run by `.ci/run`, the contracts in pyproject.toml) checks the layers too; this test builds the
graph itself, imports inside functions included, so that it fails here as well, with the cycle or the upward
import named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.project import ROOT

PACKAGE = ROOT / "hf_parallel"
MOST_FMT_SKIPS = 20  # `# fmt: skip` only where a table reads better aligned


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported hf_parallel module, line, inside a function) of every import statement in the module."""
    modules, found = _modules(), []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(parts + ([child.module] if child.module else []))
                for alias in child.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target.startswith("hf_parallel"):
                        found.append((target, child.lineno, in_function))
            elif isinstance(child, ast.Import):
                found.extend(
                    (a.name, child.lineno, in_function) for a in child.names if a.name.startswith("hf_parallel")
                )
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {target for target, _, _ in _imports(name, path)} - {name} for name, path in _modules().items()}


def _layer(module: str, layers: list[set[str]]) -> int | None:
    parts = module.split(".")
    return next((i for i, layer in enumerate(layers) if len(parts) > 1 and parts[1] in layer), None)


def _package(module: str) -> str:
    return module.split(".")[1]


def _layers() -> list[set[str]]:
    """The layers contract's layers, top first, as pyproject.toml lists them for import-linter (a layer of
    independent packages written "a | b")."""
    listed = re.search(r"^layers = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE)
    return [set(re.findall(r"\w+", layer)) for layer in re.findall(r'"([\w| ]+)"', listed.group(1))]


def test_every_import_goes_down_the_layers():
    """A module imports only from its own layer or the layers below (pyproject.toml's order), function-level imports
    included; every module but the package's entry points lies in a layer."""
    layers = _layers()
    upward = []
    for name, targets in _graph().items():
        if name in ("hf_parallel", "hf_parallel.__main__"):
            continue
        assert _layer(name, layers) is not None, f"{name} lies in no layer of {layers}"
        upward += [
            (name, t) for t in targets if _layer(t, layers) is not None and _layer(t, layers) < _layer(name, layers)
        ]
        upward += [
            (name, t) for t in targets if _layer(t, layers) == _layer(name, layers) and _package(t) != _package(name)
        ]
    assert upward == []  # an import up the layers, or between independent packages of one layer


def test_no_module_imports_itself_through_a_cycle():
    """No cycle among the package's modules, imports inside functions included (Tarjan's strongly connected
    components: every one a single module)."""
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                connect(w)
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
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert cycles == []


def test_imports_inside_functions_say_why():
    """An import inside a function of the package only saves start-up time or guards an optional package, and its
    line (or the one above) says which."""
    unexplained = []
    for name, path in _modules().items():
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    said = " ".join(lines[max(0, inner.lineno - 2) : inner.end_lineno])
                    if not re.search(r"#.*(start-up|optional)", said):
                        unexplained.append(f"{name}:{inner.lineno}")
    assert unexplained == []


def _private_uses(path: Path) -> list[str]:
    """Private names (one leading underscore) that `path` takes from another module: imported from an hf_parallel
    module or an eval script, read as an attribute of one, or named in a dotted string (a monkeypatch target)."""
    source = path.read_text()
    tree = ast.parse(source)
    modules = set()  # local names bound to hf_parallel modules or eval scripts
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hf_parallel")):
            for alias in node.names:
                if _private(alias.name):
                    uses.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("hf_parallel")}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == "eval_module":  # an eval script loaded by the tests
                modules |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _rooted_in(node.value, modules):
            uses.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for dotted in re.findall(r"\bhf_parallel(?:\.\w+)+", node.value):
                if any(_private(part) for part in dotted.split(".")[1:]):
                    uses.append(f"{path.relative_to(ROOT)}:{node.lineno} names {dotted}")
    return uses


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _rooted_in(node: ast.AST, modules: set[str]) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in modules


@pytest.mark.parametrize("folder", ["hf_parallel", "tests", "eval"])
def test_no_private_name_is_used_across_modules(folder):
    """A module uses another's public names only: in the package, in the tests and in the evaluation scripts."""
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    assert [use for path in files for use in _private_uses(path)] == []


def test_the_package_keeps_its_history_out_of_its_code():
    """Docstrings and comments state contracts; measurements and the runs behind them live in docs/benchmarks/."""
    history = re.compile(r"H200|H100| us |measured|ran .* slower")
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if history.search(line)]  # fmt: skip
    assert found == []


def test_the_formatter_runs_over_nearly_all_the_code():
    skips = sum(path.read_text().count("# fmt: skip") for path in PACKAGE.rglob("*.py"))
    assert skips < MOST_FMT_SKIPS
