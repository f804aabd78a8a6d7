"""The answer-quality runner: bootstrap CI, prompts, post-processing, config, and end to end on a tiny model."""

from __future__ import annotations

import gzip
import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_parallel.cli.evaluate import main, parse_config
from hf_parallel.evaluation.config import QualityConfig, add_arguments
from hf_parallel.evaluation.loaders import load_quac
from hf_parallel.evaluation.methods import StopAtString
from hf_parallel.evaluation.metrics import squad_f1
from hf_parallel.evaluation.prompts import postprocess, question_prompts
from hf_parallel.evaluation.quality import evaluate_quality
from hf_parallel.evaluation.report import merge_reports, paired_bootstrap, read_report
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.models import tiny_model


def _squad_fixture(tmp_path):
    def qa(qid, question, answer):
        return {"id": qid, "question": question, "answers": [{"text": answer, "answer_start": 0}]}

    data = {"data": [{"title": "T", "paragraphs": [
        {"context": "The cat sat on the mat in 1999.", "qas": [
            qa("a", "Where did the cat sit?", "on the mat"), qa("b", "When?", "1999"), qa("c", "Who sat?", "cat")]},
        {"context": "Rain fell on Paris all day.", "qas": [qa("d", "Where did rain fall?", "Paris"),
                                                           qa("e", "How long?", "all day")]},
        {"context": "Bob plays chess.", "qas": [qa("f", "What does Bob play?", "chess")]},
    ]}]}  # fmt: skip
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(data))
    return path


def _quac_fixture(tmp_path):
    def qa(qid, question, answer):
        return {"id": qid, "question": question, "answers": [{"text": answer, "answer_start": 0}] * 2,
                "orig_answer": {"text": answer, "answer_start": 0}}  # fmt: skip

    data = {"data": [{"paragraphs": [
        {"id": "D1", "context": "Ann, born in Rome, moved to Oslo. CANNOTANSWER", "qas": [
            qa("D1#0", "Born where?", "in Rome"), qa("D1#1", "Pets?", "CANNOTANSWER"),
            qa("D1#2", "Moved where?", "Oslo")]},
        {"id": "D2", "context": "Tom sings. CANNOTANSWER", "qas": [qa("D2#0", "What does Tom do?", "sings")]},
    ]}]}  # fmt: skip
    path = tmp_path / "quac.json"
    path.write_text(json.dumps(data))
    return path


def _tiny(arch):
    """A tiny random model for character prompts, which run past its 256 positions; rotary
    embeddings are computed per position, so the limit is only the config's number."""
    model = tiny_model(arch)
    model.config.max_position_embeddings = 1024
    return model


# --------------------------------------------------------------------------- bootstrap


def test_bootstrap_of_identical_scores_is_zero():
    base = np.random.default_rng(1).random(300)
    assert paired_bootstrap(base, base.copy(), resamples=1000) == {"mean": 0.0, "lo": 0.0, "hi": 0.0,
                                                                    "resamples": 1000}  # fmt: skip


def test_bootstrap_ci_excludes_zero_under_a_shift_and_covers_it_without_one():
    rng = np.random.default_rng(2)
    base = rng.random(400)
    shifted = paired_bootstrap(base, base + 0.05 + rng.normal(0, 0.1, 400), resamples=2000, seed=3)
    assert 0 < shifted["lo"] < 0.05 < shifted["hi"]
    noise = paired_bootstrap(base, base + rng.normal(0, 0.1, 400) - 0.0, resamples=2000, seed=3)
    assert noise["lo"] < 0 < noise["hi"] or abs(noise["mean"]) > 2 * (noise["hi"] - noise["lo"])
    assert paired_bootstrap(base, base + 0.01, seed=3) == paired_bootstrap(base, base + 0.01, seed=3)


@pytest.mark.parametrize("n", [50, 2000])
def test_bootstrap_ci_width_matches_the_standard_error(n):
    diff = np.random.default_rng(n).normal(0, 0.3, n)
    ci = paired_bootstrap(np.zeros(n), diff, resamples=4000)
    expected = 2 * 1.96 * diff.std() / np.sqrt(n)  # normal approximation of the mean's 95% interval
    assert ci["hi"] - ci["lo"] == pytest.approx(expected, rel=0.1)
    assert ci["lo"] < ci["mean"] < ci["hi"] and ci["mean"] == pytest.approx(diff.mean())


# --------------------------------------------------------------------------- prompts and answers


@pytest.mark.parametrize("chat", [True, False])
def test_quac_turn_prompts_extend_each_other_as_tokens(tmp_path, chat):
    tokenizer = char_tokenizer(chat)
    (dialogue, _) = load_quac(_quac_fixture(tmp_path))
    prompts = question_prompts(tokenizer, "quac", dialogue)
    for shorter, longer in zip(prompts, prompts[1:]):
        assert len(shorter) < len(longer) and longer[: len(shorter)] == shorter
    last = tokenizer.decode(prompts[-1])
    assert "born where?" in last and "in rome" in last and "i cannot answer" in last  # history, abstention
    assert last.count("ann, born in rome") == 1 and "cannotanswer" not in last  # the document once, marker gone


def test_squad_prompts_share_the_document_and_end_with_the_question():
    tokenizer = char_tokenizer()
    document = type("Doc", (), {"text": "Some text.", "items": [type("I", (), {"question": q}) for q in "ab"]})
    first, second = question_prompts(tokenizer, "squad", document)
    assert tokenizer.decode(first).endswith("question: a<|im_end|>\n<|im_start|>assistant\n")
    assert first[:-20] == second[:-20]


@pytest.mark.parametrize("text, dataset, expected", [
    ("  Denver Broncos\nThey won.", "squad", "Denver Broncos"),
    ("\n\nParis.  ", "drop", "Paris."),
    ("I cannot answer that.", "quac", "CANNOTANSWER"),
    ("I can't answer", "quac", "CANNOTANSWER"),
    ("The text does not say.", "quac", "CANNOTANSWER"),
    ('"Unknown"', "quac", "CANNOTANSWER"),
    ("I cannot answer that.", "squad", "I cannot answer that."),
    ("Unknowns of the war", "quac", "Unknowns of the war"),
    ("She cannot answer the phone", "quac", "She cannot answer the phone"),
])  # fmt: skip
def test_postprocess_is_first_line_and_maps_quac_abstentions(text, dataset, expected):
    assert postprocess(text, dataset) == expected


# --------------------------------------------------------------------------- configuration


def test_every_config_field_has_exactly_one_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert set(vars(parser.parse_args([]))) == {f.name for f in fields(QualityConfig)}
    config = parse_config(["--dataset", "drop", "--methods", "parallel", "standard", "--limit", "5",
                           "--standard-batch-size", "4", "--docs-per-call", "3", "--dtype", "bfloat16"])  # fmt: skip
    assert (config.dataset, config.methods, config.limit) == ("drop", ("parallel", "standard"), 5)
    assert (config.standard_batch_size, config.docs_per_call, config.dtype) == (4, 3, "bfloat16")
    assert config.data.endswith("drop-dev.jsonl.gz")


@pytest.mark.parametrize("bad, match", [
    (dict(dataset="nq"), "dataset"), (dict(dataset="quac"), "offline"), (dict(methods=("greedy",)), "methods"),
    (dict(methods=()), "methods"), (dict(limit=0), "limit"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(standard_batch_size=0), "standard_batch_size"), (dict(batch_rows=0), "batch_rows"),
    (dict(dtype="int8"), "dtype"), (dict(device="tpu"), "device"),
])  # fmt: skip
def test_config_refuses_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        QualityConfig(**bad)


# --------------------------------------------------------------------------- end to end


def _check_report(report, n_questions):
    assert report["n_questions"] == len(report["questions"]) == n_questions
    parallel = report["summary"]["parallel"]
    assert parallel["differ_from_standard"] == 0  # fp32 greedy: token-identical to one at a time
    assert parallel["f1_minus_standard"]["lo"] == parallel["f1_minus_standard"]["hi"] == 0.0
    for record in report["questions"]:
        assert record["raw"]["parallel"] == record["raw"]["standard"]
        assert set(record["predictions"]) == {"standard", "parallel", "batch"}


def test_runner_end_to_end_on_a_tiny_model(tmp_path):
    model, tokenizer = _tiny("llama"), char_tokenizer()
    out = tmp_path / "out" / "squad.json"
    config = QualityConfig(data=str(_squad_fixture(tmp_path)), max_new_tokens=5, docs_per_call=2, out=str(out),
                           resamples=200)  # fmt: skip
    report = evaluate_quality(config, model, tokenizer)
    _check_report(report, 6)
    assert json.loads(out.read_text())["summary"] == report["summary"]
    table = out.with_suffix(".md").read_text()
    assert "| parallel |" in table and "| batch |" in table and "0/6" in table
    for record in report["questions"]:
        assert record["predictions"]["standard"] == record["raw"]["standard"].strip().split("\n")[0].strip()
        assert record["scores"]["batch"]["f1"] == squad_f1(record["predictions"]["batch"], record["answers"])
    assert [r["id"] for r in report["questions"]] == list("abcdef")
    limited = evaluate_quality(
        QualityConfig(data=config.data, max_new_tokens=5, limit=4, methods=("parallel", "standard")), model, tokenizer
    )
    assert [r["predictions"]["parallel"] for r in limited["questions"]] == [
        r["predictions"]["parallel"] for r in report["questions"][:4]
    ]  # same answers one document per call


def test_runner_on_quac_dialogues_and_batched_standard(tmp_path):
    model, tokenizer = _tiny("qwen2"), char_tokenizer()
    config = QualityConfig(dataset="quac", data=str(_quac_fixture(tmp_path)), max_new_tokens=4,
                           standard_batch_size=3, resamples=100)  # fmt: skip
    report = evaluate_quality(config, model, tokenizer)
    assert report["n_questions"] == 4 and report["n_documents"] == 2
    summary = report["summary"]["standard"]
    assert summary["em"] is None and {"heq_q", "heq_d", "human_f1"} <= set(summary)
    one_at_a_time = evaluate_quality(QualityConfig(**{**config.__dict__, "standard_batch_size": 1}), model, tokenizer)
    _check_report(one_at_a_time, 4)


def test_stop_at_string_stops_each_row_at_its_own_string():
    tokenizer = char_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = encode("a2: the prompt does not count ")
    rows = torch.tensor([prompt + encode("a1: x a2:"), prompt + encode("a1: x a2:"), prompt + encode("a1: a3: y")])
    stop = StopAtString(tokenizer, ["a2:", "a3:", "a3:"], len(prompt))
    assert stop(rows, None).tolist() == [True, False, True]
    assert StopAtString(tokenizer, ["a2:"], len(prompt))(torch.tensor([prompt + encode("a1")]), None).tolist() == [
        False
    ]


def test_batch_prompting_rows_batched_give_the_same_outputs(tmp_path):
    model, tokenizer = _tiny("llama"), char_tokenizer(chat=False)
    config = QualityConfig(data=str(_squad_fixture(tmp_path)), max_new_tokens=6, methods=("batch",), resamples=50)
    alone = evaluate_quality(config, model, tokenizer)
    batched = evaluate_quality(QualityConfig(**{**config.__dict__, "batch_rows": 2}), model, tokenizer)
    assert batched["batch_outputs"] == alone["batch_outputs"]
    assert [len(t) for t in alone["batch_outputs"]] != [0, 0, 0]


def test_reports_of_separate_runs_merge_into_the_report_of_one_run(tmp_path):
    model, tokenizer = _tiny("llama"), char_tokenizer()
    config = QualityConfig(data=str(_squad_fixture(tmp_path)), max_new_tokens=5, docs_per_call=2, resamples=200)
    whole = evaluate_quality(config, model, tokenizer)
    parts = [evaluate_quality(QualityConfig(**{**config.__dict__, "methods": methods}), model, tokenizer)
             for methods in (("batch",), ("standard", "parallel"))]  # fmt: skip
    path = tmp_path / "part.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(parts[0], f)
    merged = merge_reports([read_report(path), parts[1]])
    assert list(merged["summary"]) == ["standard", "parallel", "batch"]
    for m, row in whole["summary"].items():
        got = merged["summary"][m]
        timing = ("wall_s", "speedup")
        assert {k: v for k, v in got.items() if k not in timing} == {k: v for k, v in row.items() if k not in timing}
        assert got["wall_s"] == next(p["summary"][m]["wall_s"] for p in parts if m in p["summary"])
    assert [q["predictions"] for q in merged["questions"]] == [q["predictions"] for q in whole["questions"]]
    assert merged["batch_outputs"] == whole["batch_outputs"]
    with pytest.raises(ValueError, match="more than one report"):
        merge_reports([whole, parts[0]])
    other = evaluate_quality(QualityConfig(**{**config.__dict__, "methods": ("batch",), "limit": 3}), model, tokenizer)
    with pytest.raises(ValueError, match="different questions"):
        merge_reports([parts[1], other])
    main(["merge", str(path), "--out", str(tmp_path / "merged.json")])  # the command line
    assert "| batch |" in (tmp_path / "merged.md").read_text()


def test_an_interrupted_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A run cut after some generate calls, run again with its checkpoint, runs only the other calls and gives the
    uninterrupted run's answers; a line cut short is ignored; another run's checkpoint is refused."""
    import hf_parallel.evaluation.methods as methods

    model, tokenizer = _tiny("llama"), char_tokenizer()
    config = QualityConfig(data=str(_squad_fixture(tmp_path)), max_new_tokens=5, resamples=50,
                           checkpoint=str(tmp_path / "run.jsonl"))  # fmt: skip
    whole = evaluate_quality(QualityConfig(**{**config.__dict__, "checkpoint": None}), model, tokenizer)
    real_tokens = methods.generate_tokens

    def interrupted(*args, **kwargs):  # the parallel method's second call never finishes
        if sum('"parallel"' in line for line in Path(config.checkpoint).read_text().splitlines()) == 1:
            raise KeyboardInterrupt
        return real_tokens(*args, **kwargs)

    monkeypatch.setattr(methods, "generate_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate_quality(config, model, tokenizer)
    standard_calls = whole["run_calls"]["standard"]  # one per question: the standard method finished
    with open(config.checkpoint, "a") as f:
        f.write('{"method": "parallel", "call": 1, "indi')  # a line cut short by the interruption
    monkeypatch.setattr(methods, "generate_tokens", real_tokens)
    resumed = evaluate_quality(config, model, tokenizer)
    assert resumed["resumed_calls"] == {"standard": standard_calls, "parallel": 1, "batch": 0}
    # the parallel method's and batch prompting's calls are one per document (3): the rest of them ran
    assert resumed["run_calls"] == {"standard": 0, "parallel": 3 - 1, "batch": 3}
    assert [q["raw"] for q in resumed["questions"]] == [q["raw"] for q in whole["questions"]]
    assert resumed["batch_outputs"] == whole["batch_outputs"]
    again = evaluate_quality(config, model, tokenizer)  # every call in the checkpoint now: nothing runs, same report
    assert again["run_calls"] == {"standard": 0, "parallel": 0, "batch": 0} and again["summary"] == resumed["summary"]
    with pytest.raises(ValueError, match="checkpoint of another run"):
        evaluate_quality(QualityConfig(**{**config.__dict__, "max_new_tokens": 4}), model, tokenizer)


@pytest.mark.slow
def test_smollm2_squad_end_to_end(smollm2, tmp_path):
    model, tokenizer = smollm2
    config = QualityConfig(limit=6, max_new_tokens=16, out=str(tmp_path / "squad.json"), resamples=200)
    if not Path(config.data).exists():
        pytest.skip(f"offline copy {config.data} is absent (only this project's machines have ../shared/data)")
    report = evaluate_quality(config, model, tokenizer)
    _check_report(report, 6)
    assert report["summary"]["standard"]["f1"] > 0  # real answers get scored (SmolLM2-135M overlaps a little)
    assert report["batch_outputs"][0].strip()


@pytest.mark.slow
def test_smollm2_quac_history_prompts_extend_each_other(smollm2, tmp_path):
    _, tokenizer = smollm2
    (dialogue, _) = load_quac(_quac_fixture(tmp_path))
    prompts = question_prompts(tokenizer, "quac", dialogue)
    assert all(longer[: len(shorter)] == shorter for shorter, longer in zip(prompts, prompts[1:]))


def test_cli_eval_builds_the_config(monkeypatch):
    from hf_parallel import cli
    from hf_parallel.evaluation import quality

    seen = []
    monkeypatch.setattr(quality, "evaluate_quality", seen.append)
    cli.main(["eval", "--dataset", "drop", "--limit", "7", "--methods", "parallel"])
    assert (seen[0].dataset, seen[0].limit, seen[0].methods) == ("drop", 7, ("parallel",))
    with pytest.raises(SystemExit):
        cli.main(["eval", "--dataset", "nq"])
