"""Data parallelism over a corpus: documents split across the processes of `accelerate launch`, balanced
by prompt tokens; the output exactly as one process writes it, and a rerun with any number of processes
resumes from the output and the part files an interrupted run left.

The launches run on the CPU, two processes of a tiny random-weight Llama saved with its tokenizer.
`accelerate launch --cpu --num_processes 2` starts a single process (accelerate runs several CPU
processes only through mpirun), so the launches use its torchrun launcher, `--multi_gpu`, with no
CUDA device visible: each process then runs on the CPU (gloo).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import hf_parallel.frontends.corpus as corpus
from hf_parallel import cli
from hf_parallel.decoding.inputs import eos_token_ids
from hf_parallel.frontends.corpus import answer_key, read_json_lines
from hf_parallel.frontends.data_parallel import balanced_split, merge_parts, part_files, part_path
from hf_parallel.frontends.prompting import render_prompts
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.models import generate_alone, tiny_model
from tests.helpers.project import ROOT

NEW = 4
CORPUS = [
    {"id": "cat", "document": "The cat is named Tom. Tom lives in Paris.", "questions": ["What is it?", "Where?"]},
    {"document": "Everest is 8849 metres high.", "questions": ["How high?"]},
    {"id": 3, "document": "Water boils at 100 degrees.", "questions": ["When?", "Why?", "Who?"]},
    {"document": "Bob plays chess on sundays with his old friend Al.", "questions": ["What does Bob play?"]},
    {"document": "Rain fell all day.", "questions": ["How long?"]},
]  # fmt: skip


# --------------------------------------------------------------------------- the balanced split


def _check_split(weights: list[int], parts: int) -> None:
    shares = balanced_split(weights, parts)
    assert len(shares) == parts and [i for share in shares for i in share] == list(range(len(weights)))
    ideal, largest = sum(weights) / parts, max(weights, default=0)
    for share in shares:  # each share within the largest document of its fair part
        assert abs(sum(weights[i] for i in share) - ideal) <= largest
    assert balanced_split(list(weights), parts) == shares  # every rank computes the same split


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("seed", range(20))
def test_the_split_covers_each_document_once_in_order_and_balanced(seed, parts):
    rng = random.Random(seed)
    weights = [rng.choice([1, 5, 40, 300]) * rng.randint(1, 9) for _ in range(rng.randint(0, 30))]
    _check_split(weights, parts)


@pytest.mark.parametrize("weights, parts, expected", [
    ([], 2, [range(0, 0), range(0, 0)]),  # no documents: every share empty
    ([7], 3, [range(0, 0), range(0, 1), range(1, 1)]),  # fewer documents than processes
    ([5, 5, 5, 5], 2, [range(0, 2), range(2, 4)]),
    ([100, 1, 1, 1, 1], 2, [range(0, 1), range(1, 5)]),  # one large document takes a share alone
    ([1, 1, 1, 1, 100], 2, [range(0, 4), range(4, 5)]),
    ([3, 1, 2], 1, [range(0, 3)]),  # one process: everything, as without accelerate
])  # fmt: skip
def test_the_split_at_its_edges(weights, parts, expected):
    assert balanced_split(weights, parts) == expected
    _check_split(weights, parts)


def test_the_split_needs_a_process():
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        balanced_split([1, 2], 0)


# --------------------------------------------------------------------------- part files


def _write(path: Path, lines: list, tail: str = "") -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines) + tail)
    return path


def test_parts_are_merged_in_order_once_and_removed(tmp_path):
    out = _write(tmp_path / "out.jsonl", [{"line": 1, "a": "x"}])
    _write(part_path(out, 1), [{"line": 4, "a": "y"}, {"line": 1, "a": "x"}], tail='{"line": 5, "a"')  # cut short
    _write(part_path(out, 0), [{"line": 3, "a": "z"}, "not json", {"line": 2, "a": "w"}])
    _write(part_path(out, 12), [{"line": 6, "a": "v"}])  # a part of a run with more processes
    (tmp_path / "out.jsonl.part-x").write_text("not a part\n")
    (tmp_path / "other.jsonl.part-0").write_text("another output's part\n")
    assert part_files(out) == [part_path(out, 0), part_path(out, 1), part_path(out, 12)]
    merge_parts(out, lambda line: line["line"], lambda line: line["line"])
    assert [line["line"] for line in read_json_lines(out)] == [1, 2, 3, 4, 6]
    assert part_files(out) == [] and (tmp_path / "out.jsonl.part-x").exists()
    before = out.read_text()
    merge_parts(out, lambda line: line["line"], lambda line: line["line"])  # no parts: nothing to do
    assert out.read_text() == before and part_files(tmp_path / "absent" / "out.jsonl") == []


# --------------------------------------------------------------------------- the command line, launched


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random-weight Llama and a character tokenizer, saved as `--model DIR` loads them."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def single(tiny_dir, tmp_path_factory):
    """(corpus file, the out.jsonl text of a plain one-process run), answered in this process."""
    folder = tmp_path_factory.mktemp("single")
    source = _write(folder / "in.jsonl", CORPUS)
    cli.main(_answer(source, folder / "out.jsonl", tiny_dir))
    return source, (folder / "out.jsonl").read_text()


def _answer(source: Path, out: Path, model: Path) -> list[str]:
    return ["answer", "--corpus", str(source), "--out", str(out), "--model", str(model), "--max-new-tokens", str(NEW)]


def launch(args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    """`accelerate launch` of `python -m hf_parallel ARGS` (or a script) on `processes` CPU processes."""
    with socket.socket() as probe:  # a free port for the processes' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), *args]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_two_processes_write_what_one_writes_and_what_generate_answers(single, tiny_dir, tmp_path):
    source, expected = single
    out = tmp_path / "out.jsonl"
    done = launch(["-m", "hf_parallel", *_answer(source, out, tiny_dir)])
    assert "process 0 of 2 on cpu" in done.stderr and "process 1 of 2 on cpu" in done.stderr  # two, each on the CPU
    assert out.read_text() == expected and part_files(out) == []
    model, tokenizer = _loaded(tiny_dir)
    for record, line in zip(CORPUS, read_json_lines(out)):
        prompts = render_prompts(tokenizer, record["document"], record["questions"])
        alone = [generate_alone(model, p, NEW, eos_token_ids(model, tokenizer)) for p in prompts]
        assert line["answers"] == [tokenizer.decode(t, skip_special_tokens=True).strip() for t in alone]


def _loaded(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def _interrupted(expected: str, out: Path) -> list[dict]:
    """What an interrupted two-process run leaves: documents 1 and 4 in the parts, one line cut short."""
    lines = [json.loads(line) for line in expected.splitlines()]
    _write(part_path(out, 0), [lines[0]])
    _write(part_path(out, 1), [lines[3]], tail=json.dumps(lines[4])[:20])
    return lines


def test_one_process_resumes_from_the_parts_of_two(single, tiny_dir, tmp_path, monkeypatch, capsys):
    source, expected = single
    out = tmp_path / "out.jsonl"
    _interrupted(expected, out)
    asked, generate = [], corpus.stream_tokens
    monkeypatch.setattr(corpus, "stream_tokens", lambda model, prompts, **o: asked.extend(prompts) or
                        generate(model, prompts, **o))  # fmt: skip
    cli.main(_answer(source, out, tiny_dir))
    assert "2 document(s) already answered" in capsys.readouterr().err
    assert len(asked) == 3 + 1 + 1  # documents 2, 3 and 5 only
    assert out.read_text() == expected and part_files(out) == []


def test_two_processes_resume_from_the_output_and_the_parts(single, tiny_dir, tmp_path):
    source, expected = single
    out = tmp_path / "out.jsonl"
    lines = _interrupted(expected, out)
    _write(out, [lines[0]], tail='{"line": 2, "quest')  # a merge cut short: document 1 in out and in a part
    done = launch(["-m", "hf_parallel", *_answer(source, out, tiny_dir)])
    assert "2 document(s) already answered" in done.stderr and done.stderr.count("already answered") == 1
    assert out.read_text() == expected and part_files(out) == []


# --------------------------------------------------------------------------- answer_dataset, launched

DATASET_SCRIPT = """
import json, sys
import datasets
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer
from hf_parallel.frontends.datasets import answer_dataset

folder, rows, checkpoint, out, new = sys.argv[1:]
state = PartialState(cpu=True)  # a CPU-only host: without it each process would think it runs alone
model = AutoModelForCausalLM.from_pretrained(folder, device_map=state.device).eval()
dataset = datasets.Dataset.from_list(json.load(open(rows)))
answered = answer_dataset(model, AutoTokenizer.from_pretrained(folder), dataset, checkpoint=checkpoint,
                          tokens_per_call=1, max_new_tokens=int(new))
with open(f"{out}.{state.process_index}", "w") as f:
    json.dump(answered.to_list(), f)
"""


def _dataset_rows() -> list[dict]:
    return [{"context": r["document"], "question": q, "id": f"{i}.{j}"} for i, r in enumerate(CORPUS)
            for j, q in enumerate(r["questions"])]  # fmt: skip


def test_answer_dataset_on_two_processes_resumes_and_returns_the_whole_dataset(tiny_dir, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the datasets integration needs `pip install datasets`")
    from hf_parallel.frontends.datasets import answer_dataset

    model, tokenizer = _loaded(tiny_dir)
    dataset = datasets.Dataset.from_list(_dataset_rows())
    whole = answer_dataset(model, tokenizer, dataset, max_new_tokens=NEW).to_list()
    checkpoint, generate = tmp_path / "checkpoint.jsonl", corpus.stream_tokens

    def interrupted(model, prompts, **options):  # one process answers one document, then is interrupted
        if interrupted.calls == 1:
            raise KeyboardInterrupt
        interrupted.calls += 1
        return generate(model, prompts, **options)

    interrupted.calls = 0
    monkeypatch.setattr(corpus, "stream_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        answer_dataset(model, tokenizer, dataset, checkpoint=checkpoint, tokens_per_call=1, max_new_tokens=NEW)
    header, *done = checkpoint.read_text().splitlines(keepends=True)
    checkpoint.write_text(header)  # as if a process of an earlier launch had answered document 0 in its part
    part_path(checkpoint, 1).write_text("".join(done))
    (tmp_path / "rows.json").write_text(json.dumps(_dataset_rows()))
    (tmp_path / "run.py").write_text(DATASET_SCRIPT)
    launch([str(tmp_path / "run.py"), str(tiny_dir), str(tmp_path / "rows.json"), str(checkpoint),
            str(tmp_path / "answered"), str(NEW)])  # fmt: skip
    for rank in (0, 1):  # every process gets the whole dataset
        assert json.loads((tmp_path / f"answered.{rank}").read_text()) == whole
    assert part_files(checkpoint) == []
    assert sorted(line["row"] for line in read_json_lines(checkpoint)[1:]) == [0, 2, 3, 6, 7]  # first rows
    monkeypatch.setattr(corpus, "stream_tokens", None)  # all from the checkpoint now
    again = answer_dataset(model, tokenizer, dataset, checkpoint=checkpoint, tokens_per_call=1, max_new_tokens=NEW)
    assert again.to_list() == whole


def test_answer_keys_order_the_merge_by_line(tmp_path):
    out = _write(tmp_path / "out.jsonl", [])
    _write(part_path(out, 0), [{"line": 2, "id": "b", "questions": [], "answers": []}])
    _write(part_path(out, 1), [{"line": 1, "questions": [], "answers": []}])
    merge_parts(out, answer_key, lambda line: line["line"])
    assert [line["line"] for line in read_json_lines(out)] == [1, 2]


def test_sort_rewrites_one_processs_output_in_input_order(single, tiny_dir, tmp_path):
    source, expected = single
    out = tmp_path / "out.jsonl"
    lines = expected.splitlines(keepends=True)
    out.write_text("".join(reversed(lines)))  # as documents finish, last first
    cli.main([*_answer(source, out, tiny_dir), "--sort"])  # nothing left to answer: only the sort
    assert out.read_text() == "".join(sorted(lines, key=lambda line: json.loads(line)["line"]))
    assert not (tmp_path / "out.jsonl.sorting").exists()
