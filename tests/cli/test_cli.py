"""The command line answers a user's mistakes with a usage error (`prog: error: ...` on stderr, exit
status 2) rather than a traceback: a missing or malformed data file, an absent offline copy, flag
values the config refuses, another run's checkpoint, reports that cannot be merged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_parallel import cli
from hf_parallel.cli.usage import UsageParser
from hf_parallel.decoding.options import DEFAULT_MAX_NEW_TOKENS
from hf_parallel.evaluation import config, quality, report
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.cli import usage_error
from tests.helpers.models import tiny_model
from tests.helpers.project import ROOT

SQUAD_FORMAT = "SQuAD v1.1 dev JSON"


def squad_file(tmp_path: Path) -> Path:
    qa = {"id": "a", "question": "Who sat?", "answers": [{"text": "cat", "answer_start": 0}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps({"data": [{"title": "T", "paragraphs": [{"context": "A cat sat.", "qas": [qa]}]}]}))
    return path


# --------------------------------------------------------------------------- eval: the data


def test_eval_without_the_offline_copy_says_where_it_looked(tmp_path, monkeypatch, capsys, no_model):
    absent = tmp_path / "shared" / "data"
    for module in (config, quality):  # the default path and the check that it exists
        monkeypatch.setattr(module, "SHARED_DATA", absent)
    err = usage_error(capsys, ["eval", "--limit", "3"])
    assert "hf-parallel eval: error: the offline copy of squad was not found at" in err
    assert str(absent / "squad-dev-v1.1.json.zip") in err and "--data FILE" in err and "`datasets` name" in err
    assert "from https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v1.1.json" in err  # where to get it
    assert err.count("\n") == 1  # one line


def _write(path: Path, content: bytes | str) -> Path:
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


@pytest.mark.parametrize("name, content, error", [
    ("missing.json", None, "FileNotFoundError"),
    ("notes.json", "not json", "JSONDecodeError"),
    ("list.json", "[1, 2]", "TypeError"),
    ("other.json", '{"data": [{"title": "T"}]}', "KeyError: 'paragraphs'"),
    ("drop.jsonl", '{"context": "x"}\n{"context": "y"}\n', "JSONDecodeError"),
    ("archive.zip", b"not a zip", "BadZipFile"),
    ("latin1.json", b"\xff\xfe{", "UnicodeDecodeError"),
])  # fmt: skip
def test_eval_names_a_data_file_it_cannot_read_and_the_format_expected(tmp_path, capsys, no_model, name, content,
                                                                       error):  # fmt: skip
    path = tmp_path / name if content is None else _write(tmp_path / name, content)
    err = usage_error(capsys, ["eval", "--data", str(path)])
    assert f"hf-parallel eval: error: cannot read {path} as the {SQUAD_FORMAT}" in err and error in err


def test_eval_data_that_is_neither_a_file_nor_usable_as_a_datasets_name(monkeypatch, capsys, no_model):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes "import datasets" fail
    err = usage_error(capsys, ["eval", "--data", "no-such-squad"])
    assert "cannot read no-such-squad as the" in err and "'datasets' package" in err


def test_eval_with_the_wrong_dataset_for_its_file(tmp_path, capsys, no_model):
    err = usage_error(capsys, ["eval", "--dataset", "quac", "--data", str(squad_file(tmp_path))])
    assert "as the QuAC dev JSON (val_v0.2.json" in err and "KeyError: 'id'" in err


# --------------------------------------------------------------------------- eval and demo: flag values


@pytest.mark.parametrize("flags, message", [
    (["--docs-per-call", "0"], "docs_per_call must be >= 1, got 0"),
    (["--standard-batch-size", "-2"], "standard_batch_size must be >= 1, got -2"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1, got 0"),
    (["--limit", "0"], "limit must be >= 1, got 0"),
    (["--device", "tpu"], "device must be cpu or cuda[:N], got 'tpu'"),
    (["--methods", "batch", "batch", "--resamples", "0"], "resamples must be >= 1, got 0"),
    (["--dataset", "quac"], "quac has no offline copy; pass data= (--data FILE)"),
])  # fmt: skip
def test_eval_flag_values_the_config_refuses(monkeypatch, capsys, flags, message):
    ran = []
    monkeypatch.setattr(quality, "evaluate_quality", ran.append)
    err = usage_error(capsys, ["eval", *flags])
    assert f"hf-parallel eval: error: {message}" in err and not ran


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_demo_needs_a_positive_max_new_tokens(monkeypatch, capsys, value):
    ran = []
    monkeypatch.setattr("hf_parallel.frontends.demo.run", lambda **kwargs: ran.append(kwargs))
    err = usage_error(capsys, ["demo", "--max-new-tokens", value])
    assert "hf-parallel demo: error: argument --max-new-tokens:" in err and ">= 1" in err and not ran


def test_a_usage_error_is_one_line_and_a_pointer_to_help(capsys):
    """A flag argparse or the config refuses: the message, then where the options are; no usage block."""
    err = usage_error(capsys, ["answer", "--document", "doc.txt", "--questions", "q.txt", "--dtype", "int8"])
    assert err.splitlines() == [
        "hf-parallel answer: error: argument --dtype: invalid choice: 'int8' (choose from 'auto', 'float32', "
        "'bfloat16', 'float16')",
        "(hf-parallel answer --help lists the options)",
    ]
    assert usage_error(capsys, ["answer", "--document", "doc.txt"]).splitlines() == [
        "hf-parallel answer: error: --document needs --questions",
        "(hf-parallel answer --help lists the options)",
    ]
    assert usage_error(capsys, ["answer", "--document", "doc.txt", "--questions", "q.txt", "--bogus"]).startswith(
        "hf-parallel answer: error: unrecognized arguments: --bogus\n"
    )
    assert usage_error(capsys, []).startswith("hf-parallel: error: the following arguments are required: COMMAND\n")
    assert usage_error(capsys, ["eval", "--limit", "0"]).startswith("hf-parallel eval: error: limit must be >= 1")


def help_text(capsys, argv: list[str]) -> str:
    """`hf-parallel argv --help`'s output, its whitespace folded."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_max_new_tokens_help_says_what_is_used(capsys):
    said = help_text(capsys, ["answer"])
    assert (
        "--max-new-tokens N per answer (default: the model's generation_config max_new_tokens, else its max_length "
        f"less the prompt, else {DEFAULT_MAX_NEW_TOKENS})"
    ) in said


def test_every_command_and_flag_has_help(capsys):
    assert "Ten questions about a built-in passage" in help_text(capsys, ["demo"])
    assert "--max-new-tokens N per answer (default: 48)" in help_text(capsys, ["demo"])
    parser = UsageParser()
    config.add_arguments(parser)
    assert [action.dest for action in parser._actions if not action.help] == []
    said = help_text(capsys, ["eval"])
    assert "--model DIR_OR_HUB_ID a model directory, or a hub id" in said
    assert "--attn {auto,reference,triton} parallel prompting's attention path" in said


def test_eval_with_a_model_directory(tmp_path, capsys, no_model):
    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    char_tokenizer().save_pretrained(tmp_path / "tiny")
    out = tmp_path / "report.json"
    cli.main(["eval", "--data", str(squad_file(tmp_path)), "--model", str(tmp_path / "tiny"), "--max-new-tokens", "2",
              "--resamples", "10", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["model"] == str(tmp_path / "tiny") and report["config"]["model"] == str(tmp_path / "tiny")
    assert report["n_questions"] == 1 and "| parallel |" in capsys.readouterr().out


def test_eval_and_batch_bars_follow_progress_and_quiet(tmp_path, capsys, no_model):
    """--progress shows the bars whatever stderr is, --no-progress and --quiet none (batch: --quiet no summary)."""
    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    char_tokenizer().save_pretrained(tmp_path / "tiny")
    model = ["--model", str(tmp_path / "tiny"), "--device", "cpu"]
    evaluate = ["eval", "--data", str(squad_file(tmp_path)), *model, "--max-new-tokens", "2", "--resamples", "10"]
    cli.main([*evaluate, "--methods", "parallel", "--progress"])
    assert "parallel: 100%" in capsys.readouterr().err
    cli.main([*evaluate, "--methods", "parallel", "--no-progress"])
    assert "100%" not in capsys.readouterr().err
    body = {"model": "tiny", "prompt": "A cat sat.", "max_tokens": 2, "temperature": 0}
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    batch = ["batch", "--input", str(source), *model, "--served-model-name", "tiny"]
    cli.main([*batch, "--output", str(tmp_path / "shown.jsonl"), "--progress"])
    said = capsys.readouterr().err
    assert "1/1" in said and said.endswith("0 of its 1 lines failed (error set, or a status_code other than 200)\n")
    cli.main([*batch, "--output", str(tmp_path / "quiet.jsonl"), "--quiet"])
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "quiet.jsonl").read_text())["response"]["status_code"] == 200


# --------------------------------------------------------------------------- eval: checkpoint and merge


def test_eval_refuses_the_checkpoint_of_another_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        "hf_parallel.frontends.default_model.load_smollm2", lambda *a, **k: (tiny_model("llama"), char_tokenizer())
    )
    checkpoint = tmp_path / "run.jsonl"
    checkpoint.write_text('{"hf_parallel_quality_checkpoint": 1, "model": "another"}\n')
    err = usage_error(capsys, ["eval", "--data", str(squad_file(tmp_path)), "--checkpoint", str(checkpoint)])
    assert f"hf-parallel eval: error: {checkpoint} is the checkpoint of another run" in err


def _report(question_id: str) -> dict:
    return {"dataset": "squad", "model": "m", "config": {}, "summary": {}, "questions": [{"id": question_id}]}


@pytest.mark.parametrize("files, message", [
    ({"a.json": None}, "cannot read the report {first}: [Errno 2] No such file"),
    ({"a.json": "{}"}, "cannot read the report {first}: not a report that `hf-parallel eval` (evaluate_quality) wrote"),
    ({"a.json.gz": "{}"}, "cannot read the report {first}: Not a gzipped file"),
    ({"a.json": json.dumps(_report("x")), "b.json": json.dumps(_report("y"))}, "the reports cover different"),
])  # fmt: skip
def test_eval_merge_of_reports_it_cannot_read_or_merge(tmp_path, capsys, files, message):
    paths = [tmp_path / name if text is None else _write(tmp_path / name, text) for name, text in files.items()]
    err = usage_error(capsys, ["eval", "merge", *map(str, paths), "--out", str(tmp_path / "m.json")])
    assert "hf-parallel eval merge: error: " + message.format(first=paths[0]) in err


# --------------------------------------------------------------------------- the scripts, in a subprocess


@pytest.mark.parametrize("command, prog", [
    ([sys.executable, "-m", "hf_parallel", "eval"], "hf-parallel eval"),
    ([sys.executable, str(ROOT / "eval" / "quality.py")], "quality.py"),
])  # fmt: skip
def test_scripts_exit_with_a_usage_error_for_a_missing_data_file(tmp_path, command, prog):
    missing = tmp_path / "dev-v1.1.json"
    done = subprocess.run([*command, "--data", str(missing), "--limit", "3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{prog}: error: cannot read {missing} as the {SQUAD_FORMAT}" in done.stderr


# --------------------------------------------------------------------------- eval: the table explains batch prompting


def eval_report(batch_predictions: list[str] | None) -> dict:
    """A report of `hf-parallel eval` over len(batch_predictions) questions, standard's and (given) batch's."""
    methods = ["standard"] + ([] if batch_predictions is None else ["batch"])
    predictions = batch_predictions or ["an answer"] * 3
    row = {"em": 0.0, "f1": 0.1, "wall_s": 1.0}
    return {
        "dataset": "squad", "model": "M", "n_questions": len(predictions), "n_documents": 1,
        "config": {"dtype": "float32", "device": "cpu", "max_new_tokens": 8, "standard_batch_size": 1,
                   "docs_per_call": 1, "batch_rows": 1},
        "summary": {m: row for m in methods},
        "questions": [{"predictions": {"standard": "x", **({"batch": p} if batch_predictions else {})}}
                      for p in predictions],
    }  # fmt: skip


def test_the_eval_table_says_how_many_batch_answers_the_model_left_out():
    predictions = ["Paris", "", "  ", "1889", ""]
    said = report.table(eval_report(predictions)).splitlines()[-1]
    missing = sum(not p.strip() for p in predictions)
    assert said.startswith(f"batch prompting: {missing} of {len(predictions)} answers are missing from the model's")
    assert "score 0" in said and "batch_outputs" in said
    assert "batch prompting:" not in report.table(eval_report(None))
    assert "batch prompting:" not in report.table(eval_report(["a", "b"]))  # every answer there: nothing to explain
