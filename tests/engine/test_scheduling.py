"""Work past one row's memory: a budget that holds a fraction of the workload changes no answer, with continuous
refill or static waves, on the reference and Triton paths and for recurrent layers; answers stream as they
finish; nothing of a call outlives it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hf_parallel import Session, generate_tokens, stream_tokens
from hf_parallel.decoding.sizes import parse_memory
from hf_parallel.row.cache import PackedCache
from hf_parallel.row.layout import build_layout
from tests.helpers.models import generate_alone, random_tokens, tiny_model
from tests.helpers.prompts import corpus
from tests.helpers.sizing import max_memory_for

NEW, CHUNK = 10, 16


def expected(model, prompts, eos):
    return [generate_alone(model, p, NEW, eos) for p in prompts]


@pytest.mark.parametrize("refill", [True, False])
@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_a_budget_of_a_quarter_of_the_work_changes_no_answer(arch, refill):
    model = tiny_model(arch)
    prompts = corpus(0)
    free = [generate_alone(model, p, NEW) for p in prompts]
    eos = sorted({free[0][2], free[7][5], free[13][1], free[20][8]})  # streams stop at many different steps
    capacity = 80
    assert build_layout(prompts, NEW).num_slots >= 4 * capacity  # at least four rows' worth
    got = generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=eos, prefill_chunk=CHUNK,
                          max_memory=max_memory_for(model, capacity), refill=refill)  # fmt: skip
    assert got == expected(model, prompts, eos)


def test_a_document_admitted_into_the_last_room_does_not_take_its_questions_one_at_a_time(llama):
    """The second document first fits in the row's last room with one question; once the first document's
    streams finish, its other questions take the freed room, wherever it lies, not the one region after it
    in turn.  Each document's questions fit the row together, so about one answer length of forwards per
    document, and one more for admissions, is what filling the row takes."""
    gen = torch.Generator().manual_seed(6)
    prompts = [doc + random_tokens(3, gen) for doc in (random_tokens(20, gen) for _ in range(4)) for _ in range(8)]
    one_document = build_layout(prompts[:8], NEW).num_slots
    capacity = one_document + 20 + 3 + NEW + 5  # the first document's questions, and one of the second's
    forwards = [0]
    hook = llama.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        got = generate_tokens(llama, prompts, max_new_tokens=NEW, eos_token_id=[], prefill_chunk=64,
                              max_memory=max_memory_for(llama, capacity, 64))  # fmt: skip
    finally:
        hook.remove()
    assert got == expected(llama, prompts, [])
    assert forwards[0] <= (4 + 1) * NEW


def test_triton_path_with_refill():
    """The Triton kernel (its interpreter on the CPU) over a refilled row: prompts admitted while others decode."""
    model = tiny_model("qwen2").to("cuda" if torch.cuda.is_available() else "cpu")
    prompts = corpus(1, docs=2, questions=4)
    capacity = 60
    assert build_layout(prompts, NEW).num_slots >= 2 * capacity  # two rows' worth at least
    eos = [generate_alone(model, prompts[1], NEW)[3]]
    call = stream_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=eos, prefill_chunk=CHUNK, attn="triton",
                         max_memory=max_memory_for(model, capacity))  # fmt: skip
    got = dict(call)
    assert [got[i] for i in range(len(prompts))] == expected(model, prompts, eos)
    assert call.stats.refills  # some prompts were admitted beside live streams


@pytest.mark.parametrize("refill", [True, False])
def test_recurrent_layers_are_refilled_or_run_in_waves(refill):
    model = tiny_model("qwen3_5_text")
    prompts = corpus(2, docs=4, questions=3)
    eos = [generate_alone(model, prompts[0], NEW)[4]]
    got = generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=eos, prefill_chunk=CHUNK,
                          max_memory=max_memory_for(model, 70), refill=refill)  # fmt: skip
    assert got == expected(model, prompts, eos)


def test_answers_stream_as_they_finish(llama):
    prompts = corpus(3, docs=3, questions=4)
    free = [generate_alone(llama, p, NEW) for p in prompts]
    eos = [free[5][1], free[9][6]]
    streamed = list(stream_tokens(llama, prompts, max_new_tokens=NEW, eos_token_id=eos, prefill_chunk=CHUNK,
                                  max_memory=max_memory_for(llama, 60)))  # fmt: skip
    assert sorted(i for i, _ in streamed) == list(range(len(prompts)))
    assert dict(streamed) == dict(enumerate(expected(llama, prompts, eos)))
    lengths = [len(tokens) for _, tokens in streamed]
    assert lengths != sorted(lengths, reverse=True) or len(set(lengths)) > 1  # finished ones came first


def test_a_prompt_larger_than_the_budget_names_what_fits(llama):
    prompts = [random_tokens(150, torch.Generator().manual_seed(4))]
    with pytest.raises(ValueError, match=r"prompt 0 needs 160 slots .* holds \d+ tokens of K/V"):
        generate_tokens(llama, prompts, max_new_tokens=NEW, prefill_chunk=CHUNK, max_memory=max_memory_for(llama, 100))


@pytest.mark.parametrize("value, error, match", [
    ("lots", ValueError, "is not a size"), (-5, ValueError, "must be positive"), (2.5, TypeError, "max_memory must be"),
])  # fmt: skip
def test_bad_max_memory_is_named(llama, value, error, match):
    with pytest.raises(error, match=match):
        generate_tokens(llama, [[3, 4]], max_new_tokens=2, max_memory=value)


def test_memory_sizes_parse():
    assert parse_memory("40GiB") == 40 * 2**30 and parse_memory("500 MB") == 500 * 10**6 and parse_memory(7) == 7


def test_nothing_of_a_call_outlives_it(llama):
    """No reference cycle keeps a call's cache (or anything holding it) alive: it goes with the call, no gc."""
    prompts = corpus(5, docs=2, questions=3)
    gc.collect()
    gc.disable()
    try:
        assert not _caches()
        generate_tokens(llama, prompts, max_new_tokens=4, eos_token_id=[])
        generate_tokens(llama, prompts, max_new_tokens=4, eos_token_id=[], max_memory=max_memory_for(llama, 50),
                        prefill_chunk=CHUNK)  # fmt: skip
        assert not _caches()  # a cache in a reference cycle would be left for the (disabled) collector
    finally:
        gc.enable()


def _caches() -> list[PackedCache]:
    """The packed caches alive now (those the garbage collector tracks: every instance)."""
    return [o for o in gc.get_objects() if issubclass(type(o), PackedCache)]  # type(): no proxy asked its class


def test_a_session_keeps_nothing_off_cuda_and_releases(llama):
    with Session(llama) as session:
        assert session.generate_tokens([[3, 4, 5]], max_new_tokens=3, eos_token_id=[]) == [
            generate_alone(llama, [3, 4, 5], 3)
        ]
        assert session.row is None  # rows are kept for captured rounds, on CUDA only


class _Kept:
    """A logits processor that changes nothing: a call's options hold it."""

    def __call__(self, input_ids, scores):
        return scores


@pytest.mark.parametrize("memory", [None, 60])
def test_nothing_holds_a_calls_options_after_it(llama, memory):
    """No reference cycle keeps a call's options (and the tensors generate prepared in them) alive after it returns,
    with no gc: its requests let go of their streams once they leave the row."""
    processor = _Kept()
    ref = weakref.ref(processor)
    prompts = corpus(6, docs=2, questions=3)
    options = dict(max_new_tokens=4, eos_token_id=[], logits_processor=[processor])
    if memory:
        options.update(max_memory=max_memory_for(llama, memory), prefill_chunk=CHUNK)
    gc.collect()
    gc.disable()
    try:
        got = generate_tokens(llama, prompts, **options)
        del processor, options
        assert ref() is None
    finally:
        gc.enable()
    assert got == [generate_alone(llama, p, 4) for p in prompts]
