"""Calls on one model from several threads at once: every answer is its call's alone, and the model is restored.

hf_parallel sets the model up for a call (its attention implementation, plan hooks, segmented mixers) and takes
it back after; calls on one model are serialized, so none sees another's set-up or row.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hf_parallel import Session, generate_parallel, generate_tokens, stream_tokens
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.models import generate_alone, random_tokens, tiny_model
from tests.helpers.sizing import max_memory_for

THREADS = 8


def _calls(model, tokenizer) -> list:
    """Eight calls of different kinds, prompt sets and options: (name, function of no arguments)."""
    gen = torch.Generator().manual_seed(21)
    docs = [random_tokens(n, gen) for n in (30, 24, 41)]
    sets = [[doc + random_tokens(k, gen) for k in (1, 3, 5, 2)[: 2 + i % 3]] for i, doc in enumerate(docs * 2)]
    budget = max_memory_for(model, 80)  # a row of 80 slots: the "budget" call refills it (or runs waves)
    calls = [
        ("greedy", lambda: generate_tokens(model, sets[0], max_new_tokens=6, eos_token_id=[])),
        ("eos", lambda: generate_tokens(model, sets[1], max_new_tokens=8, eos_token_id=[sets[1][0][3]])),
        ("penalty", lambda: generate_tokens(model, sets[2], max_new_tokens=5, repetition_penalty=1.3)),
        ("sampled", lambda: generate_tokens(model, sets[3], max_new_tokens=5, do_sample=True, top_k=20, seed=3)),
        ("chunks", lambda: generate_tokens(model, sets[4], max_new_tokens=4, prefill_chunk=7, eos_token_id=[])),
        ("budget", lambda: generate_tokens(model, sets[5] * 3, max_new_tokens=6, max_memory=budget, prefill_chunk=16)),
        ("stream", lambda: sorted(stream_tokens(model, sets[0] + sets[2], max_new_tokens=3, eos_token_id=[]))),
        ("text", lambda: generate_parallel(model, tokenizer, "a short document", ["first?", "second?"],
                                           max_new_tokens=4)),
    ]  # fmt: skip
    return calls


def _run_together(calls) -> dict:
    """Each call on a thread of its own, all released at once; name -> result (or the exception raised)."""
    start, results = threading.Barrier(len(calls)), {}

    def run(name, call):
        start.wait()
        try:
            results[name] = call()
        except Exception as error:  # noqa: BLE001 - reported by the test
            results[name] = error

    threads = [threading.Thread(target=run, args=call) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_calls_from_eight_threads_each_answer_as_alone(arch):
    model, fresh = tiny_model(arch), tiny_model(arch)
    calls = _calls(model, char_tokenizer())
    alone = {name: call() for name, call in calls}  # each call made alone, one after another
    for _ in range(2):
        assert _run_together(calls) == alone
    ids = torch.tensor([random_tokens(12, torch.Generator().manual_seed(5))])
    assert generate_alone(model, ids[0].tolist(), 6) == generate_alone(fresh, ids[0].tolist(), 6)
    assert model.config._attn_implementation == fresh.config._attn_implementation


def test_a_session_serves_several_threads(llama):
    gen = torch.Generator().manual_seed(8)
    sets = [[random_tokens(20, gen) + random_tokens(k, gen) for k in (2, 4)] for _ in range(THREADS)]
    alone = [[generate_alone(llama, p, 5) for p in prompts] for prompts in sets]
    with Session(llama) as session:
        calls = [
            (i, lambda p=p: session.generate_tokens(p, max_new_tokens=5, eos_token_id=[])) for i, p in enumerate(sets)
        ]
        got = _run_together(calls)
    assert [got[i] for i in range(THREADS)] == alone


def test_an_open_stream_holds_the_model_until_it_is_closed(llama):
    """A stream being read keeps the model set up for it; another thread's call waits for it to end, and a stream
    dropped half read lets the others go on."""
    gen = torch.Generator().manual_seed(9)
    prompts = [random_tokens(15, gen) + random_tokens(k, gen) for k in (1, 2, 3)]
    stream = stream_tokens(llama, prompts, max_new_tokens=4, eos_token_id=[])
    next(stream)  # the call is under way: its row is set up
    other = threading.Thread(target=lambda: done.append(generate_tokens(llama, prompts[:1], max_new_tokens=4)))
    done: list = []
    other.start()
    other.join(timeout=2)
    assert other.is_alive() and not done  # waits for the stream
    stream.close()
    other.join(timeout=60)
    assert done == [[generate_alone(llama, prompts[0], 4)]]
