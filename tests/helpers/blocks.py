"""Fenced code blocks of a Markdown page, run as a reader would paste them; the commands of its bash blocks."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import hf_parallel

OTHER_PACKAGES = {"torch", "transformers", "datasets", "ray"}  # what an example may import besides hf_parallel
EXTRAS = {"hf_parallel.ray": ["Answerer"]}  # an optional extra's package and its public names (hf_parallel.ray.__all__)


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
    """The block's imports of anything but hf_parallel's top-level names (and those of the extras' packages,
    `EXTRAS`), the standard library, torch, transformers, datasets and ray."""
    refused = []
    for module, name in imported_names(block):
        top = module.split(".")[0]
        if top == "hf_parallel":
            public = EXTRAS.get(module, hf_parallel.__all__ if module == "hf_parallel" else None)
            if public is None or (name is not None and name not in public):
                refused.append(f"from {module} import {name}" if name else f"import {module}")
        elif top not in OTHER_PACKAGES and top not in sys.stdlib_module_names:
            refused.append(module)
    return refused


def fenced_blocks_at(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language or "", body) of each fenced block of Markdown `text`, in order."""
    found = re.finditer(r"^[ \t]*```(\w*)[ \t]*\n(.*?)^[ \t]*```", text, flags=re.S | re.M)
    return [(text[: m.start()].count("\n") + 1, m.group(1), m.group(2)) for m in found]


@dataclass
class ShellCommand:
    """One simple command of a bash block, as the shell would run it."""

    line: int  # in the block, from 0: where its (continued) line starts
    argv: list[str]  # after the block's variables are expanded, without redirections
    env: dict[str, str]  # NAME=VALUE assignments before it
    text: str  # the (continued) line it is part of


SEPARATORS = {";", "&&", "||", "|", "&"}
REDIRECTIONS = {">", ">>", "<", ">&", "&>"}


def shell_commands(block: str, variables: dict[str, str]) -> list[ShellCommand]:
    """The simple commands of a bash block, in order: continued lines joined, comments and redirections dropped,
    `$NAME` expanded from `variables` (which the block's own assignments and exports update, for the blocks after
    it), split at ;, &&, ||, | and &, without `time`, `export`, `for NAME in ...; do` and `done` (a loop's
    variable takes its first value).  An assignment from a command substitution, `NAME=$(...)`, gives `<NAME>`."""
    commands = []
    for line, text in _continued_lines(block):
        assigned = re.fullmatch(r"(\w+)=(\$\(.*\)|\"[^\"]*\"|\S*)\s*(#.*)?", text.strip())
        if assigned:
            value = assigned.group(2)
            variables[assigned.group(1)] = f"<{assigned.group(1)}>" if value.startswith("$(") else shlex.split(value)[0]
            continue
        for loop in re.finditer(r"\bfor (\w+) in (\S+)", text):
            variables[loop.group(1)] = loop.group(2)
        expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), text)
        lexer = shlex.shlex(expanded.replace("2>&1", ""), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        for words in _split(list(lexer)):
            env = {}
            while words and (words[0] in ("time", "do", "export") or re.match(r"\w+=", words[0])):
                if "=" in words[0]:
                    name, value = words[0].split("=", 1)
                    env[name] = value
                    if text.lstrip().startswith("export"):
                        variables[name] = value
                words = words[1:]
            if words and words[0] not in ("for", "done"):
                commands.append(ShellCommand(line, words, env, text))
    return commands


def _continued_lines(block: str) -> list[tuple[int, str]]:
    """(first line, text) of each line of `block`, a line ending in a backslash joined to the next."""
    joined, start, parts = [], 0, []
    for i, line in enumerate(block.splitlines()):
        if not parts:
            start = i
        parts.append(line.rstrip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            joined.append((start, " ".join(parts)))
            parts = []
    return [(start, text) for start, text in joined if text.strip()]


def _split(tokens: list[str]) -> list[list[str]]:
    """Shell tokens cut at the command separators, redirections (and what they name) left out."""
    commands, words, skip = [], [], False
    for token in tokens:
        if skip:
            skip = False
        elif token in SEPARATORS:
            commands.append(words)
            words = []
        elif token in REDIRECTIONS:
            skip = True
        else:
            words.append(token)
    return [words for words in [*commands, words] if words]
