"""Where the offline tasks (`tasks/`) find their data files, and a run's missing files found before the model loads.

The folder is the one `--metadata '{"data_dir": "DIR"}'` names, else the environment variable HF_PARALLEL_DATA,
else `../shared/data/` beside the repository (which a clone does not have).  lm-eval loads the model before a
task's data, so `missing_data` reads the run's --tasks and --metadata from its arguments first, and the command
line stops with one line naming the files and what to pass.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
SQUAD = "squad-dev-v1.1.json.zip"
DROP = "drop-dev.jsonl.gz"
BOOK = "war-and-peace.txt.gz"
TASK_FILES = {"hfp_squad": SQUAD, "hfp_squad_mc": SQUAD, "hfp_drop": DROP, "hfp_war_and_peace": BOOK}
GROUPS = {"hfp_offline": tuple(TASK_FILES)}


def how(them: str = "it") -> str:
    """What to pass for the data: the end of the sentence saying a file is missing."""
    return f'pass --metadata \'{{"data_dir": "DIR"}}\' or set HF_PARALLEL_DATA=DIR, DIR a folder holding {them}'


def data_folder(data_dir: str | None = None) -> Path:
    """`data_dir`, else $HF_PARALLEL_DATA, else SHARED_DATA."""
    return Path(data_dir or os.environ.get("HF_PARALLEL_DATA") or SHARED_DATA)


def data_file(name: str, data_dir: str | None = None) -> Path:
    """The path of the data file `name` in `data_folder(data_dir)`; FileNotFoundError, saying what to pass, where it
    is not there."""
    folder = data_folder(data_dir)
    if not (folder / name).is_file():
        raise FileNotFoundError(f"{name} not found in {folder}: {how()}")
    return folder / name


def missing_data(argv: list[str]) -> str | None:
    """Where the offline tasks that `argv` (lm-eval's arguments) names lack their files: what is missing and what to
    pass, as one sentence; else None."""
    tasks = [t for value in _values(argv, ("--tasks", "-t")) for t in value.split(",") if t]
    tasks = [t for name in tasks for t in GROUPS.get(name, (name,)) if t in TASK_FILES]
    folder = data_folder(_metadata(argv).get("data_dir"))
    missing = {task: TASK_FILES[task] for task in tasks if not (folder / TASK_FILES[task]).is_file()}
    if not missing:
        return None
    files = sorted(set(missing.values()))
    them = "it" if len(files) == 1 else "them"
    return f"{', '.join(files)} not found in {folder} (read by {', '.join(missing)}): {how(them)}"


def _values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """The values given to any of `flags` (`--flag A B`, `--flag=A`), as lm-eval's nargs="+" flags take them."""
    found = []
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in flags and equals:
            found.append(value)
        elif arg in flags:
            for value in argv[i + 1 :]:
                if value.startswith("-"):
                    break
                found.append(value)
    return found


def _metadata(argv: list[str]) -> dict:
    """--metadata's values as lm-eval merges them: a JSON object, or `key=value` pairs ({} where neither)."""
    merged = {}
    for value in _values(argv, ("--metadata",)):
        try:
            parsed = json.loads(value)
        except ValueError:
            key, equals, text = value.partition("=")
            if not equals:
                continue
            try:
                parsed = {key: ast.literal_eval(text)}
            except (ValueError, SyntaxError):
                parsed = {key: text}
        if isinstance(parsed, dict):
            merged |= parsed
    return merged
