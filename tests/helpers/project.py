"""Where the tests find the project's files: the repository root, the shared real data beside it, eval/'s scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: hf_parallel/, tests/, eval/, docs/
SHARED_DATA = ROOT.parent / "shared" / "data"  # real data sets, where the machine has them (tests skip without)
EVAL = ROOT / "eval"


def eval_module(name: str):
    """eval/<name>.py (or eval/diagnostics/<name>.py) as the module `eval_<name>` (registered before it runs, as its
    dataclasses need; both folders on the path while it loads, as the scripts import each other by name)."""
    folders = [EVAL, EVAL / "diagnostics"]
    path = next((f / f"{name}.py" for f in folders if (f / f"{name}.py").exists()), EVAL / f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"eval_{name}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    sys.path[:0] = [str(f) for f in folders]
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.path[: len(folders)]
    return module
