"""eval/host_bench.py at a tiny size, this tree as its own baseline (its hf_parallel/ copied as hf_parallel_main): the
report's shape, both copies' answers identical, the rounds the replaced forward counts equal to the core's `Stats`,
the answers what the precomputed logits choose, and every `ModelRunner.forward` put back after."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from transformers import PreTrainedModel

import hf_parallel
from hf_parallel.frontends.probe import check_support
from hf_parallel.runner.model_runner import ModelRunner
from tests.helpers.project import ROOT, eval_module

host_bench = eval_module("host_bench")


@pytest.fixture
def baseline(tmp_path):
    """A BASELINE folder holding this tree's hf_parallel/ as hf_parallel_main; what loading it leaves in the process
    (its modules, its folder on sys.path, the generate_parallel it puts on PreTrainedModel) is undone after."""
    shutil.copytree(ROOT / "hf_parallel", tmp_path / "pkgs" / "hf_parallel_main",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    method, path = PreTrainedModel.__dict__.get("generate_parallel"), list(sys.path)
    yield tmp_path / "pkgs"
    for name in [m for m in sys.modules if m.split(".")[0] == "hf_parallel_main"]:
        del sys.modules[name]
    sys.path[:] = path
    PreTrainedModel.generate_parallel = method


def test_tiny_run_against_a_copy_of_the_tree(baseline, tmp_path):
    model = host_bench.tiny_model(64)
    prompts = [[5, 6, 7, 8, 9, 10] + [11 + i] * (i + 1) for i in range(3)]
    real = hf_parallel.generate_tokens(model, prompts, max_new_tokens=4, eos_token_id=[], progress=False)
    own = ModelRunner.__dict__["forward"]
    argv = ["--streams", "4", "--repeats", "2", "--vocabs", "64", "--new", "8", "--threads", "0",
            "--baseline", str(baseline), "--out", str(tmp_path / "out")]  # fmt: skip
    rows = host_bench.main(argv)
    assert [(r["workload"], r["streams"], r["vocab"]) for r in rows] == [(w, 4, 64) for w in host_bench.WORKLOADS]
    for r in rows:
        assert r["identical"] == r["prompts"] == (4 if r["workload"] == "row" else 8), r
        assert r["new_rounds"] == r["main_rounds"] == [r["rounds"]]
        assert r["tokens"] == 8 * r["prompts"]  # at --new 8 every answer has 8 tokens
        assert r["new_ms_round_median"] > 0 and r["main_ms_round_median"] > 0 and r["ratio_median"] > 0
        # refill and arrivals: 8 streams, at most 4 at once (the row's memory, the engine's max_streams): 2 waves
        assert r["stream_rounds"] >= r["rounds"] and 0 < r["mean_live"] <= 4
        assert r["rounds"] >= (8 if r["workload"] == "row" else 16)
        assert len(r["new_wall_s"]) == len(r["main_wall_s"]) == 2
    saved = json.loads((tmp_path / "out" / "host-bench.json").read_text())
    assert saved["rows"] == rows and saved["threads"] == torch.get_num_threads()
    table = host_bench.table(rows).splitlines()
    assert len(table) == 2 + len(rows) and all(line.count("|") == table[0].count("|") for line in table)
    # every ModelRunner.forward is its class's own again, and a real call answers as before the benchmark
    main = sys.modules["hf_parallel_main.runner.model_runner"].ModelRunner
    assert ModelRunner.__dict__["forward"] is own
    assert main.__dict__["forward"].__module__ == "hf_parallel_main.runner.model_runner"
    assert hf_parallel.generate_tokens(model, prompts, max_new_tokens=4, eos_token_id=[], progress=False) == real


def test_the_replaced_forward_counts_the_rounds_and_its_logits_choose():
    """Forwards counted equal `Stats.rounds`; each stream's token is the argmax of its row of the precomputed logits
    (one prefill round, then each round's rows at the offset the forward moved to); the forward restored even when
    the run fails."""
    vocab, n, new = 64, 3, 5
    model = host_bench.tiny_model(vocab)
    check_support(model)  # probed by its own forward, as the benchmark does
    logits = torch.randn(n + host_bench.SPAN, vocab, generator=torch.Generator().manual_seed(1))
    work = host_bench.row_work(n, vocab, new)
    fake, stats = host_bench.FreeForward(logits), hf_parallel.Stats()
    own = ModelRunner.__dict__["forward"]
    with host_bench.replaced_forward(ModelRunner, fake):
        assert ModelRunner.__dict__["forward"] is not own
        answers = hf_parallel.generate_tokens(model, work.prompts, stats=stats, **work.options)
    assert ModelRunner.__dict__["forward"] is own
    assert fake.calls == stats.rounds == new and fake.rows == n * new  # the last token is chosen, never fed
    offsets = [k * host_bench.STEP % host_bench.SPAN for k in range(new)]
    assert answers == [[int(logits[at + i].argmax()) for at in offsets] for i in range(n)]
    with pytest.raises(RuntimeError, match="rows asked"):
        with host_bench.replaced_forward(ModelRunner, host_bench.FreeForward(logits[:2])):
            hf_parallel.generate_tokens(model, work.prompts, **work.options)
    assert ModelRunner.__dict__["forward"] is own
