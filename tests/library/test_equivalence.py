"""The core contract: fp32 greedy `generate_tokens` == plain `model.generate` per prompt alone."""

from __future__ import annotations

import pytest
import torch

from hf_parallel import generate_tokens
from hf_parallel.frontends.generate import generate_layout
from hf_parallel.row.layout import build_layout
from tests.helpers.models import generate_alone, random_tokens

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

NEW = 8


def _check(model, prompts, max_new_tokens=NEW, eos=(), **options):
    got = generate_tokens(model, prompts, max_new_tokens=max_new_tokens, eos_token_id=list(eos), **options)
    want = [generate_alone(model, p, max_new_tokens, list(eos) or None) for p in prompts]
    assert got == want
    return got


def _doc_questions(gen, n_questions, doc_len=30, lengths=None):
    doc = random_tokens(doc_len, gen)
    lengths = lengths or [1 + (i * 5) % 9 for i in range(n_questions)]
    return [doc + random_tokens(n, gen) for n in lengths]


@pytest.mark.parametrize("n_questions", [1, 2, 17])
def test_one_document_many_questions(arch_model, n_questions):
    gen = torch.Generator().manual_seed(n_questions)
    _check(arch_model, _doc_questions(gen, n_questions))


def test_one_token_questions_and_duplicates(arch_model):
    gen = torch.Generator().manual_seed(7)
    prompts = _doc_questions(gen, 4, lengths=[1, 1, 6, 2])
    prompts += [prompts[0], prompts[2]]
    _check(arch_model, prompts)


def test_several_documents_and_shared_system_prefix(arch_model):
    gen = torch.Generator().manual_seed(3)
    system = random_tokens(6, gen)
    docs = [random_tokens(n, gen) for n in (14, 21, 9)]
    prompts = [system + d + random_tokens(q, gen) for d in docs for q in (1, 4, 7)]
    other_root = random_tokens(11, gen)  # a second root: a document with no shared system prompt
    prompts += [other_root + random_tokens(3, gen), other_root + random_tokens(5, gen)]
    _check(arch_model, prompts)


def test_dialogue_turns_extend_each_other(arch_model):
    gen = torch.Generator().manual_seed(5)
    turn = random_tokens(20, gen)
    prompts = []
    for _ in range(4):  # each prompt is a prefix of the next one
        turn = turn + random_tokens(3, gen)
        prompts.append(turn)
    _check(arch_model, prompts)


def test_streams_stop_at_eos_at_different_steps(arch_model):
    gen = torch.Generator().manual_seed(11)
    prompts = _doc_questions(gen, 6)
    free = [generate_alone(arch_model, p, 12, None) for p in prompts]
    eos = {free[0][1], free[3][4], free[5][7]}  # tokens the model does emit: streams end early, at different steps
    got = _check(arch_model, prompts, max_new_tokens=12, eos=sorted(eos))
    lengths = {len(g) for g in got}
    assert len(lengths) >= 2, "the test should make streams stop at different steps"
    assert any(g[-1] in eos for g in got)


def test_stopped_streams_kept_until_the_bucket_shrinks(llama, monkeypatch):
    """The captured rounds' policy (stopped streams decode on, unrecorded, until the live ones fit a smaller
    bucket) run through eager rounds on the CPU: the answers must still be each question's own."""
    monkeypatch.setattr("hf_parallel.runner.model_runner.ModelRunner.captures", property(lambda self: True))
    gen = torch.Generator().manual_seed(12)
    prompts = _doc_questions(gen, 9)
    free = [generate_alone(llama, p, 12, None) for p in prompts]
    eos = {free[i][i % 10] for i in range(len(prompts))}  # most streams stop, at different steps
    got = _check(llama, prompts, max_new_tokens=12, eos=sorted(eos))
    assert len({len(g) for g in got}) >= 3, "the test should make streams stop at several different steps"


def test_min_new_tokens_delays_eos(llama):
    gen = torch.Generator().manual_seed(12)
    prompts = _doc_questions(gen, 3)
    free = [generate_alone(llama, p, 10, None) for p in prompts]
    eos = [free[0][0]]
    got = generate_tokens(llama, prompts, max_new_tokens=10, min_new_tokens=4, eos_token_id=eos)
    ids = [torch.tensor([p]) for p in prompts]
    want = [llama.generate(i, attention_mask=torch.ones_like(i), max_new_tokens=10, min_new_tokens=4,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)[0, i.shape[1]:].tolist()
            for i in ids]  # fmt: skip
    assert got == want
    assert all(len(g) >= 4 for g in got)


def test_interleaved_layout_gives_the_same_tokens(llama):
    """The reference paper's layout (answers interleaved step by step), a benchmark ablation (`generate_layout`)."""
    gen = torch.Generator().manual_seed(13)
    prompts = _doc_questions(gen, 5)
    layout = build_layout(prompts, NEW, interleaved=True)
    got = generate_layout(llama, layout, max_new_tokens=NEW, eos_token_id=[], attn="reference")
    assert got == [generate_alone(llama, p, NEW, None) for p in prompts]


def test_small_prefill_chunks_give_the_same_tokens(llama):
    gen = torch.Generator().manual_seed(14)
    _check(llama, _doc_questions(gen, 5), prefill_chunk=7)


def test_buckets_pad_little_past_the_weight_bound_sizes():
    """A captured round runs `bucket(n)` tokens for n fed: powers of two up to FINE_BUCKETS (the GEMMs read the
    weights either way), then also 3/4 of one (96, 192, ...), so a large round pads at most a third of its tokens."""
    from hf_parallel.runner.graphs import FINE_BUCKETS, bucket

    sizes = [bucket(n) for n in range(1, 5000)]
    assert all(b >= n for n, b in enumerate(sizes, 1))
    assert all(b & (b - 1) == 0 for b in sizes[:FINE_BUCKETS])
    assert all((b - n) * 3 <= b for n, b in enumerate(sizes, 1) if n > FINE_BUCKETS)
    assert len(set(sizes)) <= 2 * 13  # few captures: two per doubling at most
