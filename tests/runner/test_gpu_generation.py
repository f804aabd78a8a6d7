"""On CUDA: captured rounds (CUDA graphs, reused across calls in a Session), attention sinks, recurrent layers and
refill give plain `model.generate`'s tokens; a call's rounds never wait for the GPU but to read the round before; a
call's memory comes back when it returns, and counts as free for the next call's budget."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from hf_parallel import Session, Tuning, generate_tokens, stream_tokens
from tests.helpers.models import generate_alone, random_tokens, tiny_model
from tests.helpers.prompts import corpus
from tests.helpers.serving import Collector
from tests.helpers.sizing import CHUNK, max_memory_for
from tests.helpers.speculation import Oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
ATTNS = ["reference", "triton"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2", "gpt2", "gpt_oss", "qwen3_5_text"])
def cuda_model(request):
    return tiny_model(request.param).cuda()


def _prompts(seed: int, n: int, doc_len: int = 40):
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(doc_len, gen)
    return [doc + random_tokens(1 + (i * 3) % 7, gen) for i in range(n)]


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("attn", ATTNS)
def test_graphs_match_generate_across_calls_and_buckets(cuda_model, attn):
    with Session(cuda_model) as session:
        for seed, n in [(0, 5), (1, 17), (2, 3)]:  # different layouts reuse the session's static row
            prompts = _prompts(seed, n, doc_len=30 + 10 * seed)
            free = [generate_alone(cuda_model, p, 10, None) for p in prompts]
            eos = sorted({free[0][2], free[-1][5]})  # streams leave at different steps: buckets shrink
            got = session.generate_tokens(prompts, max_new_tokens=10, eos_token_id=eos, attn=attn)
            assert got == [generate_alone(cuda_model, p, 10, eos) for p in prompts]


@pytest.mark.parametrize("attn", ATTNS)
def test_graphs_and_eager_agree(cuda_model, attn):
    prompts = _prompts(5, 9)
    graphs = generate_tokens(cuda_model, prompts, max_new_tokens=12, eos_token_id=[], attn=attn)
    eager = generate_tokens(cuda_model, prompts, max_new_tokens=12, eos_token_id=[], cuda_graphs=False, attn=attn)
    assert graphs == eager


def test_session_row_is_reused_and_grows(cuda_model):
    with Session(cuda_model) as session:
        session.generate_tokens(_prompts(6, 4), max_new_tokens=4, eos_token_id=[])
        row = session.row
        if row is None:  # recurrent layers decode eagerly: no row to keep
            return
        session.generate_tokens(_prompts(7, 3), max_new_tokens=4, eos_token_id=[])
        assert session.row is row  # same buffers: captured graphs replay
        session.generate_tokens(_prompts(8, 30), max_new_tokens=80, eos_token_id=[])  # > 2048 slots
        assert session.row.capacity > row.capacity


def test_memory_comes_back_after_a_call_and_after_release(cuda_model):
    """No reference cycle holds a call's row: allocated memory returns to the weights' with no gc.collect()."""
    import gc

    generate_tokens(cuda_model, _prompts(9, 20), max_new_tokens=30, eos_token_id=[])  # kernels, cuBLAS workspaces
    torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    gc.disable()
    try:
        generate_tokens(cuda_model, _prompts(9, 20), max_new_tokens=30, eos_token_id=[])
        assert torch.cuda.memory_allocated() == baseline
        session = Session(cuda_model)
        session.generate_tokens(_prompts(9, 20), max_new_tokens=30, eos_token_id=[])
        session.release()
        assert torch.cuda.memory_allocated() == baseline
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("refill", [True, False])
def test_refill_and_waves_with_captured_steps(cuda_model, refill):
    """A budget that holds a fraction of the work: refill (or static waves) with CUDA graphs, same tokens."""
    _check_under_a_quarter_budget(cuda_model, refill=refill)


def _check_under_a_quarter_budget(model, **options):
    """4 documents x 8 questions under a budget of 120 slots, streams stopping at different steps: the tokens of
    `model.generate` on each prompt alone."""
    prompts = corpus(7, docs=4, questions=8)
    free = [generate_alone(model, p, 10) for p in prompts]
    eos = sorted({free[0][2], free[9][6], free[17][4], free[30][1]})
    got = generate_tokens(model, prompts, max_new_tokens=10, eos_token_id=eos, prefill_chunk=CHUNK,
                          max_memory=max_memory_for(model, 120), **options)  # fmt: skip
    assert got == [generate_alone(model, p, 10, eos) for p in prompts]


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("attn", ATTNS)
def test_compiled_graphs_match_generate(cuda_model, attn):
    """compile=True: captured steps replay a compiled forward (the kernel an opaque op); same tokens."""
    prompts = _prompts(7, 6)
    free = [generate_alone(cuda_model, p, 8, None) for p in prompts]
    eos = sorted({free[1][3]})
    got = generate_tokens(cuda_model, prompts, max_new_tokens=8, eos_token_id=eos, compile=True, attn=attn)
    assert got == [generate_alone(cuda_model, p, 8, eos) for p in prompts]


def test_the_budget_counts_the_allocators_cached_blocks_as_free():
    """A finished call's blocks stay reserved in PyTorch's caching allocator: the next call's budget counts them
    as free (else a call after a large one would see a fraction of the GPU and split its work into many rows)."""
    from hf_parallel.runner.sizing import free_memory

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before = free_memory(device)
    block = torch.empty(4 * 2**30, dtype=torch.uint8, device=device)
    del block  # freed, but reserved by the allocator
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) >= 4 * 2**30
    assert free_memory(device) >= before - 2**26
    torch.cuda.empty_cache()


@pytest.mark.usefixtures("no_tf32")
def test_own_tiles_on_a_second_stream_match_generate(cuda_model):
    """`TritonBackend(own_tiles="overlap")`: the own plan's launch beside the shared plan's on a second CUDA stream,
    captured in the steps' graphs, across calls and shrinking buckets of a Session, and under refill."""
    from hf_parallel.attention.triton import TritonBackend

    attn = TritonBackend(own_tiles="overlap")
    with Session(cuda_model) as session:
        for seed, n in [(0, 5), (1, 17)]:
            prompts = _prompts(seed, n, doc_len=30 + 10 * seed)
            free = [generate_alone(cuda_model, p, 10, None) for p in prompts]
            eos = sorted({free[0][2], free[-1][5]})
            got = session.generate_tokens(prompts, max_new_tokens=10, eos_token_id=eos, attn=attn)
            assert got == [generate_alone(cuda_model, p, 10, eos) for p in prompts]
    _check_under_a_quarter_budget(cuda_model, attn=attn)


@pytest.mark.parametrize("compile", [False, "auto"])  # the prefill waiting on the GPU; compiling the layers' parts
@pytest.mark.parametrize("own_tiles", [None, "overlap"])
def test_the_first_calls_kernels_are_built_on_threads(cuda_model, own_tiles, compile, monkeypatch, tmp_path):
    """Every kernel of a first call, the K/V write's, the first round's and the first captured round's, is built on
    a thread beside the caller (`ModelRunner.prebuild`), none at its launch (into an empty cache, each kernel's
    in-process table emptied first, so that every launch needs a build)."""
    import collections
    import threading
    import warnings

    import triton

    from hf_parallel.attention import triton as path
    from hf_parallel.frontends.probe import check_support
    from hf_parallel.kernels import cache_write, prebuild
    from hf_parallel.kernels import stream_attention as kernels

    if check_support(cuda_model).recurrent:
        pytest.skip("recurrent layers decode eagerly: no captured step to build for")
    if not hasattr(triton.knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no post-compile hook to see builds by")
    ours = (kernels.stream_attention_fwd, kernels.combine_splits, cache_write.write_slots)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prebuild, "STARTED", set())
    for kernel in ours:
        monkeypatch.setattr(kernel, "device_caches", collections.defaultdict(kernel.create_binder))
    built = []  # (kernel, thread, at a launch)

    def hook(*args, fn, is_manual_warmup, **kwargs):
        if fn.jit_function in ours:
            built.append((fn.name, threading.current_thread().name, not is_manual_warmup))

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate_tokens(cuda_model, _prompts(3, 6), max_new_tokens=4, eos_token_id=[], compile=compile,
                        attn=path.TritonBackend(own_tiles=own_tiles))  # fmt: skip
    if any("CUDA-graph capture of a round failed" in str(w.message) for w in caught):
        pytest.skip("this model's rounds run eagerly (gpt-oss: a copy from the host inside the forward)")
    assert {name for name, _, _ in built} >= {"write_slots", "stream_attention_fwd"}
    assert [b for b in built if b[2] or b[1] == threading.current_thread().name] == []  # none at a launch


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("case", ["one row", "prefill chunks", "refill"])
def test_a_calls_rounds_wait_for_the_gpu_only_to_read_the_round_before(case):
    """A second call in a Session (its rounds captured by the first) runs its rounds with no call that waits for
    the GPU (CUDA's sync debug mode raises on one): uploads go through pinned memory behind the queued work, plans
    are made from host slots, and each round's tokens are read through an event a round late.  Its answers are
    model.generate's, and it captures no graph the first did not."""
    model = tiny_model("llama").cuda()
    prompts = _prompts(4, 12, doc_len=60) + _prompts(5, 6, doc_len=50)
    free = [generate_alone(model, p, 12, None) for p in prompts]
    eos = sorted({free[0][3], free[7][6], free[13][2]})
    options = dict(max_new_tokens=12, eos_token_id=eos, attn="triton")
    options.update({"prefill chunks": dict(prefill_chunk=16), "refill": dict(max_memory="2MiB", prefill_chunk=64)}
                   .get(case, {}))  # fmt: skip
    with Session(model) as session:
        first = stream_tokens(model, prompts, session=session, **options)
        dict(first)
        streamed = stream_tokens(model, prompts, session=session, **options)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = dict(streamed)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [got[i] for i in range(len(prompts))] == [generate_alone(model, p, 12, eos) for p in prompts]
    assert first.stats.captures > 0 and streamed.stats.captures == 0


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("attn", ATTNS)
def test_the_serving_engine_matches_generate(cuda_model, attn):
    """Requests joining a live row over time (captured decode rounds between arrivals, greedy rows chosen in one
    pass) each equal model.generate alone, on both attention paths."""
    from hf_parallel.frontends.serving import Engine

    prompts = _prompts(9, 12) + _prompts(10, 6, doc_len=70)
    limits = [6 + i % 9 for i in range(len(prompts))]
    free = [generate_alone(cuda_model, p, n, []) for p, n in zip(prompts, limits)]
    ids = torch.tensor([prompts[5]], device="cuda")
    options = dict(max_new_tokens=limits[5], do_sample=False, eos_token_id=[], pad_token_id=0, repetition_penalty=1.3)
    penalized = cuda_model.generate(ids, attention_mask=torch.ones_like(ids), **options)[0, len(prompts[5]) :].tolist()
    engine = Engine(cuda_model, max_memory="2GiB", max_streams=8, attn=attn)
    try:
        collectors = []
        for i, (prompt, n) in enumerate(zip(prompts, limits)):
            collectors.append(Collector())
            options = dict(max_new_tokens=n, eos_token_id=[], **({"repetition_penalty": 1.3} if i == 5 else {}))
            engine.submit(prompt, options, 1, collectors[-1])
            time.sleep(0.003 * (i % 4))
        got = [c.wait().tokens[0] for c in collectors]
    finally:
        engine.close(10)
    assert got[:5] + got[6:] == free[:5] + free[6:]
    assert got[5] == penalized


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("graphs", [True, False])
def test_prompt_lookup_matches_generate(cuda_model, attn, graphs, monkeypatch):
    """Verify forwards of many tokens per stream, replayed per bucket of fed tokens or eager, on both paths."""
    if cuda_model.config.model_type == "qwen3_5_text":
        pytest.skip("recurrent layers are refused with prompt lookup (tests/decoding/test_speculation.py)")
    prompts = _prompts(7, 12)
    free = [generate_alone(cuda_model, p, 16, None) for p in prompts]
    eos = sorted({free[0][4], free[-1][9]})
    want = [generate_alone(cuda_model, p, 16, eos) for p in prompts]
    Oracle(prompts, free, every=4).install(monkeypatch)
    got = generate_tokens(cuda_model, prompts, max_new_tokens=16, eos_token_id=eos, prompt_lookup_num_tokens=6,
                          attn=attn, cuda_graphs=graphs)  # fmt: skip
    assert got == want


def test_a_second_identical_call_with_drafts_captures_no_graph(monkeypatch):
    """Verify forwards of each bucket of fed tokens are captured once: a second identical call in a Session replays
    them all (a capture inside a timed call would cost it a forward's warm-up and the graph's instantiation)."""
    model = tiny_model("llama").cuda()
    prompts = _prompts(11, 10)
    free = [generate_alone(model, p, 16, None) for p in prompts]
    Oracle(prompts, free, every=5).install(monkeypatch)
    options = dict(max_new_tokens=16, eos_token_id=[], prompt_lookup_num_tokens=6, attn="triton")
    with Session(model) as session:
        calls = [stream_tokens(model, prompts, session=session, **options) for _ in range(2)]
        answers = [dict(call) for call in calls]
    assert answers[0] == answers[1] == dict(enumerate(free))
    assert calls[0].stats.captures > 0 and calls[1].stats.captures == 0


def _every_block_masked(query, key, tiles, own):
    from hf_parallel.attention import launcher

    default = (launcher.own_launch_config if own else launcher.default_config)(query, key, tiles)
    return dataclasses.replace(default, whole_blocks=False)


@pytest.mark.usefixtures("no_tf32")
def test_every_ablation_answers_as_generate_and_replays_only_rounds_of_its_own():
    """Each `Tuning` choice turned off, and a launch config of its own, give model.generate's tokens through captured
    rounds; in one Session each captures rounds of its own (a kept row never replays a round recorded under another
    choice), and the default's second call captures none."""
    from hf_parallel import TritonBackend

    model = tiny_model("llama").cuda()
    prompts = _prompts(13, 20, doc_len=200)  # a prefill wider than MOST_ROWS: its q, k and v in columns or not
    want = [generate_alone(model, p, 8, None) for p in prompts]
    options = dict(max_new_tokens=8, eos_token_id=[], attn="triton")
    ablations = [dict(tuning=Tuning(**{f.name: False})) for f in dataclasses.fields(Tuning)]
    ablations.append(dict(attn=TritonBackend(own_tiles="overlap", launch_config=_every_block_masked)))
    captured = []
    with Session(model) as session:
        for ablation in [{}, *ablations, {}]:
            call = stream_tokens(model, prompts, session=session, **{**options, **ablation})
            got = dict(call)
            assert [got[i] for i in range(len(prompts))] == want, ablation
            captured.append(call.stats.captures)
    assert all(captured[:-1]) and captured[-1] == 0, captured


def test_index_copy_writes_launch_no_triton_write():
    """`Tuning(triton_writes=False)`: the cache's K/V written by `index_copy_`, no `write_slots` kernel launched."""
    model = tiny_model("llama").cuda()

    def kernels(**options) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            generate_tokens(model, _prompts(14, 3), max_new_tokens=4, eos_token_id=[], cuda_graphs=False, **options)
        return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}

    assert any("write_slots" in name for name in kernels())
    assert not any("write_slots" in name for name in kernels(tuning=Tuning(triton_writes=False)))
