"""Fenced code blocks of a Markdown page, run as a reader would paste them."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path


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
