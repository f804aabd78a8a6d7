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
from hf_parallel.attention import BACKENDS
from hf_parallel.cli import answer
from hf_parallel.cli.answer import AnswerConfig
from hf_parallel.decoding.options import DEFAULT_MAX_NEW_TOKENS
from hf_parallel.kernels.notices import notes_on
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.cli import CORPUS, load_as_smollm2, usage_error, write_lines
from tests.helpers.models import tiny_model
from tests.helpers.project import ROOT

NEW = "8"


@pytest.fixture
def calls(monkeypatch):
    """The prompts of every stream_tokens call of the corpus mode."""
    made, stream = [], corpus.stream_tokens
    monkeypatch.setattr(corpus, "stream_tokens", lambda model, prompts, **o: made.append(prompts) or
                        stream(model, prompts, **o))  # fmt: skip
    return made


def answer_lines(path: Path) -> list[dict]:
    """The answer lines of an --out file, in input order (they are written as documents finish)."""
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda line: line["line"])


def expected_line(number: int, record: dict, answers: list, options: dict, model: str = "SmolLM2-135M-Instruct"):
    """The --out line of input line `number`, as the documentation describes it."""
    line = {"line": number, "id": record.get("id"), "questions": record["questions"], "answers": answers}
    line = {k: v for k, v in line.items() if v is not None}
    return line | {"model": model, "options": {"dtype": "float32", **options}}


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
    expected = [generate_parallel(*smollm2, r["document"], r["questions"], max_new_tokens=int(NEW)) for r in CORPUS]
    options = {"max_new_tokens": int(NEW)}
    assert answer_lines(whole) == [expected_line(i + 1, r, expected[i], options) for i, r in enumerate(CORPUS)]
    assert len(calls) == 1  # all three documents fit one call
    # interrupted while writing the second finished document's line: the rerun cuts it and answers the other two
    first, second = whole.read_text().splitlines(keepends=True)[:2]
    cut.write_text(first + second[: len(second) // 2])
    calls.clear()
    cli.main(["answer", "--corpus", str(source), "--out", str(cut), "--max-new-tokens", NEW])
    assert answer_lines(cut) == answer_lines(whole)
    left = [r for r in CORPUS if r["questions"] != json.loads(first)["questions"]]
    assert calls == [[p for r in left for p in corpus.render_prompts(smollm2[1], r["document"], r["questions"])]]
    assert "1 document(s) already answered" in capsys.readouterr().err


# --------------------------------------------------------------------------- a tiny model: resumable by the document


def tiny_answers(records: list[dict], max_new_tokens: int) -> list[list[str]]:
    """What generate_parallel answers for each record on the tiny model: the reference."""
    return [generate_parallel(tiny_model("llama"), char_tokenizer(), r["document"], r["questions"],
                              max_new_tokens=max_new_tokens) for r in records]  # fmt: skip


def interrupt_after(monkeypatch, streams: int) -> list[int]:
    """Ctrl-C in the corpus's generate call once it has yielded `streams` finished streams; the streams yielded."""
    yielded, stream = [], corpus.stream_tokens

    def interrupted(model, prompts, **options):
        for index, tokens in stream(model, prompts, **options):
            if len(yielded) == streams:
                raise KeyboardInterrupt
            yielded.append(index)
            yield index, tokens

    monkeypatch.setattr(corpus, "stream_tokens", interrupted)
    return yielded


def test_each_document_is_written_as_soon_as_its_last_answer_is_done_inside_a_call(monkeypatch, capsys, tmp_path):
    """All three documents share one call (the default budget); Ctrl-C after the first document's two answers
    leaves that document's line in --out, and the message says so; the rerun answers the other two."""
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    source, out = write_lines(tmp_path / "in.jsonl", CORPUS), tmp_path / "out.jsonl"
    argv = ["answer", "--corpus", str(source), "--max-new-tokens", "4", "--out"]
    stream = corpus.stream_tokens
    yielded = interrupt_after(monkeypatch, streams=2)
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, str(out)])
    owners = [i for i, r in enumerate(CORPUS) for _ in r["questions"]]  # the call's streams, by document
    done = [i for i in range(len(CORPUS)) if all(j in yielded for j, owner in enumerate(owners) if owner == i)]
    assert exit_.value.code == 130 and done  # two streams finished: at least one document
    assert capsys.readouterr().err.splitlines() == [
        f"hf-parallel answer: interrupted; {out} holds the answers of {len(done)} document(s), {len(done)} of them "
        "from this run; run the same command again to answer the rest"
    ]
    expected = tiny_answers(CORPUS, 4)
    options = {"max_new_tokens": 4}
    assert answer_lines(out) == [expected_line(i + 1, CORPUS[i], expected[i], options) for i in done]
    monkeypatch.setattr(corpus, "stream_tokens", stream)
    cli.main([*argv, str(out)])
    assert answer_lines(out) == [expected_line(i + 1, r, expected[i], options) for i, r in enumerate(CORPUS)]
    assert f"{len(done)} document(s) already answered in {out}" in capsys.readouterr().err


def test_ctrl_c_before_any_document_is_done_says_nothing_was_written(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    source, out = write_lines(tmp_path / "in.jsonl", CORPUS), tmp_path / "out.jsonl"
    interrupt_after(monkeypatch, streams=0)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "4"])
    assert exit_.value.code == 130 and not out.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"hf-parallel answer: interrupted; no document was finished, so nothing was written to {out}; run the same "
        "command again"
    ]


def test_a_rerun_with_another_model_or_other_options_is_refused_unless_forced(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    source, out = write_lines(tmp_path / "in.jsonl", CORPUS[:2]), tmp_path / "out.jsonl"
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "3"])
    written, _ = out.read_text(), capsys.readouterr()
    longer = usage_error(capsys, ["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "5"])
    assert longer == (
        f"hf-parallel answer: error: {out} holds answers of another run (max_new_tokens 3 there, 5 here); pass "
        "--force to add this run's answers to it, or another --out\n"
    )
    model = tmp_path / "model"
    tiny_model("llama").save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    argv = ["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "3", "--model", str(model)]
    assert f"(model SmolLM2-135M-Instruct there, {model} here)" in usage_error(capsys, argv)
    assert out.read_text() == written  # refused before any work
    write_lines(source, CORPUS)  # one document more: --force answers it with this run's options
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "5", "--force"])
    lines = answer_lines(out)
    assert [line["options"]["max_new_tokens"] for line in lines] == [3, 3, 5]
    assert lines[2] == expected_line(3, CORPUS[2], tiny_answers(CORPUS[2:], 5)[0], {"max_new_tokens": 5})


def test_without_out_the_answers_go_to_standard_output_as_json_lines(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    source = write_lines(tmp_path / "in.jsonl", CORPUS)
    cli.main(["answer", "--corpus", str(source), "--max-new-tokens", "3"])
    printed = sorted((json.loads(line) for line in capsys.readouterr().out.splitlines()), key=lambda x: x["line"])
    expected = tiny_answers(CORPUS, 3)
    assert printed == [expected_line(i + 1, r, expected[i], {"max_new_tokens": 3}) for i, r in enumerate(CORPUS)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no file written


@pytest.mark.parametrize("out", [True, False])
def test_a_finished_run_ends_with_a_one_line_summary_and_quiet_prints_nothing(monkeypatch, capsys, tmp_path, out):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    source = write_lines(tmp_path / "in.jsonl", CORPUS)
    target = ["--out", str(tmp_path / "out.jsonl")] if out else []
    cli.main(["answer", "--corpus", str(source), *target, "--max-new-tokens", "2"])
    where = f"answers in {tmp_path / 'out.jsonl'}" if out else "answers written to standard output"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"hf-parallel answer: 3 document\(s\), 4 question\(s\) answered in \d+\.\d s; {re.escape(where)}", err[0]
    )
    target = ["--out", str(tmp_path / "quiet.jsonl")] if out else []
    cli.main(["answer", "--corpus", str(source), *target, "--max-new-tokens", "2", "--quiet"])
    assert capsys.readouterr().err == ""


def test_quiet_turns_the_notes_off_while_the_command_runs(monkeypatch, tmp_path):
    """The notes on stderr (converting the embedded model, building Triton's kernels, a busy CPU) are off from the
    model's load to the last answer under --quiet, and on again after it."""
    notes = []

    def load(dtype, device, progress=None):
        notes.append(notes_on())
        return tiny_model("llama"), char_tokenizer()

    monkeypatch.setattr("hf_parallel.frontends.default_model.load_smollm2", load)
    files = _files(tmp_path)
    one = ["answer", "--document", files["doc.txt"], "--questions", files["q.txt"], "--max-new-tokens", "2"]
    many = ["answer", "--corpus", files["in.jsonl"], "--max-new-tokens", "2", "--out"]
    for argv in (
        one,
        [*one, "--quiet"],
        [*many, str(tmp_path / "a.jsonl")],
        [*many, str(tmp_path / "b.jsonl"), "--quiet"],
    ):
        cli.main(argv)
    assert notes == [True, False, True, False] and notes_on()


def test_one_document_as_json(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    files = _files(tmp_path)
    cli.main(["answer", "--document", files["doc.txt"], "--questions", files["q.txt"], "--max-new-tokens", "3",
              "--json"])  # fmt: skip
    document, questions = Path(files["doc.txt"]).read_text(), ["What is the cat called?"]
    expected = generate_parallel(tiny_model("llama"), char_tokenizer(), document, questions, max_new_tokens=3)
    assert json.loads(capsys.readouterr().out) == {"questions": questions, "answers": expected}


# --------------------------------------------------------------------------- a tiny model: resume and bad lines


def test_a_finished_corpus_is_not_answered_again(monkeypatch, capsys, tmp_path):
    source, out = write_lines(tmp_path / "in.jsonl", CORPUS), tmp_path / "answers" / "out.jsonl"  # a new folder
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "2"])
    done = out.read_text()
    monkeypatch.setattr("hf_parallel.frontends.default_model.load_smollm2", None)  # not loaded again
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "2"])
    assert out.read_text() == done and "3 document(s) already answered" in capsys.readouterr().err


def test_bad_lines_become_error_lines_and_the_others_are_answered(monkeypatch, capsys, tmp_path):
    """As `hf-parallel batch` (and vLLM's run_batch): a bad line is reported and written as an error line, the run
    exits 0; a rerun finds every line done, error lines included, and loads no model."""
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    rows = [CORPUS[0], '{"id": "x", "document": ', {"document": "No questions.", "questions": []},
            {"id": "long", "document": "word " * 60, "questions": ["Why?"]}, CORPUS[2]]  # fmt: skip
    source, out = write_lines(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "2"])  # no SystemExit
    err = capsys.readouterr().err
    assert f"{source} line 2: not JSON (Expecting value: line 1 column 25 (char 24)); skipped" in err
    assert f"{source} line 3: the document has no questions; skipped" in err
    assert f"{source} line 4: question 0's prompt has" in err and "256 positions" in err  # the tiny model's
    assert "2 document(s), 3 question(s) answered in " in err
    assert "; 3 bad line(s) written as error lines (reported above); answers in " in err
    lines = answer_lines(out)
    assert [line["line"] for line in lines] == [1, 2, 3, 4, 5]
    errors = {line["line"]: line for line in lines if "error" in line}
    assert sorted(errors) == [2, 3, 4] and not any("answers" in line for line in errors.values())
    assert errors[3]["error"] == "the document has no questions" and errors[4]["id"] == "long"
    assert all(line["model"] == "SmolLM2-135M-Instruct" and "options" in line for line in lines)
    done = out.read_text()
    monkeypatch.setattr("hf_parallel.frontends.default_model.load_smollm2", None)  # not loaded again
    cli.main(["answer", "--corpus", str(source), "--out", str(out), "--max-new-tokens", "2"])
    assert out.read_text() == done
    assert "2 document(s) already answered in " in capsys.readouterr().err


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
    ("--out o.jsonl", "--out needs --corpus"),
    ("--document - --questions -", "only one of --document and --questions can be - (standard input)"),
    ("--document doc.txt --questions q.txt --corpus in.jsonl --out o.jsonl", "give either --document and"),
    ("", "give either --document and --questions, or --corpus (and --out)"),
    ("--corpus in.jsonl --json", "--json is for one document (--document); a corpus's output is JSON lines"),
    ("--corpus in.jsonl --force", "--force resumes an --out that another model or other options wrote: give --out"),
    ("--document doc.txt --questions q.txt --quiet --progress", "--quiet hides the progress bars that --progress"),
    ("--corpus missing.jsonl --out o.jsonl", "cannot read the corpus {missing.jsonl}: [Errno 2]"),
    ("--corpus empty.txt --out o.jsonl", "the corpus {empty.txt} is empty"),
    ("--corpus blank.jsonl --out o.jsonl", "the corpus {blank.jsonl} is empty"),
    ("--corpus none.jsonl --out o.jsonl", "no line of the corpus {none.jsonl} is a document with questions (line 1"),
    ("--corpus in.jsonl --out other.jsonl", "{other.jsonl} holds the answers of another corpus (its id 'cat' has"),
    ("--corpus in.jsonl --out broken.jsonl", "cannot resume from {broken.jsonl}: {broken.jsonl} line 2 is not an"),
    ("--corpus in.jsonl --sort", "--sort rewrites --out in input order: give --out"),
    ("--corpus in.jsonl --out o.jsonl --ray-actors 2", "--ray-actors needs --ray"),
    ("--corpus in.jsonl --ray", "--ray answers a corpus into a file or folder: give --corpus and --out"),
    ("--corpus in.jsonl --out o.jsonl --ray --device cuda:1", "--ray: each actor runs on the GPU Ray gives it"),
    ("--corpus in.jsonl --out o.jsonl --ray --ray-gpus-per-actor -1", "ray_gpus_per_actor must be >= 0, got -1.0"),
    ("--corpus missing.jsonl --out o.jsonl --ray", "cannot read the corpus {missing.jsonl}: no such file or folder"),
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


def test_the_defaults_the_flags_spell_out_are_the_librarys():
    """cli.answer spells these out so that --help loads no torch; they must stay the engine's own."""
    assert answer.ATTENTION[0] == "auto" and set(BACKENDS) <= set(answer.ATTENTION[1:])
    assert (answer.DEFAULT_MAX_NEW_TOKENS, answer.TOKENS_PER_CALL) == (DEFAULT_MAX_NEW_TOKENS, corpus.TOKENS_PER_CALL)
    from hf_parallel.ray.corpus import Cluster  # imports no ray itself

    assert answer.RAY_BATCH_SIZE == Cluster.batch_size


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
    module, name = (corpus, "stream_tokens") if mode == "corpus" else (prompting, "generate_tokens")
    generate = getattr(module, name)
    monkeypatch.setattr(module, name, lambda model, prompts, **o: seen.append(o) or generate(model, prompts, **o))
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
