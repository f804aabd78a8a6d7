"""`hf-parallel answer`: one document and its questions file, or a JSON-lines corpus whose output is
appended to and resumed from; every wrong input a usage error (exit status 2), never a traceback."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

import hf_parallel.frontends.corpus as corpus
import hf_parallel.frontends.prompting as prompting
from hf_parallel import cli, generate_parallel
from hf_parallel.cli.answer import AnswerConfig

from .conftest import tiny_model
from .test_cli import usage_error
from .test_quality import char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
NEW = "8"
CORPUS = [
    {"id": "cat", "document": "The cat is named Tom. Tom lives in Paris with Anna, who is a baker.",
     "questions": ["What is the cat called?", "Where does Tom live?"]},
    {"document": "Mount Everest is 8849 metres high and lies in the Himalayas.", "questions": ["How high is it?"]},
    {"id": 3, "document": "Water boils at 100 degrees Celsius at sea level.", "questions": ["When does water boil?"]},
]  # fmt: skip


def load_as_smollm2(monkeypatch, model_and_tokenizer) -> list:
    """`hf-parallel answer` without --model gets `model_and_tokenizer`; returns the loads' (dtype, device)."""
    loads = []

    def load(dtype, device):
        loads.append((dtype, device))
        return model_and_tokenizer

    monkeypatch.setattr("hf_parallel.frontends.default_model.load_smollm2", load)
    return loads


@pytest.fixture
def calls(monkeypatch):
    """The prompts of every generate_tokens call of the corpus mode."""
    made, generate = [], corpus.generate_tokens
    monkeypatch.setattr(corpus, "generate_tokens", lambda model, prompts, **o: made.append(prompts) or
                        generate(model, prompts, **o))  # fmt: skip
    return made


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


# --------------------------------------------------------------------------- SmolLM2, end to end


@pytest.mark.slow
def test_one_document_prints_each_question_with_generate_parallels_answer(smollm2, monkeypatch, capsys, tmp_path):
    loads = load_as_smollm2(monkeypatch, smollm2)
    document, questions = CORPUS[0]["document"], CORPUS[0]["questions"] + ["What is Anna's job?"]
    (tmp_path / "doc.txt").write_text(f"\n{document}\n")  # read without the blank lines around it
    (tmp_path / "q.txt").write_text(f"{questions[0]}\n\n  {questions[1]}\n   \n{questions[2]}")
    cli.main(["answer", "--document", str(tmp_path / "doc.txt"), "--questions", str(tmp_path / "q.txt"),
              "--max-new-tokens", NEW, "--device", "cpu"])  # fmt: skip
    answers = generate_parallel(*smollm2, document, questions, max_new_tokens=int(NEW))
    out = capsys.readouterr().out
    assert out == "".join(f"Q: {q}\nA: {a}\n\n" for q, a in zip(questions, answers))
    assert len(loads) == 1 and str(loads[0][0]) == "torch.float32" and loads[0][1] == "cpu"


@pytest.mark.slow
def test_a_corpus_is_answered_line_by_line_and_resumes_after_an_interruption(smollm2, monkeypatch, capsys,
                                                                            tmp_path, calls):  # fmt: skip
    load_as_smollm2(monkeypatch, smollm2)
    source, whole, cut = write_lines(tmp_path / "in.jsonl", CORPUS), tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    cli.main(["answer", "--corpus", str(source), "--out", str(whole), "--max-new-tokens", NEW])
    lines = [json.loads(line) for line in whole.read_text().splitlines()]
    expected = [generate_parallel(*smollm2, r["document"], r["questions"], max_new_tokens=int(NEW)) for r in CORPUS]
    assert lines == [{"line": 1, "id": "cat", "questions": CORPUS[0]["questions"], "answers": expected[0]},
                     {"line": 2, "questions": CORPUS[1]["questions"], "answers": expected[1]},
                     {"line": 3, "id": 3, "questions": CORPUS[2]["questions"], "answers": expected[2]}]  # fmt: skip
    assert len(calls) == 1  # all three documents fit one call
    # interrupted while writing the second document's line: the rerun cuts it and answers documents 2 and 3
    first, second = whole.read_text().splitlines(keepends=True)[:2]
    cut.write_text(first + second[: len(second) // 2])
    calls.clear()
    cli.main(["answer", "--corpus", str(source), "--out", str(cut), "--max-new-tokens", NEW])
    assert cut.read_text() == whole.read_text()
    assert calls == [[p for r in CORPUS[1:] for p in corpus.render_prompts(smollm2[1], r["document"], r["questions"])]]
    assert "1 document(s) already answered" in capsys.readouterr().err


# --------------------------------------------------------------------------- a tiny model: resume and bad lines


def test_a_finished_corpus_is_not_answered_again(monkeypatch, capsys, tmp_path):
    source, out = write_lines(tmp_path / "in.jsonl", CORPUS), tmp_path / "answers" / "out.jsonl"  # a new folder
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "2"])
    done = out.read_text()
    monkeypatch.setattr("hf_parallel.frontends.default_model.load_smollm2", None)  # not loaded again
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "2"])
    assert out.read_text() == done and "3 document(s) already answered" in capsys.readouterr().err


def test_bad_lines_are_reported_and_skipped_and_the_others_answered(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    rows = [CORPUS[0], '{"id": "x", "document": ', {"document": "No questions.", "questions": []},
            {"id": "long", "document": "word " * 60, "questions": ["Why?"]}, CORPUS[2]]  # fmt: skip
    source, out = write_lines(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    err = usage_error(capsys, ["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "2"])
    assert f"{source} line 2: not JSON (Expecting value: line 1 column 25 (char 24)); skipped" in err
    assert f"{source} line 3: the document has no questions; skipped" in err
    assert f"{source} line 4: question 0's prompt has" in err and "256 positions" in err  # the tiny model's
    assert f"hf-parallel answer: error: skipped 3 bad line(s) of {source} (line 2, 3, 4, reported above)" in err
    assert [json.loads(line)["line"] for line in out.read_text().splitlines()] == [1, 5]


@pytest.mark.parametrize("piped", ["document", "questions"])
def test_either_file_may_be_standard_input(monkeypatch, capsys, tmp_path, piped):
    model_and_tokenizer = (tiny_model("llama"), char_tokenizer())
    load_as_smollm2(monkeypatch, model_and_tokenizer)
    document, questions = CORPUS[0]["document"], CORPUS[0]["questions"]
    paths = {}
    for what, text in {"document": document, "questions": "\n".join(questions)}.items():
        if what == piped:
            monkeypatch.setattr("sys.stdin", io.StringIO(text))
            paths[what] = "-"
        else:
            paths[what] = str(tmp_path / f"{what}.txt")
            Path(paths[what]).write_text(text)
    cli.main(["answer", "--document", paths["document"], "--questions", paths["questions"], "--max-new-tokens", "3"])
    answers = generate_parallel(*model_and_tokenizer, document, questions, max_new_tokens=3)
    assert capsys.readouterr().out == "".join(f"Q: {q}\nA: {a}\n\n" for q, a in zip(questions, answers))
    monkeypatch.setattr("sys.stdin", io.StringIO("\n \n"))
    err = usage_error(capsys, ["answer", "--document", paths["document"], "--questions", paths["questions"]])
    assert f"hf-parallel answer: error: the {piped} from standard input " in err


@pytest.mark.parametrize("mode", ["document", "corpus"])
def test_a_system_prompt_without_a_chat_template(monkeypatch, capsys, tmp_path, mode):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer(chat=False)))
    (tmp_path / "doc.txt").write_text("a doc.")
    (tmp_path / "q.txt").write_text("why?")
    flags = {"document": ["--document", str(tmp_path / "doc.txt"), "--questions", str(tmp_path / "q.txt")],
             "corpus": ["--corpus", str(write_lines(tmp_path / "in.jsonl", CORPUS)), "--out",
                        str(tmp_path / "out.jsonl")]}[mode]  # fmt: skip
    err = usage_error(capsys, ["answer", *flags, "--system-prompt", "Be brief.", "--max-new-tokens", "2"])
    assert "hf-parallel answer: error: system_prompt needs a chat template" in err


# --------------------------------------------------------------------------- usage errors before any model work


def _files(tmp_path: Path) -> dict:
    (tmp_path / "doc.txt").write_text("The cat is named Tom.")
    (tmp_path / "q.txt").write_text("What is the cat called?\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "blank.jsonl").write_text("\n \n")
    write_lines(tmp_path / "in.jsonl", CORPUS)
    write_lines(tmp_path / "none.jsonl", [{"document": "No questions.", "questions": []}])
    write_lines(tmp_path / "other.jsonl", [{"id": "cat", "line": 1, "questions": ["Other?"], "answers": ["A."]}])
    write_lines(tmp_path / "broken.jsonl", ['{"line": 1, "questions": [], "answers": []}', "[1, 2]"])
    names = "doc.txt q.txt empty.txt blank.txt blank.jsonl in.jsonl none.jsonl other.jsonl broken.jsonl"
    return {name: str(tmp_path / name) for name in names.split()}


@pytest.mark.parametrize("flags, message", [
    ("--document doc.txt --questions missing.txt", "cannot read the questions file {missing.txt}: [Errno 2]"),
    ("--document missing.txt --questions q.txt", "cannot read the document file {missing.txt}: [Errno 2]"),
    ("--document empty.txt --questions q.txt", "the document file {empty.txt} is empty"),
    ("--document doc.txt --questions blank.txt", "the questions file {blank.txt} has no questions"),
    ("--document doc.txt --questions q.txt --max-new-tokens 0", "argument --max-new-tokens: must be >= 1, got 0"),
    ("--document doc.txt --questions q.txt --tokens-per-call -1", "argument --tokens-per-call: must be >= 1"),
    ("--document doc.txt --questions q.txt --dtype int8", "argument --dtype: invalid choice: 'int8'"),
    ("--document doc.txt --questions q.txt --device tpu", "device must be cpu or cuda[:N], got 'tpu'"),
    ("--document doc.txt --questions q.txt --template {document}", "template '{document}' has no {question} field"),
    ("--document doc.txt", "--document needs --questions"),
    ("--questions q.txt", "--questions needs --document"),
    ("--corpus in.jsonl", "--corpus needs --out"),
    ("--out o.jsonl", "--out needs --corpus"),
    ("--document - --questions -", "only one of --document and --questions can be - (standard input)"),
    ("--document doc.txt --questions q.txt --corpus in.jsonl --out o.jsonl", "give either --document and"),
    ("", "give either --document and --questions, or --corpus and --out"),
    ("--corpus missing.jsonl --out o.jsonl", "cannot read the corpus {missing.jsonl}: [Errno 2]"),
    ("--corpus empty.txt --out o.jsonl", "the corpus {empty.txt} is empty"),
    ("--corpus blank.jsonl --out o.jsonl", "the corpus {blank.jsonl} is empty"),
    ("--corpus none.jsonl --out o.jsonl", "skipped 1 bad line(s) of {none.jsonl} (line 1, reported above)"),
    ("--corpus in.jsonl --out other.jsonl", "{other.jsonl} holds the answers of another corpus (its id 'cat' has"),
    ("--corpus in.jsonl --out broken.jsonl", "cannot resume from {broken.jsonl}: {broken.jsonl} line 2 is not an"),
])  # fmt: skip
def test_usage_errors(tmp_path, capsys, no_model, flags, message):
    files = _files(tmp_path)
    argv = [files.get(flag, str(tmp_path / flag)) if "." in flag else flag for flag in flags.split()]
    for name in ("missing.txt", "missing.jsonl", *files):  # "{name}" in a message: the file's path
        message = message.replace(f"{{{name}}}", str(tmp_path / name))
    err = usage_error(capsys, ["answer", *argv])
    assert f"hf-parallel answer: error: {message}" in err


def test_a_model_that_cannot_be_loaded(tmp_path, capsys):
    files = _files(tmp_path)
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    err = usage_error(capsys, ["answer", "--document", files["doc.txt"], "--questions", files["q.txt"],
                               "--model", str(folder)])  # fmt: skip
    assert err.startswith(f"hf-parallel answer: error: cannot load the model {folder}: ") and err.count("\n") == 1


# --------------------------------------------------------------------------- generation flags


def test_each_flag_is_a_field_of_the_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["answer", "--help"])
    flags = set(re.findall(r"--[a-z-]+", capsys.readouterr().out.split("options:")[1]))
    assert flags == {"--help", "--no-progress"} | {"--" + f.name.replace("_", "-") for f in fields(AnswerConfig)}


FLAGS = ["--attn", "reference", "--max-memory", "1GiB", "--prefill-chunk", "16", "--seed", "7", "--max-new-tokens", "3"]
OPTIONS = {"attn": "reference", "max_memory": "1GiB", "prefill_chunk": 16, "seed": 7, "max_new_tokens": 3}


@pytest.mark.parametrize("sampling, options", [
    ([], {}),
    (["--temperature", "0.7"], {"temperature": 0.7, "do_sample": True}),
    (["--top-p", "0.9"], {"top_p": 0.9, "do_sample": True}),
    (["--temperature", "0.7", "--top-p", "0.9"], {"temperature": 0.7, "top_p": 0.9, "do_sample": True}),
    (["--temperature", "0"], {"do_sample": False}),
    (["--prompt-lookup-num-tokens", "4"], {"prompt_lookup_num_tokens": 4}),
])  # fmt: skip
@pytest.mark.parametrize("mode", ["document", "corpus"])
def test_generation_flags_reach_the_generate_call(monkeypatch, capsys, tmp_path, sampling, options, mode):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    seen = []
    module = corpus if mode == "corpus" else prompting
    generate = module.generate_tokens
    monkeypatch.setattr(module, "generate_tokens", lambda model, prompts, **o: seen.append(o) or
                        generate(model, prompts, **o))  # fmt: skip
    files = _files(tmp_path)
    inputs = {"document": ["--document", files["doc.txt"], "--questions", files["q.txt"]],
              "corpus": ["--corpus", files["in.jsonl"], "--out", str(tmp_path / "out.jsonl")]}[mode]  # fmt: skip
    cli.main(["answer", *inputs, *FLAGS, *sampling])
    assert seen and all({k: o.get(k) for k in (*OPTIONS, *options)} == OPTIONS | options for o in seen)
    assert all(k not in o for o in seen for k in ("temperature", "top_p", "do_sample") if k not in options)


def test_sampling_with_a_seed_repeats_and_differs_from_greedy(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    files = _files(tmp_path)
    argv = ["answer", "--document", files["doc.txt"], "--questions", files["q.txt"], "--max-new-tokens", "12"]
    printed = []
    for flags in (["--temperature", "1.5", "--seed", "3"], ["--temperature", "1.5", "--seed", "3"], []):
        cli.main([*argv, *flags])
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] != printed[2]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--temperature", "0", "--top-p", "0.5"], "--top-p samples, and --temperature 0 decodes greedily"),
    (["--max-memory", "lots"], "max_memory 'lots' is not a size such as '40GiB'"),
    (["--max-memory", "0GiB"], "max_memory must be positive, got '0GiB'"),
    (["--prefill-chunk", "0"], "argument --prefill-chunk: must be >= 1, got 0"),
    (["--attn", "flash"], "argument --attn: invalid choice: 'flash'"),
])  # fmt: skip
def test_generation_flag_values_refused(capsys, tmp_path, no_model, flags, message):
    files = _files(tmp_path)
    err = usage_error(capsys, ["answer", "--document", files["doc.txt"], "--questions", files["q.txt"], *flags])
    assert err.startswith(f"hf-parallel answer: error: {message}")


def test_the_script_exits_with_a_usage_error(tmp_path):
    files = _files(tmp_path)
    command = [sys.executable, "-m", "hf_parallel", "answer", "--document", files["doc.txt"], "--questions",
               str(tmp_path / "missing.txt")]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"hf-parallel answer: error: cannot read the questions file {tmp_path / 'missing.txt'}" in done.stderr
