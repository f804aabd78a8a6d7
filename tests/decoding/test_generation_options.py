"""Every `model.generate` option but beam search, against `model.generate` on each prompt alone.

Prompts of different lengths share a document, so the streams' histories differ in length at every step.
Greedy options must give generate's tokens; sampling options generate's processed distribution for each
stream's own history at every step (samples themselves cannot match: generate draws one prompt at a time).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_parallel import generate_parallel, generate_tokens, stream_tokens
from hf_parallel.decoding import logits, sampling
from hf_parallel.decoding.logits import StreamProcessors
from hf_parallel.decoding.options import GenerationOptions
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.generation import BanRecent, StopAfterRepeat, alone, generate_processors, model_with
from tests.helpers.models import random_tokens

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

NEW = 10
EOS = 2
QWEN = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)  # Qwen2.5-Instruct's


def doc_prompts(seed: int = 0, lengths=(1, 4, 4, 7, 9)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(20, gen)
    return [doc + random_tokens(n, gen) for n in lengths]


def check_greedy(model, prompts, **options) -> list[list[int]]:
    got = generate_tokens(model, prompts, **options)
    assert got == [alone(model, p, **options) for p in prompts]
    return got


# -- greedy: generate's non-warper processors before the argmax, its stopping criteria --


def test_greedy_over_qwen_config_with_penalties_and_stop_strings():
    model, tok, prompts = model_with(QWEN), char_tokenizer(), doc_prompts()
    options = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=[], no_repeat_ngram_size=2)
    free = check_greedy(model, prompts, **options)
    plain = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=[], repetition_penalty=1.0)
    assert free != generate_tokens(model, prompts, **plain)  # the inherited penalty and the n-gram ban matter
    inside = tok.decode(free[3][4:6])  # completed at step 6 of stream 3
    across = tok.decode([prompts[1][-1], free[1][0]])  # spans stream 1's prompt and its first token
    got = check_greedy(model, prompts, **options, stop_strings=[inside, across], tokenizer=tok)
    assert len(got[3]) <= 6 and len(got[1]) == 1


@pytest.mark.parametrize("sampling_only", [dict(temperature=0.0), dict(top_p=0.5, min_p=0.2, top_k=3)])
def test_sampling_fields_with_greedy_decode_greedily_as_generate(sampling_only):
    model, prompts = model_with({**QWEN, **sampling_only, "do_sample": False}), doc_prompts(1)
    got = check_greedy(model, prompts, max_new_tokens=NEW, eos_token_id=[])
    assert got == check_greedy(model, prompts, max_new_tokens=NEW, eos_token_id=[], do_sample=False, **sampling_only)


def _greedy_cases(free: list[list[int]]) -> dict[str, dict]:
    """Options that change these prompts' greedy answers `free`, each named."""
    a, b = free[0][1], free[3][2]
    return {
        "bad_words_ids": dict(bad_words_ids=[[a], free[2][2:4]]),
        "suppress_tokens": dict(suppress_tokens=[a, b]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[free[0][0], free[4][0]]),
        "sequence_bias": dict(sequence_bias=[[[a], -20.0], [free[2][3:5], -20.0], [[b], 5.0]]),
        "repetition_penalty": dict(repetition_penalty=2.0),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
        "min_new_tokens": dict(min_new_tokens=4, eos_token_id=[free[0][0], free[3][1]]),
        "min_length": dict(min_length=27, eos_token_id=[free[0][0], free[3][1]]),  # absolute: per prompt length
        "max_length": dict(max_length=31, max_new_tokens=None),  # absolute: a budget per prompt length
        "forced_eos_token_id": dict(forced_eos_token_id=EOS, eos_token_id=EOS),
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 3.0), eos_token_id=b),
        "encoder_repetition_penalty": dict(encoder_repetition_penalty=3.0),  # holds the prompt: one group each
        "logits_processor": dict(logits_processor=[BanRecent()]),
        "stopping_criteria": dict(stopping_criteria=[StopAfterRepeat()]),
        "eos_token_id": dict(eos_token_id=[a, b]),
    }


def test_user_processor_and_criterion_over_one_group_of_rows():
    """Prompts of one length: one group holds every row, so the user's processor and criterion run on the rows'
    own scores and histories (no per-group gather), and rows leave as streams stop: still generate's tokens."""
    model, prompts = model_with(), doc_prompts(6, lengths=(5, 5, 5, 5, 5))
    options = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=[], logits_processor=[BanRecent()],
                   stopping_criteria=[StopAfterRepeat()])  # fmt: skip
    got = check_greedy(model, prompts, **options)
    assert 1 < len(set(map(len, got)))  # streams stopped at different steps


@pytest.mark.parametrize("case", sorted(_greedy_cases([[0] * NEW] * 5)))
def test_each_greedy_option_matches_generate(case):
    model, prompts = model_with(QWEN), doc_prompts(2)
    base = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=[], repetition_penalty=1.0)
    options = _greedy_cases(generate_tokens(model, prompts, **base))[case]
    got = check_greedy(model, prompts, **{**base, **options})
    without = {k: v for k, v in options.items() if k not in (case, "max_new_tokens")}
    assert got != generate_tokens(model, prompts, **{**base, **without})  # the option changed the answers


def test_generation_config_argument_merges_as_generate():
    """kwargs > generation_config= > the model's generation_config (QWEN's sampling, then overridden)."""
    model, prompts = model_with(QWEN), doc_prompts(3)
    config = GenerationConfig(do_sample=False, repetition_penalty=1.8, max_new_tokens=7, eos_token_id=EOS)
    got = check_greedy(model, prompts, generation_config=config, no_repeat_ngram_size=2, max_new_tokens=NEW)
    assert max(map(len, got)) == NEW and got != check_greedy(model, prompts, generation_config=config)


def test_padded_views_equal_per_group_calls(monkeypatch):
    """The class-specific padded calls against the exact view every class could take (one call per length)."""
    model, prompts = model_with(QWEN), doc_prompts(4)
    options = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=[], repetition_penalty=1.5, min_new_tokens=3,
                   no_repeat_ngram_size=2, sequence_bias=[[[5, 6], -3.0]], bad_words_ids=[[7, 8]])  # fmt: skip
    fast = generate_tokens(model, prompts, **options)
    monkeypatch.setattr(logits, "VIEWS", {})
    monkeypatch.setattr(logits, "LENGTH_LIMIT", {})
    assert generate_tokens(model, prompts, **options) == fast


def test_no_history_work_without_history_processors():
    """Plain greedy, or temperature / top-k / top-p: no history buffer, one call per processor per step."""
    model, prompts = model_with(), doc_prompts()
    for options in ({}, {"do_sample": True, "temperature": 0.5, "top_k": 5, "top_p": 0.9}):
        opts = GenerationOptions.resolve(model, max_new_tokens=NEW, eos_token_id=EOS, **options)
        proc = StreamProcessors.for_prompts(model, opts, prompts, NEW, model.device)
        assert proc.history == {} and proc.rows is None
        assert [s.view for s in proc.process] == ["length"] * len(proc.process)
        assert [s.view for s in proc.stop] == ["newest"]  # EOS; the length limit is the loop's bound


# -- sampling: each stream's processed distribution is generate's for its own history --


@pytest.mark.parametrize("config, options", [
    (QWEN, dict(min_p=0.1, repetition_penalty=1.5, no_repeat_ngram_size=2)),
    ({}, dict(do_sample=True)),  # generate's default top_k=50 applies
    ({}, dict(do_sample=True, typical_p=0.6, repetition_penalty=1.3)),
    ({}, dict(do_sample=True, epsilon_cutoff=0.02, sequence_bias=[[[5, 6], 4.0]])),
    ({}, dict(do_sample=True, eta_cutoff=0.02, logits_processor=[BanRecent()])),
])  # fmt: skip
def test_sampled_distributions_equal_generates(config, options, monkeypatch):
    model, prompts = model_with(config), doc_prompts(5)
    seen = []  # per step: the processed scores [N, V] and the tokens drawn
    draw = sampling.Sampler.__call__
    monkeypatch.setattr(sampling.Sampler, "__call__", lambda self, s: seen.append((s, draw(self, s))) or seen[-1][1])
    generate_tokens(model, prompts, max_new_tokens=6, eos_token_id=[], seed=0, **options)
    spread = 0
    for i, prompt in enumerate(prompts):
        processors = generate_processors(model, prompt, max_new_tokens=6, **options)
        history = list(prompt)
        for scores, tokens in seen:
            logits = model(torch.tensor([history])).logits[0, -1:].float()
            want = processors(torch.tensor([history]), logits)[0]
            got = scores[i]
            assert torch.equal(torch.isinf(got), torch.isinf(want))  # the same tokens filtered out
            torch.testing.assert_close(got.softmax(-1), want.softmax(-1), atol=1e-5, rtol=1e-4)
            spread = max(spread, int(torch.isfinite(want).sum()))
            history.append(int(tokens[i]))
    assert spread > 1  # some step really sampled among several tokens


def test_num_return_sequences_are_independent_samples_of_a_prompt_stored_once():
    model, prompts = model_with(QWEN), doc_prompts(6, lengths=(2, 5, 3))
    starts = [p[20] for p in prompts]  # each question's first token (after the 20-token document)
    assert len(set(starts)) == 3

    def allowed(batch_id, ids):  # each prompt's answers may use only tokens of its own range
        return list(range(3 + 20 * starts.index(int(ids[20])), 23 + 20 * starts.index(int(ids[20]))))

    call = stream_tokens(model, prompts, num_return_sequences=8, max_new_tokens=6, eos_token_id=[], seed=1,
                         prefix_allowed_tokens_fn=allowed)  # fmt: skip
    answered = dict(call)
    got = [answered[i] for i in range(len(answered))]
    assert len(got) == 3 * 8
    for p in range(3):
        answers = got[8 * p : 8 * p + 8]  # contiguous per prompt, as generate orders them
        assert all(3 + 20 * p <= t < 23 + 20 * p for a in answers for t in a)
        assert len({tuple(a) for a in answers}) > 1  # independent samples, not one repeated
    assert call.stats.row_slots == sum(map(len, prompts)) - 2 * 20 + 3 * 8 * 6  # the document once, each prompt once


def test_num_return_sequences_without_constraints():
    model, prompts = model_with(QWEN), doc_prompts(7)
    got = generate_tokens(model, prompts, num_return_sequences=8, max_new_tokens=6, eos_token_id=[])
    assert len(got) == 8 * len(prompts)
    assert all(len({tuple(a) for a in got[8 * p : 8 * p + 8]}) > 1 for p in range(len(prompts)))


def test_generate_parallel_passes_its_tokenizer_and_groups_return_sequences():
    model, tok = model_with(QWEN), char_tokenizer()
    answers = generate_parallel(model, tok, "A short document.", ["Who?", "What is it?"], num_return_sequences=3,
                                max_new_tokens=5, stop_strings=["zz"], seed=0)  # fmt: skip
    assert len(answers) == 2 and all(len(a) == 3 and all(isinstance(s, str) for s in a) for a in answers)
