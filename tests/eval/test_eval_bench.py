"""eval/bench.py's tuned stock baseline: a static cache gives the stock path's tokens, and a run reports its figures."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers

from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.project import eval_module

bench = eval_module("bench")

DOC = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(40)]
QUESTIONS = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27], [31], [41, 42, 43, 44, 45]]  # of different lengths
NEW = 6


def test_static_cache_tokens_equal_stock():
    """Same prompts, greedy: the StaticCache path (reused cache, wider pads, dummy rows) gives `generate_chunk`'s
    tokens; the dummy rows are dropped."""
    model = tiny_model("llama")
    prompts = [DOC + q for q in QUESTIONS]
    doc_cache = bench.prefill_document(model, DOC, model.device)
    stock = bench.generate_chunk(model, doc_cache, prompts, len(DOC), NEW)[:, -NEW:]
    static = bench.generate_chunk_static(model, doc_cache, prompts, len(DOC), NEW)[:, -NEW:]
    assert torch.equal(static, stock)
    width = max(map(len, QUESTIONS)) + 2
    cache = bench.transformers.StaticCache(config=model.config, max_cache_len=len(DOC) + width + NEW + 3)
    for chunk in (prompts, prompts[1:3]):  # the second call reuses the cache: reset, doc rewritten, last row repeated
        out = bench.generate_chunk_static(model, doc_cache, chunk, len(DOC), NEW, cache, len(prompts), width)
        assert out.shape[0] == len(chunk)
        assert torch.equal(out[:, -NEW:], bench.generate_chunk(model, doc_cache, chunk, len(DOC), NEW)[:, -NEW:])


def test_run_stock_tuned_reports():
    model = tiny_model("llama")
    work = bench.Workload("tiny", doc_tokens=len(DOC), questions=5, answer_tokens=4)
    prompts = [DOC + QUESTIONS[i % len(QUESTIONS)] for i in range(work.questions)]
    res = bench.run_stock_tuned(model, prompts, work, rows=4)
    assert res["compiled"] is False  # CPU: generate does not compile by itself
    # 5 questions in chunks of at most 4 rows: two balanced chunks of 3, one dummy row
    assert (res["chunks"], res["chunk_rows"], res["dummy_rows"], res["graphs_compiled_in_timing"]) == (2, 3, 1, 0)
    assert res["total_s"] >= res["prefill_s"] > 0 and res["warmup_s"] > 0 and not res["extrapolated"]


def test_stock_tuned_per_chunk_times_two_chunks_and_counts_every_chunk(monkeypatch):
    """7 questions in chunks of at most 2 rows: 4 chunks; warm-up twice at 4 tokens, then the first two chunks timed
    in full, and the total counts 4 chunks at the faster's time (`full` times all 4)."""
    model = tiny_model("llama")
    work = bench.Workload("tiny", doc_tokens=len(DOC), questions=7, answer_tokens=3)
    prompts = [DOC + QUESTIONS[i % len(QUESTIONS)] for i in range(work.questions)]
    calls = []
    real = bench.generate_chunk_static
    monkeypatch.setattr(bench, "generate_chunk_static",
                        lambda m, c, p, d, n, *a: calls.append((p[0], n)) or real(m, c, p, d, n, *a))  # fmt: skip
    res = bench.run_stock_tuned(model, prompts, work, rows=2, mode="per_chunk")
    assert calls == [(prompts[0], 4), (prompts[0], 4), (prompts[0], 3), (prompts[2], 3)]
    assert res["chunks"] == 4 and res["per_chunk"] and len(res["measured_chunk_s"]) == 2
    assert abs(res["total_s"] - res["prefill_s"] - 4 * min(res["measured_chunk_s"])) < 1e-9
    calls.clear()
    bench.run_stock_tuned(model, prompts, work, rows=2, mode="full")
    assert [n for _, n in calls] == [4, 4, 3, 3, 3, 3]


def test_stock_per_chunk_times_one_chunk_of_each_row_count(monkeypatch):
    """5 questions in chunks of 2: row counts 2 (twice) and 1 (once); one chunk of each count is run, in full."""
    model = tiny_model("llama")
    work = bench.Workload("tiny", doc_tokens=len(DOC), questions=5, answer_tokens=3)
    prompts = [DOC + QUESTIONS[i % len(QUESTIONS)] for i in range(work.questions)]
    calls = []
    real = bench.generate_chunk
    monkeypatch.setattr(bench, "generate_chunk", lambda m, c, p, d, n: calls.append((len(p), n)) or real(m, c, p, d, n))
    res = bench.run_stock(model, prompts, work, rows=2, mode="per_chunk")
    assert calls[:2] == [(2, 3), (1, 3)]  # warm-up: each row count once at full length, untimed
    assert calls[2:] == [(2, 3), (1, 3)]  # timed: every answer token, one chunk per row count
    assert res["chunk_counts"] == {2: 2, 1: 1} and not res["extrapolated"]
    expected = res["prefill_s"] + 2 * res["measured_chunk_s"][2] + res["measured_chunk_s"][1]
    assert abs(res["total_s"] - expected) < 1e-9
    calls.clear()
    bench.run_stock(model, prompts, work, rows=2, mode="full")
    assert calls == [(2, 3), (1, 3), (2, 3), (2, 3), (1, 3)]


def test_profile_step_groups_kernel_time_of_prefill_and_decode(tmp_path):
    """eval/profile_step.py on the CPU (tiny model, reference path): per-group times of prefill and decode."""
    profile = eval_module("profile_step")
    assert [profile.group_of(k) for k in ("stream_attention_fwd", "sm90_xmma_gemm_bf16", "triton_poi_fused_mul")] == [
        "attention", "gemm", "other"]  # fmt: skip
    # decode time is the full call's less the prefill's, each timed on its own: on a busy CPU the prefills' timing
    # noise can outweigh the decode's 64 small steps, so the decode is checked by its launches, which are counted
    profile.main(["--model", "tiny", "--doc", "40", "--questions", "3", "--new-tokens", "65", "--paths", "reference",
                  "--device", "cpu", "--out", str(tmp_path)])  # fmt: skip
    (row,) = json.loads((tmp_path / "profile.json").read_text())
    assert (row["questions"], row["path"]) == (3, "reference")
    assert row["groups"]["gemm"]["prefill_ms"] > 0 and row["decode_launches_per_step"] > 0
    assert all(isinstance(group["decode_ms_per_step"], float) for group in row["groups"].values())
    assert row["top_decode_kernels"] and row["top_prefill_kernels"]


def test_squad_calls_times_one_call_against_calls_of_documents(tmp_path):
    """eval/squad_calls.py on prompts given as a file: both ways decode the same tokens (the script asserts it),
    answers end at EOS by position within 32 tokens, and the report counts every question."""
    import gzip

    squad_calls = eval_module("squad_calls")
    doc = [(13 * i + 5) % 40000 + 3 for i in range(20)]
    per_doc = [[doc + [100 + q, 200 + q] for q in range(3)], [doc[::-1] + [300]]]
    prompts = tmp_path / "prompts.json.gz"
    with gzip.open(prompts, "wt") as f:
        json.dump(per_doc, f)
    out = tmp_path / "report.json"
    squad_calls.main(["--prompts", str(prompts), "--docs-per-call", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert (report["documents"], report["questions"], report["docs_per_call"]) == (2, 4, 1)
    assert 1 <= report["mean_answer_tokens"] <= squad_calls.MAX_NEW and report["one_call_s"] > 0


def test_corpus_generate_batch_stops_each_request_at_its_length_with_generates_tokens():
    """eval/corpus_bench.py's comparison with Transformers' continuous batching: request i decodes exactly its own
    number of tokens, and (fp32, greedy) they are `model.generate`'s on that prompt alone."""
    corpus = eval_module("corpus_bench")
    model = tiny_model("llama")
    prompts = [DOC + q for q in QUESTIONS]
    targets = [3, 7, 1, 5]
    got = corpus.run_generate_batch(model, prompts, targets, num_blocks=8, max_batch_tokens=256)  # a CPU-sized cache
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, targets)]  # fmt: skip
    assert got["answers"] == want and got["tokens"] == sum(targets)


def test_admission_replay_counts_every_streams_own_reads_and_the_resident_documents():
    """eval/admission_replay.py's bandwidth bound: over a run, stream i reads its question and answer so far at each of
    its tokens, q_i * a_i + a_i (a_i + 1) / 2 slots, in either schedule; a round reads whole documents, at least one
    and at most all of them; the bound is their bytes at the bandwidth."""
    replay = eval_module("admission_replay")
    doc, questions, docs = 40, 6, 3
    prompts, targets = replay.workload(list(range(3, 1003)), docs, doc, questions, lambda rng: rng.randint(2, 9), 2,
                                       10**9)  # fmt: skip
    groups = [list(range(d * questions, (d + 1) * questions)) for d in range(docs)]
    own = sum((len(p) - doc) * a + a * (a + 1) // 2 for p, a in zip(prompts, targets))
    got = {refill: replay.replay(prompts, targets, groups, doc, 120, 64, refill) for refill in (True, False)}
    for figures in got.values():
        assert figures["own_slots_read"] == own
        assert doc <= figures["document_slots_read"] <= doc * docs * figures["rounds"]
        assert figures["document_slots_read"] % doc == 0
    bound = replay.bound(got[True], weights_gb=1.0, slot_bytes=10**6, bandwidth=1e12)
    assert bound["own_s"] == round(own * 1e-6, 1) and bound["weights_s"] == round(got[True]["rounds"] * 1e-3, 1)


def test_wide_own_launch_widens_only_the_own_plans_launch():
    """bench's `pp_own_launch_wide` ablation (`TritonBackend(launch_config=...)`): the own plan's launch has 2 KV
    splits and 8 warps in 16-bit, the shared plan's and fp32's are the launcher's defaults."""
    from hf_parallel.attention import launcher

    query, key = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 4, 256, 64, dtype=torch.bfloat16)
    own = SimpleNamespace(num_tiles=4, block_m=16)
    base = launcher.default_config(query, key, own)
    wide = bench.wide_own_launch(query, key, own, True)
    assert (wide.num_splits, wide.num_warps, wide.block_n) == (max(2, base.num_splits), 8, base.block_n)
    assert bench.wide_own_launch(query.float(), key.float(), own, True) == launcher.own_launch_config(
        query.float(), key.float(), own
    )
    assert bench.wide_own_launch(query, key, own, False) == base


def test_every_block_masked_masks_every_launch_and_changes_nothing_else():
    """bench's `pp_every_block_masked` ablation: the shared and the own plan's launches mask every KV block, their
    other parameters the launcher's."""
    from dataclasses import replace

    from hf_parallel.attention import launcher

    query, key = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 4, 256, 64, dtype=torch.bfloat16)
    tiles = SimpleNamespace(num_tiles=4, block_m=16)
    base = launcher.default_config(query, key, tiles)
    assert base.whole_blocks
    for own, default in [(False, base), (True, launcher.own_launch_config(query, key, tiles))]:
        assert bench.every_block_masked(query, key, tiles, own) == replace(default, whole_blocks=False)


def test_every_method_is_options_that_generate_tokens_takes():
    """Each method of the bench is a set of `generate_tokens` options (no patched internals): every one resolves,
    and each ablation differs from pp_triton in one choice."""
    from hf_parallel import GenerationOptions

    model = tiny_model("llama")
    for options, _ in bench.METHODS.values():
        GenerationOptions.resolve(model, **options)  # a renamed option or Tuning field fails here
    triton = bench.METHODS["pp_triton"][0]
    for name in ["pp_norms_only", "pp_ungrouped", "pp_prefill_apart", "pp_index_copy", "pp_synced",
                 "pp_every_dim_dynamic"]:  # fmt: skip
        options = bench.METHODS[name][0]
        assert options["attn"] == triton["attn"] and sum(not v for v in vars(options["tuning"]).values()) == 1, name


def test_gemm_check_times_the_benchmark_models_own_linear_shapes():
    """eval/gemm_check.py's layer shapes are those of the model bench builds (and the fused ones their sums)."""
    gemm = eval_module("gemm_check")
    model = transformers.AutoModelForCausalLM.from_config(bench.SHAPES["tiny"]())
    layer = model.model.layers[0]
    modules = {"q": layer.self_attn.q_proj, "k": layer.self_attn.k_proj, "v": layer.self_attn.v_proj,
               "o": layer.self_attn.o_proj, "gate": layer.mlp.gate_proj, "up": layer.mlp.up_proj,
               "down": layer.mlp.down_proj, "lm_head": model.lm_head}  # fmt: skip
    shapes = gemm.linears("tiny")
    for name, module in modules.items():
        assert shapes[name] == tuple(module.weight.shape), name
    assert shapes["qkv"] == (sum(shapes[n][0] for n in "qkv"), shapes["q"][1])
    assert shapes["gate_up"] == (shapes["gate"][0] + shapes["up"][0], shapes["gate"][1])


def test_gemm_check_skinny_gemm_equals_linear():
    """The skinny Triton GEMM that eval/gemm_check.py times gives F.linear's product, with and without split-K and
    with rows and columns that do not fill a tile (fp32: the interpreter's bf16 dot is not exact)."""
    gemm = eval_module("gemm_check")
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(40, 64, generator=gen)
    for config in [(16, 32, 32, 1, 4, 2), (16, 16, 16, 2, 4, 2), (16, 32, 16, 4, 4, 2)]:
        torch.testing.assert_close(gemm.skinny_mm(x, w, config), torch.nn.functional.linear(x, w), msg=str(config))


def test_prefill_qkv_check_finds_a_wide_inputs_columns_equal_to_their_own_gemms(tmp_path):
    from hf_parallel.models.projections import MOST_ROWS

    out = tmp_path / "qkv.json"
    eval_module("prefill_qkv_check").main(["--models", "tiny", "--rows", str(MOST_ROWS + 1), "--reps", "1",
                                           "--device", "cpu", "--out", str(out)])  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rows"] == MOST_ROWS + 1 and row["bitwise_equal"] is True
    assert len(row["us_columns_of_one"]) == len(row["us_tensors_of_their_own"]) == 2


def test_host_check_times_the_input_checks_and_the_prefix_tree(capsys):
    eval_module("host_check").main(["--doc", "64", "--questions", "3", "--repeats", "1", "--layers", "2"])
    out = capsys.readouterr().out
    assert "3 prompts of 76 tokens: input checks" in out and "build_layout" in out
    assert "2 layers: placement" in out and "sibling groups" in out and "check_model" in out
    assert "3 text prompts of a 64-token document: tokenized a call each" in out and "in batches" in out


def _linear_weights(config) -> int:
    """Elements of every nn.Linear weight of a model built from `config` (its layers' and its LM head's)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_roofline_reads_the_linear_weights_once_a_step_and_not_the_embedding_table():
    config = bench.SHAPES["tiny"]()
    work = bench.Workload("tiny", doc_tokens=64, questions=4, answer_tokens=2)
    prompts = [[5] * (64 + q) for q in (3, 4, 5, 6)]
    reads = dict(bandwidth=1e9, matmul=1e30)  # every forward bound by its bytes
    step = bench.roofline(config, prompts, work, reads)["roofline_decode_s"]  # one step: the second answer token
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * (64 + sum((3, 4, 5, 6)) + 4)
    want = 2 * _linear_weights(config) + kv + 2 * config.hidden_size * 4  # + the 4 embedding rows looked up
    assert step * 1e9 == pytest.approx(want, rel=1e-9)


def test_roofline_counts_the_lm_heads_flops_only_over_the_rows_whose_logits_are_kept():
    small, large = bench.SHAPES["tiny"](), bench.SHAPES["tiny"]()
    large.vocab_size = 2 * small.vocab_size
    work = bench.Workload("tiny", doc_tokens=64, questions=4, answer_tokens=1)
    prompts = [[5] * (64 + q) for q in (3, 4, 5, 6)]
    arithmetic = dict(bandwidth=1e30, matmul=1e12)  # every forward bound by its FLOPs
    prefill = [bench.roofline(c, prompts, work, arithmetic)["roofline_prefill_s"] for c in (small, large)]
    head = 2 * small.vocab_size * small.hidden_size * len(prompts)  # the LM head over each prompt's last token
    assert (prefill[1] - prefill[0]) * 1e12 == pytest.approx(head, rel=1e-9)


def test_serial_bound_adds_the_gemms_and_attention_where_one_is_bound_by_arithmetic_and_one_by_reads():
    config = bench.SHAPES["tiny"]()
    prompts = [[5] * (64 + 200)] * 256  # 256 streams with long own regions: attention about 3 FLOPs a byte read
    steps, prefill = (bench.Workload("tiny", doc_tokens=64, questions=256, answer_tokens=a) for a in (8, 1))
    for only in (dict(bandwidth=1e9, matmul=1e30), dict(bandwidth=1e30, matmul=1e12)):  # one ceiling binds both
        bound = bench.roofline(config, prompts, steps, only)
        assert bound["serial_s"] == pytest.approx(bound["roofline_s"], rel=1e-9)
    both = dict(bandwidth=1e12, matmul=16e12)  # 256-row GEMMs (256 FLOPs a byte) bound by FLOPs, attention by reads
    bound, first = bench.roofline(config, prompts, steps, both), bench.roofline(config, prompts, prefill, both)
    serial_decode = bound["serial_s"] - first["serial_s"]
    assert serial_decode > 1.2 * bound["roofline_decode_s"]  # the roofline lets the two overlap


def test_engine_bench_runs_every_request_from_clients_and_all_at_once():
    """eval/engine_bench.py on a tiny model: every request done with its output tokens, from closed-loop clients
    and all at once, each system prompt computed once a run (the engine's prompt tokens computed below requested)."""
    engine_bench = eval_module("engine_bench")
    rows = engine_bench.main(["--model", "tiny", "--groups", "2", "--prompts-per-group", "3", "--system-len", "24",
                              "--question-len", "3", "--output-len", "4", "--concurrency", "2", "all",
                              "--device", "cpu"])  # fmt: skip
    assert [r["concurrency"] for r in rows] == [2, "all"]
    for row in rows:
        assert row["requests_done"] == 6 and row["errors"] == 0 and row["output_tokens"] == 6 * 4
        assert row["computed_tokens"] < row["prompt_tokens"] == 6 * 27
