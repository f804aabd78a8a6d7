"""`hf-parallel answer --corpus IN --out OUT --ray` on a local Ray cluster of two CPUs, started and stopped here, with
two actors of a tiny random-weight Llama: the lines one process writes, bad lines as error lines; an actor killed
mid-run restarted and its batch retried, every line once; a rerun answering only what OUT lacks; Parquet in and
out.  The actors run this checkout (the test checks it), and the stages of tests/helpers/ray_stages.py log what
they answer into a folder the cluster's workers are told of.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="--ray needs the ray extra: pip install -e '.[ray]'")

import hf_parallel.ray.corpus as on_ray  # noqa: E402
from hf_parallel import cli  # noqa: E402
from tests.helpers import ray_stages  # noqa: E402
from tests.helpers.char_tokenizers import char_tokenizer  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402
from tests.helpers.project import ROOT  # noqa: E402

NEW = 4
CORPUS = [
    {"id": "cat", "document": "The cat is named Tom. Tom lives in Paris.", "questions": ["What is it?", "Where?"]},
    {"document": "Everest is 8849 metres high.", "questions": ["How high?"]},
    {"id": 3, "document": "Water boils at 100 degrees.", "questions": ["When?", "Why?", "Who?"]},
    {"document": "Bob plays chess on sundays with his old friend Al.", "questions": ["What does Bob play?"]},
    {"id": "rain", "document": "Rain fell all day.", "questions": ["How long?"]},
    {"id": "sun", "document": "The sun rose at six.", "questions": ["When?", "What rose?"]},
    {"document": "Ann sings in a choir in Rome.", "questions": ["Who sings?"]},
    {"id": 9, "document": "The river is wide and slow.", "questions": ["How is the river?"]},
]  # fmt: skip
BAD = [
    "{not json",
    json.dumps({"id": "empty", "document": "A dog.", "questions": []}),
    json.dumps({"id": "cat", "document": "Again.", "questions": ["Why?"]}),  # a repeated id
    json.dumps({"id": "long", "document": "word " * 60, "questions": ["Why?"]}),  # past the model's 256 positions
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster of two CPUs, its own (address="local": never another one running here), stopped after
    the module; its workers import this checkout and know the stages' folder (HF_PARALLEL_TEST_RAY)."""
    folder = tmp_path_factory.mktemp("ray-stages")
    env = {"HF_PARALLEL_TEST_RAY": str(folder), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        where = ray.get(ray.remote(lambda: __import__("hf_parallel").__file__).remote())
        assert Path(where).is_relative_to(ROOT), f"the workers import {where}, not this checkout"
        yield folder
    finally:
        ray.shutdown()


@pytest.fixture
def stages(cluster):
    """The stages' folder, emptied for the test."""
    for file in cluster.iterdir():
        file.unlink()
    return cluster


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def single(tiny_dir, tmp_path_factory):
    """(corpus file with bad lines among the good, OUT of a one-process run of it), answered in this process."""
    folder = tmp_path_factory.mktemp("single")
    source = folder / "in.jsonl"
    lines = [json.dumps(r) for r in CORPUS]
    source.write_text("\n".join(lines[:2] + BAD[:2] + lines[2:5] + [""] + BAD[2:] + lines[5:]) + "\n")
    cli.main(_answer(source, folder / "out.jsonl", tiny_dir, ray=False))
    return source, (folder / "out.jsonl").read_text()


def _answer(source: Path, out: Path, model: Path, ray: bool = True, new: int = NEW) -> list[str]:
    argv = ["answer", "--corpus", str(source), "--out", str(out), "--model", str(model), "--max-new-tokens", str(new)]
    on_ray = ["--ray", "--ray-actors", "2", "--ray-batch-size", "2", "--ray-cpus-per-actor", "0.5"]
    return argv + (on_ray if ray else [])


def _sorted(text: str) -> list[str]:
    return sorted(text.splitlines())


def _folder_text(folder: Path) -> str:
    return "".join(file.read_text() for file in sorted(folder.iterdir()))


def test_the_lines_are_one_processs_and_bad_lines_error_lines(cluster, single, tiny_dir, tmp_path, monkeypatch,
                                                               capsys):  # fmt: skip
    source, expected = single
    assert len(expected.splitlines()) == len(CORPUS) + len(BAD) and expected.count('"error"') == len(BAD)
    out = tmp_path / "out.jsonl"
    cli.main([*_answer(source, out, tiny_dir), "--sort"])
    in_order = sorted(expected.splitlines(keepends=True), key=lambda line: json.loads(line)["line"])
    assert out.read_text() == "".join(in_order)  # --sort: one process's lines, in input order
    err = capsys.readouterr().err
    assert "line 3: not JSON" in err and "line 4: the document has no questions" in err
    asked = sum(len(r["questions"]) for r in CORPUS)
    assert f"{len(CORPUS)} document(s), {asked} question(s) answered" in err and f"{len(BAD)} bad line(s)" in err


def test_an_actor_killed_mid_run_is_restarted_and_every_line_written_once(stages, single, tiny_dir, tmp_path,
                                                                          monkeypatch):  # fmt: skip
    source, expected = single
    monkeypatch.setattr(on_ray, "Answerer", ray_stages.DyingAnswerer)
    out = tmp_path / "out"  # a folder: Ray's write tasks write its files
    cli.main(_answer(source, out, tiny_dir))
    assert (stages / "killed").exists()  # an actor died, after a batch of its own
    started = (stages / "actors.log").read_text().split()
    killed = (stages / "killed.log").read_text().split()
    assert len(started) >= 3 and killed[0] in started  # two actors, and the one killed again
    assert _sorted(_folder_text(out)) == _sorted(expected)  # every line once: none lost, none twice


def test_a_rerun_answers_only_what_out_lacks(stages, single, tiny_dir, tmp_path, monkeypatch, capsys):
    source, expected = single
    monkeypatch.setattr(on_ray, "Answerer", ray_stages.LoggingAnswerer)
    lines = expected.splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line).get("id") not in ("cat", 3, "sun")]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(kept) + lines[0][:25])  # and a line cut short by an interruption
    cli.main(_answer(source, out, tiny_dir))
    assert "5 document(s) already answered in" in capsys.readouterr().err  # and the 4 error lines
    answered = [json.loads(key).get("id") for key in (stages / "answered.log").read_text().splitlines()]
    assert sorted(map(str, answered)) == ["3", "cat", "sun"]
    text = out.read_text()
    assert text.startswith("".join(kept)) and _sorted(text) == _sorted(expected)
    (stages / "answered.log").unlink()
    cli.main(_answer(source, out, tiny_dir))  # all done: no document answered again
    assert not (stages / "answered.log").exists() and out.read_text() == text
    with pytest.raises(SystemExit) as stop:  # another run's options: refused before any work
        cli.main(_answer(source, out, tiny_dir, new=NEW + 1))
    assert stop.value.code == 2 and "max_new_tokens 4 there, 5 here" in capsys.readouterr().err


def test_parquet_in_and_out_resumed_from_its_folder(stages, single, tiny_dir, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, expected = single
    monkeypatch.setattr(on_ray, "Answerer", ray_stages.LoggingAnswerer)
    good = [{"id": str(r.get("id", f"d{i}")), "document": r["document"], "questions": r["questions"]}
            for i, r in enumerate(CORPUS)]  # fmt: skip
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(good), source)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    cli.main(_answer(tmp_path / "in.jsonl", tmp_path / "single.jsonl", tiny_dir, ray=False))
    one_process = [json.loads(line) for line in (tmp_path / "single.jsonl").read_text().splitlines()]
    out = tmp_path / "out.parquet"  # a folder of Parquet files
    cli.main(_answer(source, out, tiny_dir))
    rows = [{k: v for k, v in row.items() if v is not None} for row in pq.read_table(out).to_pylist()]
    assert sorted(rows, key=lambda row: row["line"]) == sorted(one_process, key=lambda row: row["line"])
    assert len((stages / "answered.log").read_text().splitlines()) == len(CORPUS)
    (stages / "answered.log").unlink()
    cli.main(_answer(source, out, tiny_dir))  # resumed from the folder: nothing left to answer
    assert not (stages / "answered.log").exists() and len(pq.read_table(out)) == len(CORPUS)
