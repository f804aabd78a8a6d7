"""The lm-evaluation-harness backend `hf-parallel` answers every request as the harness's own HF backend does.

Each model test compares against `lm_eval.models.huggingface.HFLM` (`--model hf`, one request at a time) on the
same SmolLM2 weights, never against hf_parallel's own output: generated strings identical, log-likelihoods within
the tolerance `hf_parallel.harness.compare` states, is_greedy and the tasks' metrics identical.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the harness backend needs lm-eval (the `harness` extra)")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from hf_parallel.cli import main as hf_parallel_main  # noqa: E402
from hf_parallel.harness import HFParallelLM, main  # noqa: E402
from hf_parallel.harness.arguments import batch_size_notice, call_tokens, check_arguments  # noqa: E402
from hf_parallel.harness.cli import TASKS, harness_argv  # noqa: E402
from hf_parallel.harness.compare import LL_ATOL, compare_runs  # noqa: E402
from hf_parallel.harness.embedded import save_model_dir  # noqa: E402
from hf_parallel.harness.generation import Stops, decoding_options  # noqa: E402
from hf_parallel.harness.packing import calls_by_prefix, tree_tokens  # noqa: E402
from hf_parallel.harness.requests import ModelArgumentError, RequestError  # noqa: E402
from tests.helpers.project import ROOT, SHARED_DATA  # noqa: E402

SHOT = "Question: What is the capital of France?\nAnswer: Paris\n\n"


def request(kind: str, args: tuple, doc_id: int = 0, idx: int = 0) -> Instance:
    return Instance(kind, {}, args, idx, ("unit", doc_id, 1))


def test_calls_keep_shared_prefixes_together_within_the_cap():
    sequences = [[1, 2, 3, 4], [9, 9], [1, 2, 3, 5], [1, 2], [9, 8, 7]]
    assert tree_tokens(sequences) == 4 + 1 + 2 + 2  # 1 2 3 4, its sibling 5; 9 9 and its sibling 8 7
    assert calls_by_prefix(sequences, None) == [[3, 0, 2, 4, 1]]  # token order: one call
    assert calls_by_prefix(sequences, 5) == [[3, 0, 2], [4, 1]]  # 1 2 (3 4) (5) = 5, then 9 8 7 (9)
    assert calls_by_prefix([[1] * 7, [2]], 3) == [[0], [1]]  # longer than the cap: a call of its own
    # the dense path: a sequence joins where its shared tokens save what reading the call's keys costs
    assert calls_by_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [7, 8, 9]], None, keys_per_token=2) == [[0, 1], [2]]
    assert calls_by_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [7, 8, 9]], None, keys_per_token=1) == [[0], [1], [2]]


def test_batch_size_is_hfs_and_ignored_and_max_call_tokens_is_the_token_budget():
    """batch_size takes what `hf` takes (requests per call, "auto", "auto:N") and says it is ignored unless it is
    the harness's default; max_call_tokens is a number of tokens."""
    assert batch_size_notice(1) is None and batch_size_notice("1") is None
    for value in (8, "8", "auto", "auto:4", "auto:0.5"):
        notice = batch_size_notice(value)
        assert f"batch_size={value}" in notice and "ignores it" in notice and "max_call_tokens=" in notice
    for value in ("many", 0, "-3", "auto:x", "8 tokens"):
        with pytest.raises(ModelArgumentError, match="batch_size=.*a number of requests, 'auto' or 'auto:N'"):
            batch_size_notice(value)
    assert call_tokens(None) is None and call_tokens(4096) == 4096 and call_tokens("512") == 512
    for value in ("lots", 0, "1.5"):
        with pytest.raises(ModelArgumentError, match="max_call_tokens="):
            call_tokens(value)
    check_arguments({"revision": "main", "add_bos_token": True})
    with pytest.raises(ModelArgumentError, match="unknown model argument atn='triton'.*attn"):
        check_arguments({"atn": "triton"})
    with pytest.raises(ModelArgumentError, match="peft"):
        check_arguments({"peft": "adapter"})


def test_gen_kwargs_map_to_generate_options_as_hflm_passes_them():
    assert decoding_options({"do_sample": False, "temperature": 0.0}) == {"do_sample": False}
    assert decoding_options({"do_sample": True, "temperature": 0.7}) == {"do_sample": True, "temperature": 0.7}
    assert decoding_options({}) == {"do_sample": False}


def test_the_command_line_adds_the_offline_tasks_and_implies_the_model():
    hfp = ["--model", "hf-parallel"]
    assert harness_argv(["--tasks", "x"]) == ["--tasks", "x", *hfp, "--include_path", str(TASKS)]
    assert harness_argv(["run", "--model", "hf"]) == ["run", "--model", "hf", "--include_path", str(TASKS)]
    assert harness_argv(["-Mhf", "--include_path", "mine"]) == ["-Mhf", "--include_path", f"mine:{TASKS}"]
    assert harness_argv(["--config=c.yaml", "--include_path=mine"]) == [
        "--config=c.yaml",
        f"--include_path=mine:{TASKS}",
    ]
    assert harness_argv(["--model_args", "pretrained=x"]) == [
        "--model_args",
        "pretrained=x",
        *hfp,
        "--include_path",
        str(TASKS),
    ]
    assert harness_argv(["ls", "tasks"]) == ["ls", "tasks", "--include_path", str(TASKS)]


def test_only_the_harness_package_imports_lm_eval():
    """lm-eval is optional: no module outside hf_parallel/harness imports it, at the top or inside a function."""
    package = ROOT / "hf_parallel"
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(package / "harness"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno}" for name in names if name.split(".")[0] == "lm_eval"]
    assert found == []


def test_offline_tasks_read_the_shared_data():
    """The tasks' loaders: a few-shot pool apart from the documents evaluated, a document's questions together,
    four distinct choices with the gold answer at its label."""
    if not all((SHARED_DATA / name).exists() for name in ("squad-dev-v1.1.json.zip", "drop-dev.jsonl.gz")):
        pytest.skip(f"the offline SQuAD and DROP files are not in {SHARED_DATA} (they ship beside the project)")
    spec = importlib.util.spec_from_file_location("hfp_task_utils", TASKS / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    squad, drop, choice = utils.squad(), utils.drop_passages(), utils.squad_choice()
    assert len(squad["train"]) == len(drop["train"]) == len(choice["train"]) == 3
    assert len(squad["validation"]) + len(squad["train"]) < 10_570 and len(drop["validation"]) < 9_536
    assert not {d["id"] for d in squad["train"]} & {d["id"] for d in squad["validation"]}
    passages = [d["passage"] for d in drop["validation"]]
    assert len({p for p, q in zip(passages, passages[1:]) if p != q}) == len(set(passages)) - 1  # each one run
    for doc in choice["validation"].select(range(200)):
        assert len(set(doc["choices"])) == 4 and doc["choices"][doc["label"]] == doc["answers"][0]


@pytest.fixture(scope="module")
def backends(smollm2):
    """(HFLM, HFParallelLM) over the same SmolLM2 model object and tokenizer, for a `max_length` (None: the model's)."""
    model, tokenizer = smollm2

    def pair(max_length=None):
        return (
            HFLM(pretrained=model, tokenizer=tokenizer, device="cpu", max_length=max_length),
            HFParallelLM(model, tokenizer=tokenizer, max_length=max_length),
        )

    return pair


@pytest.mark.slow
@pytest.mark.parametrize("max_length", [None, 48], ids=["whole", "left-truncated"])
def test_loglikelihood_matches_hflm(backends, max_length):
    hf, ours = backends(max_length)
    contexts = [SHOT + "Question: What is the capital of Italy?\nAnswer:", SHOT + "Question: Who wrote Hamlet? ", ""]
    continuations = [" Rome", " William Shakespeare", "Paris", " the capital of France is Paris, of course"]
    requests = [
        request("loglikelihood", (c, x), d, i) for d, c in enumerate(contexts) for i, x in enumerate(continuations)
    ]
    want, got = hf.loglikelihood(requests, disable_tqdm=True), ours.loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=LL_ATOL)
    assert any(g for _, g in want)  # a greedy continuation among them


@pytest.mark.slow
def test_rolling_windows_match_hflm(backends):
    hf, ours = backends(24)  # several windows per text
    texts = ["The quick brown fox jumps over the lazy dog. " * 6, "One short line.", SHOT * 3]
    requests = [request("loglikelihood_rolling", (t,), d) for d, t in enumerate(texts)]
    got, want = ours.loglikelihood_rolling(requests, disable_tqdm=True), hf.loglikelihood_rolling(requests, True)
    assert got == pytest.approx(want, abs=LL_ATOL)
    assert ours.usage["loglikelihood_rolling"].requests > len(texts)


@pytest.mark.slow
@pytest.mark.parametrize("max_length", [None, 40], ids=["whole", "left-truncated"])
def test_generate_until_matches_hflm(backends, max_length):
    """Two gen_kwargs groups interleaved; stops at a word, at a newline, at max_gen_toks (the sky's description);
    shared few-shot prefix."""
    hf, ours = backends(max_length)
    questions = ["What is the capital of Italy?", "Name three colors.", "Describe the sky.", "What is 2 + 2?"]
    kwargs = [{"until": ["\n"], "max_gen_toks": 8}, {"until": ["\n\n", "is"], "max_gen_toks": 7, "do_sample": False}]
    requests = [
        request("generate_until", (f"{SHOT}Question: {q}\nAnswer:", kwargs[d % 2]), d) for d, q in enumerate(questions)
    ]
    assert ours.generate_until(requests) == hf.generate_until(requests, disable_tqdm=True)


@pytest.mark.slow
def test_a_stop_sequence_begun_in_the_prompt_does_not_stop_generation(backends):
    """generate's stop_strings would match ":" of the prompt with the answer's first text; the harness looks at the
    answer alone, and so must the answer here (the stream is answered again alone)."""
    hf, ours = backends()
    context = SHOT + "Question: Name three colors.\nAnswer:"
    first = hf.generate_until([request("generate_until", (context, {"until": ["\n"], "max_gen_toks": 1}))], True)[0]
    kwargs = {"until": [":" + first, "\n"], "max_gen_toks": 10}
    requests = [request("generate_until", (context, kwargs))]
    want = hf.generate_until(requests, disable_tqdm=True)
    assert ours.generate_until(requests) == want
    assert len(want[0]) > len(first)  # the answer goes on past the text that, with the prompt's ":", is a stop


@pytest.mark.slow
def test_the_harness_stop_window_is_the_generated_tokens(smollm2):
    _, tokenizer = smollm2
    stops = Stops.of(tokenizer, ["\n", "Question:"])
    tokens = tokenizer.encode(" Rome, of course.\nQuestion: next", add_special_tokens=False)
    kept = stops.kept(tokenizer, tokens)
    assert tokenizer.decode(tokens[:kept]).endswith("\n") and "\n" not in tokenizer.decode(tokens[: kept - 1])
    assert stops.kept(tokenizer, tokenizer.encode(" Rome", add_special_tokens=False)) is None


@pytest.mark.slow
def test_bad_requests_name_the_request(backends, smollm2):
    _, ours = backends()
    with pytest.raises(RequestError, match="loglikelihood request 1 of unit document 7: the continuation is empty"):
        ours.loglikelihood(
            [request("loglikelihood", ("Some context", " ok"), 7), request("loglikelihood", ("x", ""), 7, 1)]
        )
    with pytest.raises(RequestError, match="generate_until request 0 of unit document 3: the context '' has no tokens"):
        ours.generate_until([request("generate_until", ("", {"until": ["\n"]}), 3)])
    long = " one two three four five six seven eight nine ten"
    with pytest.raises(RequestError, match="document 5: the continuation has 10 tokens, more than .*max_length=8"):
        backends(8)[1].loglikelihood([request("loglikelihood", ("Count:", long), 5)])
    model, tokenizer = smollm2
    with pytest.raises(ModelArgumentError, match="unknown model argument max_memroy"):
        HFParallelLM(model, tokenizer=tokenizer, max_memroy="1GiB")


@pytest.mark.slow
def test_batch_size_8_computes_what_the_default_computes(smollm2, caplog):
    """`--batch_size 8`, a harness habit, packs calls as the default does: the same tokens computed (shared
    few-shot prefixes once), where a budget of 8 tokens per call computed every request whole.  Only
    max_call_tokens bounds a call."""
    model, tokenizer = smollm2
    questions = ["What is the capital of Italy?", "Who wrote Hamlet?", "What is 2 + 2?", "Name a color."]
    contexts = [f"{SHOT * 3}Question: {q}\nAnswer:" for q in questions]
    scored = [
        request("loglikelihood", (c, x), d, i) for d, c in enumerate(contexts) for i, x in enumerate([" A", " B"])
    ]
    generated = [
        request("generate_until", (c, {"until": ["\n"], "max_gen_toks": 3}), d) for d, c in enumerate(contexts)
    ]
    runs = {}
    for label, args in [
        ("default", {}),
        ("batch_size=8", {"batch_size": 8}),
        ("max_call_tokens=8", {"max_call_tokens": 8}),
    ]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_parallel.harness"):
            lm = HFParallelLM(model, tokenizer=tokenizer, **args)
        notices = [r.getMessage() for r in caplog.records if "batch_size" in r.getMessage()]
        assert len(notices) == (label == "batch_size=8")
        answers = lm.loglikelihood(scored, disable_tqdm=True), lm.generate_until(generated, disable_tqdm=True)
        runs[label] = answers, {kind: (u.requested_tokens, u.computed_tokens) for kind, u in lm.usage.items()}
    (answers, usage), (answers8, usage8), (_, bounded) = (
        runs["default"],
        runs["batch_size=8"],
        runs["max_call_tokens=8"],
    )
    assert usage8 == usage  # (requested, computed) tokens per request type
    assert answers8 == answers
    for kind, (requested, computed) in usage.items():
        assert computed < requested / 2, kind  # the three shots are computed once, not four times
        assert bounded[kind] == (requested, requested), kind  # calls of 8 tokens: every request whole, alone


@pytest.fixture(scope="module")
def model_dir(smollm2, tmp_path_factory):
    """The SmolLM2 weights as a model directory, which `--model hf` needs for `pretrained=`."""
    return save_model_dir(*smollm2, tmp_path_factory.mktemp("smollm2"))


@pytest.mark.slow
def test_harness_runs_agree_with_the_harness_hf_backend(model_dir, tmp_path):
    """`--model hf` and `--model hf-parallel` through the command line on the offline tasks, with --log_samples:
    every string identical, every log-likelihood within tolerance, is_greedy and metrics identical."""
    if not (SHARED_DATA / "squad-dev-v1.1.json.zip").exists():
        pytest.skip(
            f"the offline SQuAD and War and Peace files are not in {SHARED_DATA} (they ship beside the project)"
        )
    common = ["--model_args", f"pretrained={model_dir},dtype=float32", "--device", "cpu", "--limit", "2",
              "--tasks", "hfp_squad,hfp_squad_mc", "--num_fewshot", "1",
              "--gen_kwargs", "max_gen_toks=12", "--log_samples"]  # fmt: skip
    assert main(["--model", "hf", *common, "--output_path", str(tmp_path / "hf")]) == 0
    assert main([*common, "--output_path", str(tmp_path / "hf-parallel")]) == 0  # --model hf-parallel implied
    found = compare_runs(tmp_path / "hf-parallel", tmp_path / "hf")
    assert [c.task for c in found] == ["hfp_squad", "hfp_squad_mc"]
    for comparison in found:
        assert comparison.documents == 2 and comparison.identical(), comparison
    assert sum(c.strings for c in found) == 2 and sum(c.loglikelihoods for c in found) == 2 * 4
    assert main(["compare", str(tmp_path / "hf-parallel"), str(tmp_path / "hf")]) == 0


def test_hf_parallel_lm_eval_reports_a_refused_model_argument_in_one_line(tmp_path, capsys, monkeypatch):
    """`hf-parallel lm-eval`, the model implied: a model argument it does not take stops it before loading."""
    (tmp_path / "squad-dev-v1.1.json.zip").touch()  # the task's file is there (never read): only the argument is wrong
    monkeypatch.setenv("HF_PARALLEL_DATA", str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        hf_parallel_main(["lm-eval", "--model_args", f"pretrained={tmp_path},peft=x", "--tasks", "hfp_squad"])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("hf-parallel lm-eval: error: hf-parallel does not take the model argument peft='x'")


def test_save_smollm2_writes_files_every_user_may_read_as_the_umask_allows(model_dir):
    """`save-smollm2 DIR` is for `pretrained=DIR`, often another user's or a container's: safetensors writes its
    file 0600, the directory's files are left as the umask allows."""
    umask = os.umask(0o022)
    os.umask(umask)
    files = [p for p in model_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
