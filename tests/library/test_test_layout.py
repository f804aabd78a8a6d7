"""The tests' own shape, read from their source.

Each test module sits in the folder of the hf_parallel sub-package it mainly tests (tests/cli/ for hf_parallel/cli/,
tests/row/ for hf_parallel/row/, ...), or in one of the folders of tests no single sub-package owns: tests/library/
(the whole library: its core contract, its shape, its README and notebook) and tests/eval/ (the scripts of eval/).
What several modules share lives in tests/helpers/, and no module imports a test module or conftest.py.  Switches of
the whole process (TF32, threads, the default dtype, torch's global seed at import) are left to conftest.py, whose
fixtures set them for a test and restore them after it (`no_tf32`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.project import ROOT

WHOLE = ("library", "eval")  # folders of tests that no one sub-package owns
# calls that change torch for the whole process, whatever the test (a seed is fine inside a test, not at import)
SWITCH_CALLS = {"torch.set_num_threads", "torch.set_num_interop_threads", "torch.set_default_dtype",
                "torch.set_default_device", "torch.set_float32_matmul_precision", "torch.use_deterministic_algorithms",
                "torch.set_flush_denormal"}  # fmt: skip
SEED_CALLS = {"torch.manual_seed", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all", "random.seed"}


def sub_packages(root: Path) -> list[str]:
    return sorted(init.parent.name for init in (root / "hf_parallel").glob("*/__init__.py"))


def misplaced(root: Path) -> list[str]:
    """Test modules outside tests/<sub-package>/ and tests/<one of WHOLE>/, and test folders without __init__.py
    (without one, two test modules of one name in two folders could not both be imported)."""
    tests, allowed = root / "tests", {*sub_packages(root), *WHOLE}
    found = [str(p.relative_to(tests)) for p in sorted(tests.rglob("test_*.py"))
             if len(p.relative_to(tests).parts) != 2 or p.relative_to(tests).parts[0] not in allowed]  # fmt: skip
    folders = {p.parent for p in tests.rglob("*.py")}
    return found + [f"{f.relative_to(tests)}/ has no __init__.py" for f in sorted(folders) if
                    not (f / "__init__.py").exists()]  # fmt: skip


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in name.lstrip(".").split("."))


def imports_of_test_modules(root: Path) -> list[str]:
    """Imports, anywhere in tests/, of a test module or of conftest.py: `tests.x.test_y`, `test_y`, `.test_y`,
    `from . import test_y`, `.conftest`."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                names = [base] if _is_test_module(base) else [  # or what it imports from a package
                    f"{base}.{alias.name}" if node.module else base + alias.name for alias in node.names]  # fmt: skip
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno}: {name}" for name in names if _is_test_module(name)]
    return found


def _module_level(tree: ast.Module):
    """The nodes of a module that run when it is imported (not inside a function, class or lambda)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        todo += ast.iter_child_nodes(node)


def switches(root: Path) -> list[str]:
    """In test modules: an assignment to `torch.backends.*`, a call of `SWITCH_CALLS` anywhere, a call of
    `SEED_CALLS` at import."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        at_import = {id(node) for node in _module_level(tree)}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []  # fmt: skip
            what = [ast.unparse(t) for t in targets if ast.unparse(t).startswith("torch.backends.")]
            if isinstance(node, ast.Call):
                call = ast.unparse(node.func)
                what += [call] if call in SWITCH_CALLS or (call in SEED_CALLS and id(node) in at_import) else []
            found += [f"{path.relative_to(root)}:{node.lineno}: {w}" for w in what]
    return found


def test_every_test_module_sits_in_the_folder_of_what_it_tests():
    assert misplaced(ROOT) == []
    assert set(WHOLE).isdisjoint(sub_packages(ROOT))


def test_no_test_module_imports_another():
    """Shared helpers come from tests/helpers/: a test module imported by another would run its tests' module code
    twice under two names, and tie the two files' contents together."""
    assert imports_of_test_modules(ROOT) == []


def test_process_wide_switches_are_left_to_fixtures():
    assert switches(ROOT) == []


def test_the_checks_find_what_they_forbid(tmp_path):
    files = {
        "hf_parallel/cli/__init__.py": "",
        "hf_parallel/row/__init__.py": "",
        "tests/__init__.py": "",
        "tests/conftest.py": "from .helpers.models import tiny_model\n",
        "tests/helpers/__init__.py": "",
        "tests/helpers/models.py": "from tests.row.test_plan import make\n",
        "tests/test_top.py": "",
        "tests/nowhere/__init__.py": "",
        "tests/nowhere/test_x.py": "",
        "tests/row/test_deep/test_y.py": "",
        "tests/cli/test_bare.py": "",  # tests/cli/ has no __init__.py
        "tests/library/__init__.py": "",
        "tests/library/test_fine.py": "import torch\n\ndef test():\n    torch.manual_seed(0)\n",
        "tests/row/__init__.py": "",
        "tests/row/test_plan.py": (
            "import test_other\nfrom tests.cli.test_bare import f\nfrom .test_other import g\n"
            "from . import test_other\nfrom tests.cli import test_bare\nfrom ..conftest import tiny_model\n"
            "from tests.helpers.models import tiny_model\nfrom tests import helpers\n"
        ),
        "tests/row/test_switch.py": (
            "import torch\ntorch.manual_seed(0)\n\ndef test():\n    torch.backends.cuda.matmul.allow_tf32 = False\n"
            "    torch.set_num_threads(2)\n    torch.manual_seed(1)\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert misplaced(tmp_path) == ["nowhere/test_x.py", "row/test_deep/test_y.py", "test_top.py",
                                   "cli/ has no __init__.py", "row/test_deep/ has no __init__.py"]  # fmt: skip
    assert imports_of_test_modules(tmp_path) == [
        "tests/helpers/models.py:1: tests.row.test_plan",
        "tests/row/test_plan.py:1: test_other",
        "tests/row/test_plan.py:2: tests.cli.test_bare",
        "tests/row/test_plan.py:3: .test_other",
        "tests/row/test_plan.py:4: .test_other",
        "tests/row/test_plan.py:5: tests.cli.test_bare",
        "tests/row/test_plan.py:6: ..conftest",
    ]
    assert switches(tmp_path) == ["tests/row/test_switch.py:2: torch.manual_seed",
                                  "tests/row/test_switch.py:5: torch.backends.cuda.matmul.allow_tf32",
                                  "tests/row/test_switch.py:6: torch.set_num_threads"]  # fmt: skip
