"""How the command line ends when it cannot go on: Ctrl-C (one line saying what was saved, exit status 130),
and a --model that leads nowhere (one line naming the cause at once, exit status 2; the hub never asked)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from unittest.mock import Mock

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import RepositoryNotFoundError

import hf_parallel.frontends.corpus as corpus
import hf_parallel.frontends.prompting as prompting
from hf_parallel import cli, generate_parallel
from hf_parallel.evaluation import quality
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.cli import CORPUS, load_as_smollm2, usage_error, write_lines
from tests.helpers.models import tiny_model

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the hub cache names snapshots


def interrupted(capsys, argv: list[str]) -> list[str]:
    """`hf-parallel argv` in-process; checks it exits with status 130 and returns its stderr's lines."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 130
    return capsys.readouterr().err.splitlines()


def files(tmp_path: Path) -> list[str]:
    (tmp_path / "doc.txt").write_text(CORPUS[0]["document"])
    (tmp_path / "q.txt").write_text("\n".join(CORPUS[0]["questions"]))
    return ["--document", str(tmp_path / "doc.txt"), "--questions", str(tmp_path / "q.txt")]


def ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_answering_one_document_says_nothing_was_saved(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    monkeypatch.setattr(prompting, "generate_tokens", ctrl_c)
    err = interrupted(capsys, ["answer", *files(tmp_path), "--max-new-tokens", "2"])
    assert err == ["hf-parallel answer: interrupted; nothing was saved (the answers are printed once all are done)"]


def test_ctrl_c_answering_a_corpus_says_what_out_holds_and_the_same_command_resumes(monkeypatch, capsys, tmp_path):
    load_as_smollm2(monkeypatch, (tiny_model("llama"), char_tokenizer()))
    source, out, whole = write_lines(tmp_path / "in.jsonl", CORPUS), tmp_path / "out.jsonl", tmp_path / "whole.jsonl"
    argv = ["answer", "--corpus", str(source), "--tokens-per-call", "1", "--max-new-tokens", "2", "--out"]
    cli.main([*argv, str(whole)])
    stream, calls = corpus.stream_tokens, []

    def second_call_interrupted(model, prompts, **options):  # one document per call: the second is cut
        calls.append(prompts)
        return ctrl_c() if len(calls) == 2 else stream(model, prompts, **options)

    monkeypatch.setattr(corpus, "stream_tokens", second_call_interrupted)
    capsys.readouterr()
    err = interrupted(capsys, [*argv, str(out)])
    assert err == [
        f"hf-parallel answer: interrupted; {out} holds the answers of 1 document(s), 1 of them from this run; run the "
        "same command again to answer the rest"
    ]
    monkeypatch.setattr(corpus, "stream_tokens", stream)
    cli.main([*argv, str(out)])
    assert out.read_text() == whole.read_text()


def test_ctrl_c_in_eval_names_the_checkpoint_to_resume_from(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(quality, "evaluate_quality", ctrl_c)
    err = interrupted(capsys, ["eval", "--checkpoint", str(tmp_path / "run.jsonl")])
    assert err == [
        f"hf-parallel eval: interrupted; the finished generate calls are in {tmp_path / 'run.jsonl'}; run the same "
        "command again to resume"
    ]
    assert interrupted(capsys, ["eval"]) == [
        "hf-parallel eval: interrupted; nothing was saved (with --checkpoint FILE, a run started again resumes)"
    ]


def test_ctrl_c_in_the_demo(monkeypatch, capsys):
    monkeypatch.setattr("hf_parallel.frontends.demo.run", ctrl_c)
    assert interrupted(capsys, ["demo"]) == ["hf-parallel demo: interrupted; the demo saves nothing"]


# --------------------------------------------------------------------------- --model: where it points


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache, and a hub that fails the test if it is asked."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub, "model_info", Mock(side_effect=AssertionError("the hub was asked")))
    return tmp_path / "hub-cache"


def online(monkeypatch, hub_answer: Exception) -> Mock:
    """HF_HUB_OFFLINE unset, and a hub that answers `model_info` with `hub_answer`; the mock, to check the call."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    asked = Mock(side_effect=hub_answer)
    monkeypatch.setattr(huggingface_hub, "model_info", asked)
    return asked


def cache(folder: Path, repo_id: str) -> None:
    """The tiny Llama and its tokenizer in `folder`, a hub cache, as `repo_id` (as a download leaves it)."""
    repo = folder / f"models--{repo_id.replace('/', '--')}"
    tiny_model("llama").save_pretrained(repo / "snapshots" / SNAPSHOT)
    char_tokenizer().save_pretrained(repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)


def model_error(capsys, tmp_path, model: str) -> str:
    """The usage error of `answer --model MODEL`, checked to come at once; its message."""
    start = time.perf_counter()
    err = usage_error(capsys, ["answer", *files(tmp_path), "--model", model])
    assert time.perf_counter() - start < 5 and err.count("\n") == 1
    return err.removeprefix("hf-parallel answer: error: ").strip()


@pytest.mark.parametrize("model", ["./no-such-model", "../models/none", "~/no-such-model", "a/b/c", "/no/such/dir"])
def test_a_path_that_does_not_exist_is_no_such_directory(capsys, tmp_path, no_model, hub, model):
    assert model_error(capsys, tmp_path, model) == f"no such directory: {model}"


def test_a_file_or_a_folder_without_a_config_is_no_model(capsys, tmp_path, hub):
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    assert model_error(capsys, tmp_path, str(tmp_path / "weights.bin")).endswith(
        "is a file; --model takes a model directory or a hub id"
    )
    assert model_error(capsys, tmp_path, str(tmp_path / "empty")).endswith(
        "has no config.json; --model takes a directory that save_pretrained wrote"
    )


def test_offline_a_hub_id_outside_the_cache_is_refused_without_asking_the_hub(monkeypatch, capsys, tmp_path, hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_error(capsys, tmp_path, "someorg/somemodel") == (
        f"someorg/somemodel is not a directory, and as a hub id it is not in the local Hugging Face cache ({hub}); "
        "HF_HUB_OFFLINE=1 keeps the hub from being asked"
    )


@pytest.mark.parametrize(
    "answer, cause",
    [
        (ConnectionError("no route to host"), "the hub cannot be reached (ConnectionError: no route to host)"),
        (
            RepositoryNotFoundError("404 Repository Not Found", response=Mock(status_code=404, headers={})),
            "it is neither on the hub nor in the local cache (a private or gated model needs `hf auth login`)",
        ),
    ],
)
def test_online_a_hub_id_is_asked_once_with_a_short_timeout(monkeypatch, capsys, tmp_path, hub, answer, cause):
    asked = online(monkeypatch, answer)
    message = model_error(capsys, tmp_path, "someorg/somemodel")
    assert message.startswith(f"someorg/somemodel is not a directory, and as a hub id {cause}")
    asked.assert_called_once_with("someorg/somemodel", timeout=5.0)


@pytest.mark.parametrize("offline", [True, False])
def test_a_cached_hub_id_loads_from_the_cache_offline_or_when_the_hub_is_unreachable(
    monkeypatch, capsys, tmp_path, hub, offline
):
    cache(hub, "tiny/llama")
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        online(monkeypatch, ConnectionError("no route to host"))
    cli.main(["answer", *files(tmp_path), "--model", "tiny/llama", "--max-new-tokens", "3", "--device", "cpu"])
    answers = generate_parallel(
        tiny_model("llama"), char_tokenizer(), CORPUS[0]["document"], CORPUS[0]["questions"], max_new_tokens=3
    )
    assert capsys.readouterr().out == "".join(f"Q: {q}\nA: {a}\n\n" for q, a in zip(CORPUS[0]["questions"], answers))


def test_eval_model_that_leads_nowhere(capsys, no_model, hub, tmp_path):
    qa = {"id": "a", "question": "Who sat?", "answers": [{"text": "cat", "answer_start": 2}]}
    data = tmp_path / "squad.json"  # the data is read first: this run's must be there, with or without ../shared
    data.write_text(json.dumps({"data": [{"title": "T", "paragraphs": [{"context": "A cat sat.", "qas": [qa]}]}]}))
    err = usage_error(capsys, ["eval", "--model", "./no-such-model", "--data", str(data), "--limit", "2"])
    assert err == "hf-parallel eval: error: no such directory: ./no-such-model\n"


# --------------------------------------------------------------------------- devices and attention paths


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_where_there_is_none(capsys, tmp_path, no_model):
    err = usage_error(capsys, ["answer", *files(tmp_path), "--device", "cuda:1"])
    assert (
        err == "hf-parallel answer: error: the device cuda:1 is not there: torch sees no CUDA device on this machine\n"
    )


def test_triton_attention_on_the_cpu(monkeypatch, capsys, tmp_path, no_model):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests run Triton under its interpreter on the CPU
    err = usage_error(capsys, ["answer", *files(tmp_path), "--device", "cpu", "--attn", "triton"])
    assert err == "hf-parallel answer: error: --attn triton runs on CUDA; on the CPU, pass --attn reference (or auto)\n"
