"""Fenced code blocks of a Markdown page, run as a reader would paste them."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
from pathlib import Path

import hf_parallel

OTHER_PACKAGES = {"torch", "transformers", "datasets"}  # what an example may import besides hf_parallel


def fenced_blocks(path: Path, language: str) -> list[str]:
    """The page's fenced code blocks in `language`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def expected_output(block: str) -> list[str]:
    """What the block's `# ->` comments say it prints, a line each, in order."""
    return [line.split("# -> ", 1)[1] for line in block.splitlines() if "# -> " in line]


def run_blocks(blocks: list[tuple[int, str]], where: str) -> int:
    """Run the numbered Python `blocks` of page `where` in order in one namespace, each printing what its `# ->`
    comments say (an AssertionError naming the block where one does not); how many ran."""
    namespace: dict = {}
    for i, block in blocks:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, f"{where} python block {i}", "exec"), namespace)
        assert printed.getvalue().splitlines() == expected_output(block), f"{where} block {i}:\n{block}"
    return len(blocks)


def imported_names(block: str) -> list[tuple[str, str | None]]:
    """Each import of the block: (module, name) for `from module import name`, (module, None) for `import module`."""
    names = []
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Import):
            names += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [(node.module or "", alias.name) for alias in node.names]
    return names


def refused_imports(block: str) -> list[str]:
    """The block's imports of anything but hf_parallel's top-level names, the standard library, torch,
    transformers and datasets."""
    refused = []
    for module, name in imported_names(block):
        top = module.split(".")[0]
        if top == "hf_parallel":
            if module != "hf_parallel" or (name is not None and name not in hf_parallel.__all__):
                refused.append(f"from {module} import {name}" if name else f"import {module}")
        elif top not in OTHER_PACKAGES and top not in sys.stdlib_module_names:
            refused.append(module)
    return refused

