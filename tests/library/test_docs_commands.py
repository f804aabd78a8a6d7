"""The commands of the README's, the docs' and the notebook's bash blocks, checked offline as far as each can be.

Every fenced block says what it is: ```python (tests/library/test_docs_blocks.py runs those), ```bash
(commands, checked here) or ```text (output, a diagram: nothing to run).  Each command of a bash block is one of:

    hf-parallel ... (python -m hf_parallel ...)   parsed by the command line itself, stopped once its flags are
                                                  parsed (before any model loads); docs/guides/cli.md's and
                                                  batch.md's blocks also run whole, on the embedded SmolLM2
    python eval/SCRIPT.py ...                     parsed by the script's own argparse parser, run as
                                                  `python SCRIPT` runs it and stopped at its `parse_args`
    torchrun / accelerate launch ...              parsed by their own parsers, then the script or module they run
    python -m pytest PATHS                        the test files named exist
    pip install ...                               the extras named (-e ".[x,y]") exist in pyproject.toml
    echo, printf, mkdir, gzip, tee                shell, writing the files the next commands read
    ALLOWED                                       what cannot run here, each with its reason

Anything else fails, naming the page and line, so that a command added to the docs is either checked or allowed
with a reason; a renamed or removed flag or subcommand fails as a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_parallel import cli
from hf_parallel.harness.data import TASK_FILES
from tests.helpers.blocks import ShellCommand, fenced_blocks_at, shell_commands
from tests.helpers.cli import load_as_smollm2
from tests.helpers.project import EVAL, ROOT, eval_module

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), EVAL / "README.md", NOTEBOOK]
LANGUAGES = {"python", "bash", "text"}
SHELL = {"echo", "printf", "mkdir", "gzip", "tee"}  # they write the files that the commands after them read
ALLOWED = {  # commands that cannot run here, and why
    "curl": "asks the server that the line before it starts (tests/server sends the same requests)",
    "jupyter": "opens the notebook in a browser (tests/library/test_notebook.py runs its cells)",
    "ray": "starts or stops a Ray cluster's processes (tests/ray starts a local cluster with ray.init)",
}
ALLOWED_SCRIPTS = {"my_script.py": "the reader's own script, which torchrun starts on every rank"}
# where a command line stops once its flags are parsed: the work each command starts with
CLI_STOPS = (
    "hf_parallel.frontends.demo.run",
    "hf_parallel.cli.answer.answer_document",
    "hf_parallel.cli.corpus.answer_corpus",
    "hf_parallel.harness.cli.embedded_model_dir",
    "hf_parallel.harness.cli.compare",
)
RUN_WHOLE = ("docs/guides/cli.md", "docs/guides/batch.md")  # their blocks run on SmolLM2, in an empty folder
HARNESS_GUIDE = ROOT / "docs" / "guides" / "harness.md"  # its first example runs on a checkout without ../shared


class Parsed(Exception):
    """A command parsed its flags: where the check stops it, before any work."""


def page_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, language, body) of every fenced block of a page (of a notebook: of its Markdown cells, the line
    counted within the cell)."""
    if page.suffix != ".ipynb":
        return fenced_blocks_at(page.read_text())
    cells = json.loads(page.read_text())["cells"]
    return [b for c in cells if c["cell_type"] == "markdown" for b in fenced_blocks_at("".join(c["source"]))]


def name(page: Path) -> str:
    """The page's path in the repository (its file name where it lies outside)."""
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


def commands(page: Path, home: Path) -> list[tuple[str, ShellCommand]]:
    """("page:line", command) of each command of the page's bash blocks, $HOME being `home`."""
    variables = {"HOME": str(home)}  # a page's assignments hold for its later blocks
    found = []
    for line, language, body in page_blocks(page):
        if language == "bash":
            found += [(f"{name(page)}:{line + 1 + c.line}", c) for c in shell_commands(body, variables)]
    return found


@contextlib.contextmanager
def stopped_once_parsed():
    """Every `ArgumentParser.parse_args` and each of `CLI_STOPS` raises `Parsed` (parse_args once it parsed); no
    parser takes an abbreviation of a flag (`--workload` for `--workloads`): a flag renamed by a suffix fails."""
    init, parse_args = argparse.ArgumentParser.__init__, argparse.ArgumentParser.parse_args

    def init_strict(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.allow_abbrev = False

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse_args(self, args, namespace))

    def stop(*args, **kwargs):
        raise Parsed()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "__init__", init_strict)
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        for target in CLI_STOPS:
            patch.setattr(target, stop)
        yield


def parsed_or_error(run) -> str | argparse.Namespace | None:
    """Where `run()` gets as far as `Parsed`: what parse_args parsed (None from a CLI_STOPS); else a string, what
    it printed or raised instead."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), stopped_once_parsed():
            run()
    except Parsed as parsed:
        return parsed.args[0] if parsed.args else None
    except SystemExit as exit_:
        return f"exit status {exit_.code}: {err.getvalue().strip()}"
    except Exception as error:  # noqa: BLE001 - a script that does not even import is reported as it is
        return f"{type(error).__name__}: {error}"
    return "ran to the end without parsing any flags"


def usage_error(run) -> str | None:
    """None where `run()` gets as far as `Parsed`; else what it printed or raised instead."""
    found = parsed_or_error(run)
    return found if isinstance(found, str) else None


def check_cli(argv: list[str]) -> str | None:
    return usage_error(lambda: cli.main(argv))


def check_script(path: str, args: list[str], previous: dict[str, list[str]]) -> str | None:
    """`python path args`: the script's own parser must take `args` (`...` first: the arguments of the block's
    command before it of the same script)."""
    if path in ALLOWED_SCRIPTS:
        return None
    script = ROOT / path
    if not script.is_file():
        return f"no script {path}"
    if args[:1] == ["..."]:
        args = previous.get(path, []) + args[1:]
    previous[path] = args
    if script.name == "ab_bench.py":  # argv by position, and it imports a second copy of the package (BASELINE)
        known = set(eval_module("bench").SHAPES)
        shapes, repeats, parts = [*args, "", "", ""][:3]
        fits = set(shapes.split(",")) <= known and repeats.isdigit() and set(parts.split(",")) <= {"row", "corpus"}
        return None if fits and len(args) == 3 else f"ab_bench.py takes SHAPES ({sorted(known)}) REPEATS row,corpus"

    def run():
        saved, sys.argv, path = sys.argv, [str(script), *args], list(sys.path)
        sys.path.insert(0, str(script.parent))  # as python puts the script's folder first
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv, sys.path[:] = saved, path  # the folders the script put on the path too

    return usage_error(run)


def check_pip(args: list[str]) -> str | None:
    """pip install: the extras of the project that -e names must be pyproject.toml's."""
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11's; the project runs on 3.10)
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)^\[", text, flags=re.S | re.M).group(1)
    extras = set(re.findall(r"^([\w-]+) = \[", section, flags=re.M))
    for target in args[1:]:
        named = re.fullmatch(r"\.\.?\[(.+)\]", target)
        if named and not set(named.group(1).split(",")) <= extras:
            return f"{target}: pyproject.toml's extras are {sorted(extras)}"
    return None if args[:1] == ["install"] else "pip: only pip install"


def check_pytest(args: list[str]) -> str | None:
    missing = [a for a in args if not a.startswith("-") and "/" in a and not (ROOT / a.split("::")[0]).exists()]
    return f"no such test file: {missing}" if missing else None


def check_launcher(module: str, args: list[str], previous) -> str | None:
    """torchrun or accelerate launch: their own parsers take the flags; then what they start is checked."""
    if module == "torch.distributed.run":
        from torch.distributed.run import get_args_parser as parser
    else:
        from accelerate.commands.launch import launch_command_parser as parser  # noqa: I001
    launched = parsed_or_error(lambda: parser().parse_args(args))
    if isinstance(launched, str):
        return launched
    script, rest = launched.training_script, launched.training_script_args
    if launched.module:
        return check(["python", "-m", script, *rest], previous)
    return check_script(script, rest, previous)


def check(argv: list[str], previous: dict[str, list[str]]) -> str | None:
    """None where the command checks out (or is allowed); else why not."""
    program, args = argv[0], argv[1:]
    if program == "hf-parallel":
        return check_cli(args)
    if program in ("python", "python3") and args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "hf_parallel":
            return check_cli(rest)
        if module == "pytest":
            return check_pytest(rest)
        if module == "pip":
            return check_pip(rest)
        if module in ("torch.distributed.run", "accelerate.commands.launch"):
            return check_launcher(module, rest, previous)
        if module in sys.stdlib_module_names:  # compileall: its own parser, stopped there
            return usage_error(lambda: _run_module(module, rest))
        return f"an unknown module {module!r}"
    if program in ("python", "python3") and args[:1] and args[0].endswith(".py"):
        return check_script(args[0], args[1:], previous)
    if program == "torchrun":
        return check_launcher("torch.distributed.run", args, previous)
    if program == "accelerate" and args[:1] == ["launch"]:
        return check_launcher("accelerate.commands.launch", args[1:], previous)
    if program == "pip":
        return check_pip(args)
    if program in SHELL:
        return None
    if program in ALLOWED:
        missing = [a for a in args if a.endswith(".ipynb") and not (ROOT / a).exists()]
        return f"no such file: {missing}" if missing else None
    return f"an unknown command {program!r}: check it here, or allow it in ALLOWED with the reason"


def _run_module(module: str, args: list[str]) -> None:
    saved, sys.argv = sys.argv, [module, *args]
    try:
        runpy.run_module(module, run_name="__main__")
    finally:
        sys.argv = saved


def failures(page: Path, home: Path) -> list[str]:
    previous: dict[str, list[str]] = {}
    found = [(where, c, check(c.argv, previous)) for where, c in commands(page, home)]
    return [f"{where}: {' '.join(c.argv)}\n    {error}" for where, c, error in found if error]


def test_every_block_says_what_it_is():
    unnamed = [f"{name(p)}:{line}" for p in PAGES for line, language, _ in page_blocks(p) if language not in LANGUAGES]
    assert unnamed == [], f"a block without a language of {sorted(LANGUAGES)}"


def test_the_pages_with_commands_are_found(tmp_path):
    with_commands = {name(p) for p in PAGES if commands(p, tmp_path)}
    assert {"README.md", "docs/guides/cli.md", "docs/benchmarks/gpu.md", "eval/README.md"} <= with_commands
    assert "notebooks/quickstart.ipynb" in with_commands


@pytest.mark.parametrize("page", [p for p in PAGES if commands(p, ROOT)], ids=name)
def test_every_command_of_a_bash_block_checks_out(page, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # nothing a parser does writes into the repository
    data = tmp_path / "data"  # the offline tasks' files, there for lm-eval's check (no command gets to read them)
    data.mkdir()
    for file in set(TASK_FILES.values()):
        (data / file).touch()
    monkeypatch.setenv("HF_PARALLEL_DATA", str(data))
    failed = failures(page, tmp_path)
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("argv, error", [
    ("hf-parallel answer --corpus in.jsonl --out out.jsonl --max-new-tokenz 8", "unrecognized arguments"),
    ("hf-parallel answr --corpus in.jsonl", "invalid choice"),
    ("hf-parallel serve --prot 8000", "unrecognized arguments"),
    ("hf-parallel batch --input a.jsonl", "required"),
    ("hf-parallel eval --dataset squad --doc-per-call 4", "unrecognized arguments"),
    ("hf-parallel lm-eval --tasks hfp_squad --limt 3", "exit status 2"),
    ("hf-parallel lm-eval compare out/a", "exit status 2"),
    ("python eval/bench.py --model codellama-7b --workload grid", "unrecognized arguments"),
    ("python eval/bench.py --methods 'stock,pp_trition@8k x 64q'", "unknown methods ['pp_trition']"),
    ("python eval/quality.py merge a.json", "required"),
    ("python eval/diagnostics/first_call.py --no-early-imports", "unrecognized arguments"),
    ("python eval/corpus_bench.py --part fits", "unrecognized arguments"),
    ("python eval/gone.py", "no script"),
    ("python eval/ab_bench.py llama-9b 3 row", "takes SHAPES"),
    ("python eval/ab_bench.py qwen2.5-7b 3", "takes SHAPES"),
    ("accelerate launch --num_processes 2 -m hf_parallel answer --corpus a --outt b", "unrecognized arguments"),
    ("torchrun --nproc_per_node 2 eval/scale_bench.py --mode tpp", "invalid choice"),
    ("python -m pytest tests/library/test_nothing.py", "no such test file"),
    ('pip install -e ".[test,serving]"', "extras are"),
    ("frobnicate --now", "an unknown command"),
])  # fmt: skip
def test_a_stale_command_fails(argv, error, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n```bash\n{argv}\n```\n")
    (found,) = failures(page, tmp_path)
    assert found.startswith("page.md:4: ") and error in found, found


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_WHOLE)
def test_the_cli_guides_blocks_run_on_smollm2(page, smollm2, monkeypatch, tmp_path, capsys):
    """Their commands run in order in an empty folder, as a reader would paste them: shell lines in bash,
    hf-parallel in this process with the session's SmolLM2; each exits 0, and what --out/--output names holds
    a JSON line for each input line."""
    load_as_smollm2(monkeypatch, smollm2)
    monkeypatch.chdir(tmp_path)
    ran, outputs = 0, []
    for _, command in commands(ROOT / page, tmp_path):
        argv = command.argv
        if argv[0] in ("echo", "printf"):
            subprocess.run(["bash", "-c", command.text], cwd=tmp_path, check=True)
        elif argv[0] == "hf-parallel":
            try:
                cli.main(argv[1:])
            except SystemExit as exit_:
                assert exit_.code in (0, None), f"{page}: {' '.join(argv)}: {capsys.readouterr().err}"
            outputs += [argv[i + 1] for i, a in enumerate(argv) if a in ("--out", "--output")]
            ran += 1
        else:
            assert argv[:2] == ["pip", "install"], argv  # checked by test_every_command_of_a_bash_block_checks_out
    assert ran >= 1 and outputs
    for out in outputs:
        lines = [json.loads(line) for line in (tmp_path / out).read_text().splitlines()]
        answered = [line.get("answers") or line.get("response", {}).get("status_code") == 200 for line in lines]
        assert answered and all(answered), f"{page}: {out}: {lines}"


def test_the_harness_guides_first_example_on_a_checkout_without_shared_data(tmp_path):
    """A fresh clone has no ../shared/data: each evaluation of the guide's first example says in one line which file
    it needs and what to pass (exit status 2), before loading the model (which the example's save-smollm2 would have
    written: a model loaded first would fail on the missing directory instead)."""
    checkout = tmp_path / "clone"
    shutil.copytree(ROOT / "hf_parallel", checkout / "hf_parallel", ignore=shutil.ignore_patterns("__pycache__"))
    assert not (tmp_path / "shared").exists()
    first = next(body for _, language, body in page_blocks(HARNESS_GUIDE) if language == "bash")
    evaluations = [c.argv for c in shell_commands(first, {"HOME": str(tmp_path)}) if "--tasks" in c.argv]
    assert len(evaluations) == 2 and all(argv[:2] == ["hf-parallel", "lm-eval"] for argv in evaluations)
    env = {k: v for k, v in os.environ.items() if k != "HF_PARALLEL_DATA"}
    env |= {"PYTHONPATH": str(checkout), "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    for argv in evaluations:
        done = subprocess.run(
            [sys.executable, "-m", "hf_parallel", *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-3000:]
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"hf-parallel lm-eval: error: squad-dev-v1.1.json.zip not found in {tmp_path}/shared/")
        assert line.endswith(
            """pass --metadata '{"data_dir": "DIR"}' or set HF_PARALLEL_DATA=DIR, DIR a folder holding it"""
        )
