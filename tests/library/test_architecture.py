"""The package's shape, read from its source: layers imported one way, no cycles, no private names across modules,
and transformers' or lm-eval's internals touched in hf_parallel.compat only.

`lint-imports` (run by `.ci/run`, the contracts in pyproject.toml) checks the layers too; this test builds the
graph itself, imports inside functions included, so that it fails here as well, with the cycle or the upward
import named.
"""

from __future__ import annotations

import ast
import re
import textwrap
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


# ------------------------------------------- transformers' and lm-eval's internals: hf_parallel.compat only

# private names of other libraries hf_parallel may read outside compat: torch's and accelerate's
OTHERS_PRIVATE = {"_dynamo", "_inductor", "_parameters", "_modules", "_forward_hooks", "_forward_pre_hooks", "_hf_hook"}
# transformers' internals by name: the linear-attention cache layer's state attributes, logits processors' own
# attributes, the mask machinery
INTERNAL_NAMES = {
    "conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
    "has_previous_state", "conv_kernel_size", "number_of_states", "ngram_size", "prompt_length_to_skip",
    "begin_index", "regulation_start", "create_causal_mask", "AttentionMaskInterface",
    "ALL_MASK_ATTENTION_FUNCTIONS", "LinearAttentionLayer", "AttentionInterface", "kernel_layer_name", "_kernel_funcs",
    "_old_forward",
}  # fmt: skip


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _defined_names(trees) -> set[str]:
    """Every name hf_parallel defines itself: functions, classes, arguments, assigned names and attributes."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.attr)
    return names


def _is_sys_modules(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and getattr(node.value, "id", None) == "sys"


def _contacts(path: Path, tree: ast.Module, defined: set[str]) -> list[str]:
    where = lambda node, what: f"{path.relative_to(ROOT)}:{node.lineno}: {what}"  # noqa: E731
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.append(node.attr)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            names += [a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in INTERNAL_NAMES:
            names.append(node.value)
        if isinstance(node, ast.Name):
            names.append(node.id)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module or "" if isinstance(node, ast.ImportFrom) and not node.level else ""
            names += [a.name.rpartition(".")[2] for a in node.names]
            modules = [module] + [a.name for a in node.names if isinstance(node, ast.Import)]
            if any(m.startswith("transformers.models") or ".modeling_" in m for m in modules):
                found.append(where(node, f"imports a modeling module ({', '.join(m for m in modules if m)})"))
        for name in names:
            private = name.startswith("_") and not name.startswith("__")
            if (private and name not in defined and name not in OTHERS_PRIVATE) or name in INTERNAL_NAMES:
                found.append(where(node, f"reads {name}"))
            if name.startswith("modeling_"):
                found.append(where(node, f"reads a modeling module ({name})"))
        if isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
            found.append(where(node, "looks a module up in sys.modules"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_modules(node.func.value):
            found.append(where(node, f"sys.modules.{node.func.attr}(...)"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("transformers."):
            found.append(where(node, f"names a transformers module ({node.value})"))
        if isinstance(node, ast.Constant) and node.value == "Sliding":
            found.append(where(node, "a class-name check ('Sliding')"))
        method = node.func if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        if (
            method is not None
            and method.attr in ("endswith", "startswith")
            and getattr(method.value, "attr", "") == "__name__"
        ):
            found.append(where(node, f"a class-name check (__name__.{node.func.attr})"))
        if isinstance(node, ast.Compare) and any(getattr(c, "attr", None) == "__name__" for c in node.comparators):
            if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                found.append(where(node, "a class-name check (in __name__)"))
    return found


def test_no_module_outside_compat_touches_transformers_or_lm_eval_internals():
    sources = _sources()
    defined = _defined_names(t for p, t in sources.items() if "compat" not in p.relative_to(PACKAGE).parts)
    found = [
        contact
        for path, tree in sources.items()
        if "compat" not in path.relative_to(PACKAGE).parts
        for contact in _contacts(path, tree, defined)
    ]
    assert not found, "contacts with transformers' or lm-eval's internals outside hf_parallel.compat:\n" + "\n".join(
        found
    )


def test_the_contact_check_finds_each_kind_of_contact():
    """The check above can fail: each kind of contact, written in a module, is found."""
    code = textwrap.dedent("""
        import sys
        from transformers.models.llama import modeling_llama
        from transformers.cache_utils import LinearAttentionLayer
        a = model.config._attn_implementation
        b = self._encode_pair(context, continuation)
        c = sys.modules["transformers.modeling_utils"]
        d = sys.modules.get(type(model).__module__)
        e = "Sliding" in type(layer).__name__
        f = type(module).__name__.endswith("Attention")
        g = layer.recurrent_states[0]
        h = getattr(processor, "begin_index")
        i = transformers.models.llama.modeling_llama
    """)
    found = "\n".join(_contacts(PACKAGE / "example.py", ast.parse(code), defined=set()))
    for what in ("modeling module (transformers.models.llama)", "LinearAttentionLayer", "_attn_implementation",
                 "_encode_pair", "in sys.modules", "sys.modules.get", "'Sliding'", "in __name__", "__name__.endswith",
                 "recurrent_states", "begin_index", "reads a modeling module (modeling_llama)"):  # fmt: skip
        assert what in found, f"{what!r} not found in:\n{found}"
