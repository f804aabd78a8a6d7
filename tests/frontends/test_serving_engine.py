"""The serving engine: requests that join a live row while it decodes, each answered as if alone.

Every answer is compared with plain `model.generate` on its prompt alone (fp32, greedy, tiny models on the
CPU), whatever else shares the row and whenever it arrives; the sharing, the retained prefixes, cancellation
and failures are checked through the engine's counters and events.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers.generation import LogitsProcessor

from hf_parallel.frontends.probe import check_support
from hf_parallel.frontends.serving import Engine, QueueFull
from hf_parallel.runner.sizing import size_row
from tests.helpers.models import generate_alone, random_tokens, tiny_model
from tests.helpers.prompts import prompts_with_repeats
from tests.helpers.serving import TIMEOUT, Collector
from tests.helpers.speculation import Oracle

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

CHUNK = 16


def engine_for(model, capacity: int, max_streams: int = 256, **options) -> Engine:
    """An engine whose row holds `capacity` slots (the least memory that does) and prefills `CHUNK` tokens a
    forward."""
    support, lo, hi = check_support(model), 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            fits = size_row(model, support, CHUNK, mid, max_streams).capacity >= capacity
        except ValueError:
            fits = False
        lo, hi = (lo, mid) if fits else (mid + 1, hi)
    options.setdefault("prefill_chunk", CHUNK)
    return Engine(model, max_memory=lo, max_streams=max_streams, **options)


def questions_about_one_document(seed: int, n: int, doc_len: int, question_len: int) -> list[list[int]]:
    """n prompts: one random document of `doc_len` tokens, each with a random question of `question_len`."""
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(doc_len, gen)
    return [doc + random_tokens(question_len, gen) for _ in range(n)]


def _wait_idle(engine: Engine) -> None:
    assert engine.wait_idle(TIMEOUT)


def _answers_as_generate(engine: Engine, model, prompt: list[int], max_new_tokens: int) -> None:
    """A greedy request sent after whatever failed before it: its tokens are `model.generate`'s alone."""
    c = Collector()
    engine.submit(prompt, dict(max_new_tokens=max_new_tokens, eos_token_id=[]), 1, c)
    c.wait()
    engine.wait_idle(TIMEOUT)
    assert c.tokens[0] == generate_alone(model, prompt, max_new_tokens, eos=[])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_requests_arriving_over_time_are_each_answered_as_alone(model):
    """32 requests about 4 documents, shuffled and arriving over time with different lengths, limits, EOS and
    options: each equals model.generate alone, and each document is computed once while it stays resident."""
    gen, rng = torch.Generator().manual_seed(1), random.Random(2)
    docs = [random_tokens(n, gen) for n in (40, 33, 52, 27)]
    jobs = []
    for i in range(32):
        prompt = docs[i % 4] + random_tokens(2 + i % 5, gen)
        eos = [prompt[-1]] if i % 3 == 0 else []
        jobs.append((prompt, 3 + i % 6, eos))
    rng.shuffle(jobs)
    expected = [generate_alone(model, p, m, eos=e) for p, m, e in jobs]
    engine = engine_for(model, 600, max_streams=12)
    try:
        collectors = []
        for prompt, max_new, eos in jobs:
            collectors.append(Collector())
            engine.submit(prompt, dict(max_new_tokens=max_new, eos_token_id=eos), 1, collectors[-1])
            time.sleep(rng.random() * 0.004)
        answers = [c.wait().tokens[0] for c in collectors]
        _wait_idle(engine)
        counters = engine.counters
    finally:
        engine.close(10)
    assert answers == expected
    assert counters.prompt_tokens == sum(len(p) for p, _, _ in jobs)
    assert counters.computed_tokens < counters.prompt_tokens - 2 * sum(len(d) for d in docs)  # documents shared


def test_options_differ_by_request_in_one_row(model):
    """Greedy, repetition penalty, no-repeat n-grams, min_new_tokens and n > 1 in one row, each as generate."""
    prompts = questions_about_one_document(seed=3, n=5, doc_len=45, question_len=3)
    options = [
        dict(max_new_tokens=6, eos_token_id=[]),
        dict(max_new_tokens=5, repetition_penalty=1.5, eos_token_id=[]),
        dict(max_new_tokens=7, no_repeat_ngram_size=2, eos_token_id=[]),
        dict(max_new_tokens=4, min_new_tokens=3, eos_token_id=[prompts[3][-2]]),
        dict(max_new_tokens=5, eos_token_id=[]),
    ]
    expected = []
    for prompt, opts in zip(prompts, options):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **opts)
        expected.append(out[0, len(prompt) :].tolist())
    engine = engine_for(model, 400)
    try:
        collectors = [Collector() for _ in prompts]
        for prompt, opts, c, n in zip(prompts, options, collectors, (1, 1, 1, 1, 3)):
            engine.submit(prompt, opts, n, c)
        got = [c.wait().tokens for c in collectors]
    finally:
        engine.close(10)
    assert [g[0] for g in got] == expected
    assert got[4] == {0: expected[4], 1: expected[4], 2: expected[4]}  # n streams over one stored prompt


def test_finished_prefixes_stay_resident_and_the_least_recently_used_go_first(model):
    """A document's second request after its first finished finds it resident (usage's cached tokens); with a row
    for two documents, a third evicts the least recently used one."""
    gen = torch.Generator().manual_seed(4)
    docs = [random_tokens(60, gen) for _ in range(3)]
    engine = engine_for(model, 150, max_streams=4)
    try:

        def ask(doc):
            prompt = doc + random_tokens(3, gen)
            c = Collector()
            engine.submit(prompt, dict(max_new_tokens=4, eos_token_id=[]), 1, c)
            c.wait()
            _wait_idle(engine)
            assert c.tokens[0] == generate_alone(model, prompt, 4, eos=[])
            return c.cached

        assert ask(docs[0]) == 0
        assert ask(docs[0]) == 60  # retained
        assert ask(docs[1]) == 0
        assert ask(docs[0]) == 60  # docs[0] is now the most recently used
        assert ask(docs[2]) == 0  # needs room: docs[1], the least recently used, goes
        assert ask(docs[0]) == 60
        assert ask(docs[1]) == 0
    finally:
        engine.close(10)


def test_without_retention_nothing_stays(model):
    gen = torch.Generator().manual_seed(5)
    doc = random_tokens(30, gen)
    engine = engine_for(model, 200, retain=False)
    try:
        cached = []
        for _ in range(2):
            c = Collector()
            engine.submit(doc + random_tokens(2, gen), dict(max_new_tokens=3, eos_token_id=[]), 1, c)
            cached.append(c.wait().cached)
            _wait_idle(engine)
        assert cached == [0, 0] and engine.counters.resident_slots == 0
    finally:
        engine.close(10)


def test_a_cancelled_request_leaves_and_its_room_comes_back(model):
    """Requests cancelled while queued, while their prompt is written and while decoding leave the row; the
    others are exact, and the row holds only retained prefixes after."""
    prompts = questions_about_one_document(seed=6, n=6, doc_len=50, question_len=4)
    engine = engine_for(model, 2000, max_streams=3, prefill_chunk=8)
    try:
        collectors = [Collector() for _ in prompts]
        requests = [engine.submit(p, dict(max_new_tokens=40, eos_token_id=[]), 1, c)
                    for p, c in zip(prompts, collectors)]  # fmt: skip
        requests[5].cancel()  # queued
        requests[0].cancel()  # being written or decoding
        while "tokens" not in collectors[1].events:
            time.sleep(0.001)
        requests[1].cancel()  # decoding
        engine.wake()
        for c in collectors[2:5]:
            c.wait()
        _wait_idle(engine)
        counters = engine.counters
        assert counters.live_streams == 0 and counters.queued == 0
        assert counters.resident_slots == counters.retained_slots  # no answer region left behind
        for i in (2, 3, 4):
            assert collectors[i].tokens[0] == generate_alone(model, prompts[i], 40, eos=[])
        for i in (0, 1, 5):
            assert "done" not in collectors[i].events
    finally:
        engine.close(10)


class Raising(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise RuntimeError("injected")


def test_a_failing_request_fails_alone(model):
    """A request whose logits processor raises gets an error; the requests beside it in the row are exact, and
    the engine serves the next ones."""
    prompts = questions_about_one_document(seed=7, n=3, doc_len=30, question_len=3)
    engine = engine_for(model, 400)
    try:
        collectors = [Collector() for _ in prompts]
        engine.submit(prompts[0], dict(max_new_tokens=5, eos_token_id=[]), 1, collectors[0])
        engine.submit(prompts[1], dict(max_new_tokens=5, logits_processor=[Raising()]), 2, collectors[1])
        engine.submit(prompts[2], dict(max_new_tokens=6, eos_token_id=[]), 1, collectors[2])
        for c in collectors:
            c.wait()
        engine.wait_idle(TIMEOUT)
        assert isinstance(collectors[1].error, RuntimeError) and "injected" in str(collectors[1].error)
        assert collectors[0].tokens[0] == generate_alone(model, prompts[0], 5, eos=[])
        assert collectors[2].tokens[0] == generate_alone(model, prompts[2], 6, eos=[])
        _answers_as_generate(engine, model, prompts[1], 4)
    finally:
        engine.close(10)


def test_a_failing_forward_fails_the_row_and_the_engine_goes_on(model, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    prompt = random_tokens(20, gen)
    engine = engine_for(model, 300)
    try:
        calls = {"n": 0}
        runner = engine.core.runner
        forward = runner.forward

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("device lost")
            return forward(*args, **kwargs)

        monkeypatch.setattr(runner, "forward", failing)
        first = Collector()
        engine.submit(prompt, dict(max_new_tokens=5, eos_token_id=[]), 1, first)
        assert "device lost" in str(first.wait().error)
        _answers_as_generate(engine, model, prompt, 5)
    finally:
        engine.close(10)


def test_bad_requests_are_refused_alone(model):
    gen = torch.Generator().manual_seed(9)
    engine = engine_for(model, 100)
    try:
        cases = [
            ([], {}),
            ([500], {}),  # outside the vocabulary
            (random_tokens(20, gen), dict(max_new_tokens=200)),  # more than the row holds
            (random_tokens(20, gen), dict(num_beams=2)),
            (random_tokens(20, gen), dict(no_such_option=1)),
        ]
        for prompt, options in cases:
            c = Collector()
            engine.submit(prompt, options, 1, c)
            assert isinstance(c.wait().error, (ValueError, TypeError, NotImplementedError)), (prompt, options)
        _answers_as_generate(engine, model, random_tokens(10, gen), 3)
    finally:
        engine.close(10)


def test_a_full_queue_refuses_and_the_model_is_free_when_idle(model):
    """With one stream decoding and the queue full, a request is refused at once (`QueueFull`); once idle, the
    model generates as a fresh one."""
    gen = torch.Generator().manual_seed(10)
    fresh = tiny_model("llama")
    prompt = random_tokens(12, gen)
    engine = engine_for(model, 200, max_streams=1, max_queue=2)
    try:
        first = Collector()
        engine.submit(prompt, dict(max_new_tokens=150, eos_token_id=[]), 1, first)
        while "start" not in first.events:
            time.sleep(0.001)
        waiting = [Collector(), Collector()]
        for c in waiting:
            engine.submit(prompt, dict(max_new_tokens=3, eos_token_id=[]), 1, c)
        with pytest.raises(QueueFull):
            engine.submit(prompt, dict(max_new_tokens=3, eos_token_id=[]), 1, Collector())
        for c in [first, *waiting]:
            c.wait()
        _wait_idle(engine)
        assert generate_alone(model, prompt, 5) == generate_alone(fresh, prompt, 5)
        assert model.config._attn_implementation == fresh.config._attn_implementation
    finally:
        engine.close(10)


def test_a_high_priority_request_behind_a_queue_is_admitted_first(model):
    """With priority scheduling and one stream at a time, a request of priority -1 that arrives behind three of
    priority 0 starts before them (those keep their order); every answer is model.generate's alone.  The same
    priority on a first-come-first-served engine is refused by name."""
    gen = torch.Generator().manual_seed(11)
    prompts = [random_tokens(10 + i, gen) for i in range(5)]
    started: list[int] = []
    engine = engine_for(model, 200, max_streams=1, scheduling="priority")
    try:
        collectors = []
        for i, (prompt, priority) in enumerate(zip(prompts, [0, 0, 0, 0, -1])):
            collectors.append(Collector())

            def on_event(kind, value, i=i, c=collectors[-1]):
                if kind == "start":
                    started.append(i)
                c(kind, value)

            engine.submit(prompt, dict(max_new_tokens=40 if i == 0 else 4, eos_token_id=[]), 1, on_event, priority)
            while i == 0 and not started:  # the first one holds the row while the others queue
                time.sleep(0.001)
        answers = [c.wait().tokens[0] for c in collectors]
        _wait_idle(engine)
    finally:
        engine.close(10)
    assert started == [0, 4, 1, 2, 3]
    assert answers == [generate_alone(model, p, 40 if i == 0 else 4, eos=[]) for i, p in enumerate(prompts)]
    fcfs = engine_for(model, 200, max_streams=1)
    try:
        refused = Collector()
        fcfs.submit(prompts[0], dict(max_new_tokens=2), 1, refused, priority=-1)
        assert "scheduling='priority'" in str(refused.wait().error)
    finally:
        fcfs.close(10)


def test_greedy_streams_of_many_requests_choose_in_one_pass(model):
    """Requests that need only argmax and EOS share one group of rows once started (one pass a round, not one per
    request); a request with a processor keeps its own."""
    from hf_parallel.engine.groups import GreedyGroup

    prompts = questions_about_one_document(seed=11, n=7, doc_len=30, question_len=3)
    engine = engine_for(model, 800)
    try:
        collectors = [Collector() for _ in prompts]
        for i, (prompt, c) in enumerate(zip(prompts, collectors)):
            options = dict(max_new_tokens=60, eos_token_id=[])
            engine.submit(prompt, {**options, **({"repetition_penalty": 1.2} if i == 6 else {})}, 1, c)
        while not all(len(c.tokens.get(0, [])) >= 3 for c in collectors):
            time.sleep(0.001)
        kinds = sorted(type(g).__name__ for g in list(engine.core.scheduler.groups))
        pool = next(g for g in engine.core.scheduler.groups if isinstance(g, GreedyGroup))
        assert kinds == ["GreedyGroup", "ProcessedGroup"] and len(pool.streams) == 6
        for c in collectors:
            c.wait()
        engine.wait_idle(TIMEOUT)
        for prompt, c in zip(prompts[:6], collectors):
            assert c.tokens[0] == generate_alone(model, prompt, 60, eos=[])
    finally:
        engine.close(10)


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_models_with_recurrent_layers_are_served_as_alone(arch):
    """A hybrid model's requests, arriving over time and sharing a document: each stream carries its own
    recurrent state (a lane of the pool), each answer is model.generate's alone."""
    hybrid = tiny_model(arch)
    gen = torch.Generator().manual_seed(13)
    doc = random_tokens(24, gen)
    prompts = [doc + random_tokens(2 + i % 3, gen) for i in range(6)] + [random_tokens(9, gen)]
    want = [generate_alone(hybrid, p, 4 + i % 4, eos=[]) for i, p in enumerate(prompts)]
    engine = engine_for(hybrid, 400, max_streams=4)
    try:
        collectors = []
        for i, prompt in enumerate(prompts):
            collectors.append(Collector())
            engine.submit(prompt, dict(max_new_tokens=4 + i % 4, eos_token_id=[]), 1, collectors[-1])
            if i == 3:
                collectors[0].wait()  # later requests join a row that is decoding
        assert [c.wait().tokens[0] for c in collectors] == want
    finally:
        engine.close(10)


def test_rounds_record_no_autograd_graph(model):
    """The engine's forwards run in inference mode: no activations kept for a backward pass."""
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    engine = engine_for(model, 200)
    try:
        c = Collector()
        engine.submit(random_tokens(20, torch.Generator().manual_seed(12)), dict(max_new_tokens=3), 1, c)
        c.wait()
    finally:
        engine.close(10)
        handle.remove()
    assert seen and all(seen)


def test_prompt_lookup_in_a_live_row_matches_generate(monkeypatch):
    """The engine's default drafts (`prompt_lookup_num_tokens`), a request's own (another k, or none), streams of
    requests arriving while others draft: each answer is model.generate's alone, in fewer forwards than tokens."""
    model = tiny_model("qwen2")
    prompts = prompts_with_repeats(3, questions=6)
    limits = [10 + i % 5 for i in range(len(prompts))]
    free = [generate_alone(model, p, 16) for p in prompts]
    eos = [free[2][6]]
    want = [generate_alone(model, p, n, eos=eos) for p, n in zip(prompts, limits)]
    Oracle(prompts, free, every=4).install(monkeypatch)
    engine = engine_for(model, 600, prompt_lookup_num_tokens=5)
    try:
        collectors = []
        for i, (prompt, n) in enumerate(zip(prompts, limits)):
            own = {1: {"prompt_lookup_num_tokens": 3}, 4: {"prompt_lookup_num_tokens": None}}.get(i, {})
            collectors.append(Collector())
            engine.submit(prompt, dict(max_new_tokens=n, eos_token_id=eos, **own), 1, collectors[-1])
            if i == 2:
                collectors[0].wait()  # later requests join a row whose streams draft
        assert [c.wait().tokens[0] for c in collectors] == want
        stats = engine.core.stats
        assert stats.tokens >= 2 * stats.stream_forwards  # drafts were accepted
    finally:
        engine.close(10)
