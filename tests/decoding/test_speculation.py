"""Prompt-lookup decoding in the packed row, against `model.generate` on each prompt alone without drafts.

Tiny random models rarely write what their prompt holds, so most tests also draft from an oracle: the answer
`model.generate` writes alone, with every few tokens changed, so that drafts are accepted whole, in part or not
at all, and streams move apart.  The drafts change how many tokens a forward decides, never which.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from hf_parallel import generate_tokens, stream_tokens
from hf_parallel.decoding import sampling
from hf_parallel.decoding.drafting import PromptLookup, Speculation
from hf_parallel.engine import groups
from tests.helpers.char_tokenizers import ascii_tokenizer as char_tokenizer
from tests.helpers.generation import EOS, BanRecent, StopAfterRepeat, alone, generate_processors, model_with
from tests.helpers.models import ARCHITECTURES, VOCAB, generate_alone, tiny_model
from tests.helpers.prompts import prompts_with_repeats
from tests.helpers.sizing import max_memory_for
from tests.helpers.speculation import Oracle

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

NEW = 16
ATTENTION = sorted(a for a in ARCHITECTURES if a != "qwen3_5_text")  # the hybrid is refused (its own test)


def counted(model, prompts, **options) -> tuple[list[list[int]], int, int]:
    """`generate_tokens`' answers, with the tokens the call decided and the streams it fed over all its forwards
    (`stream_tokens`' stats): tokens over stream forwards is what a stream gets a forward."""
    streamed = stream_tokens(model, prompts, **options)
    answers = dict(streamed)
    return [answers[i] for i in range(len(answers))], streamed.stats.tokens, streamed.stats.stream_forwards


# -- the drafts are transformers' --


@pytest.mark.parametrize("k, ngram", [(3, 1), (5, 2), (10, 3)])
def test_drafts_are_transformers_prompt_lookup(k, ngram):
    gen = torch.Generator().manual_seed(k)
    eos = 7
    for trial in range(30):
        history = torch.randint(3, 12, (int(torch.randint(2, 40, (1,), generator=gen)),), generator=gen).tolist()
        reference = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor([eos]), num_output_tokens=k, max_matching_ngram_size=ngram, max_length=10**6
        )
        ids = torch.tensor([history])
        candidates, _ = reference.get_candidates(ids)
        want = candidates[0, len(history) :].tolist()
        cut = int(torch.randint(0, len(history), (1,), generator=gen))
        lookup = PromptLookup(Speculation(k, ngram), [history[:cut]], eos_ids=[eos])
        lookup.extend(0, history[cut:])  # grown as a stream grows
        assert lookup.draft(0, k) == want, (trial, history)
        shared = PromptLookup(Speculation(k, ngram), [history[:cut]], eos_ids=[eos], shared=[(0, history[: cut // 2])])
        shared.extend(0, history[cut:])  # the first half of the prompt indexed as a shared prefix
        assert shared.draft(0, k) == want, (trial, history)


# -- exact: the tokens of generate alone --


@pytest.mark.parametrize("arch", ATTENTION)
def test_prompt_lookup_matches_generate_on_every_architecture(arch, monkeypatch):
    model = tiny_model(arch)
    prompts = prompts_with_repeats()
    want = [generate_alone(model, p, NEW) for p in prompts]
    assert generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=[], prompt_lookup_num_tokens=4) == want
    Oracle(prompts, want).install(monkeypatch)
    got, tokens, stream_forwards = counted(model, prompts, max_new_tokens=NEW, eos_token_id=[],
                                           prompt_lookup_num_tokens=6)  # fmt: skip
    assert got == want
    assert tokens >= 2 * stream_forwards  # the oracle's drafts were accepted: fewer forwards than tokens


@pytest.mark.parametrize("attn", ["reference", "triton"])
def test_streams_stop_inside_drafts_at_eos(attn, monkeypatch):
    pytest.importorskip("triton") if attn == "triton" else None
    model, prompts = tiny_model("llama"), prompts_with_repeats(1, questions=6)
    free = [generate_alone(model, p, NEW) for p in prompts]
    eos = [free[0][5], free[3][2]]  # two streams stop early, the others run to the limit
    want = [generate_alone(model, p, NEW, eos=eos) for p in prompts]
    assert len(set(map(len, want))) > 1
    Oracle(prompts, free, every=5).install(monkeypatch)  # drafts run on past EOS
    got = generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=eos, prompt_lookup_num_tokens=6, attn=attn)
    assert got == want


def test_waves_when_the_row_is_too_small(monkeypatch):
    model = tiny_model("qwen2")
    prompts = prompts_with_repeats(2, questions=6) + prompts_with_repeats(3, questions=6)
    want = [generate_alone(model, p, NEW) for p in prompts]
    Oracle(prompts, want).install(monkeypatch)
    memory = max_memory_for(model, max(len(p) for p in prompts) * 3 + 3 * NEW)
    got = generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=[], prompt_lookup_num_tokens=5,
                          max_memory=memory, prefill_chunk=16)  # fmt: skip
    assert got == want


@pytest.mark.parametrize("adaptive", [True, False])
def test_draft_limits(adaptive, monkeypatch):
    """Every draft is within its stream's room and limit; the adaptive limit shrinks after a rejection."""
    model, prompts = tiny_model("llama"), prompts_with_repeats(4)
    want = [generate_alone(model, p, NEW) for p in prompts]
    oracle = Oracle(prompts, want, every=3)
    oracle.install(monkeypatch)
    got = generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=[], prompt_lookup_num_tokens=6,
                          adaptive_drafts=adaptive)  # fmt: skip
    assert got == want
    asked = [(k, NEW - 1 - done) for _, done, k in oracle.asked]  # (limit asked, the stream's room left)
    assert asked
    assert all(0 <= k <= min(6, left) for k, left in asked)
    assert any(k < min(6, left) for k, left in asked) == adaptive


# -- generate's processors and criteria at every accepted position --

CASES = {
    "repetition_penalty": dict(repetition_penalty=1.6),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "min_new_tokens": dict(min_new_tokens=6),
    "max_length": dict(max_length=58, max_new_tokens=None),
    "sequence_bias": dict(sequence_bias=[[[5, 6], -4.0], [[9], 3.0]]),
    "bad_words_ids": dict(bad_words_ids=[[11], [7, 8]]),
    "stop_strings": dict(stop_strings=["hA", "d"]),
    "user_processor_and_criterion": dict(logits_processor=[BanRecent()], stopping_criteria=[StopAfterRepeat()]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_processors_apply_at_every_accepted_position(case, monkeypatch):
    model, prompts = model_with(), prompts_with_repeats(5)
    options = {**dict(do_sample=False, max_new_tokens=NEW, eos_token_id=EOS), **CASES[case]}
    if case == "stop_strings":
        options["tokenizer"] = char_tokenizer()
    want = [alone(model, p, **options) for p in prompts]
    free = [alone(model, p, do_sample=False, max_new_tokens=NEW + 4, eos_token_id=None) for p in prompts]
    Oracle(prompts, free, every=5).install(monkeypatch)  # drafts of the unprocessed answers
    assert generate_tokens(model, prompts, prompt_lookup_num_tokens=5, **options) == want


def test_generation_config_and_kwargs_carry_prompt_lookup(monkeypatch):
    model, prompts = model_with(), prompts_with_repeats(6)
    want = [generate_alone(model, p, NEW) for p in prompts]
    Oracle(prompts, want).install(monkeypatch)
    config = GenerationConfig(prompt_lookup_num_tokens=4, max_matching_ngram_size=1, do_sample=False)
    got, tokens, stream_forwards = counted(model, prompts, generation_config=config, max_new_tokens=NEW,
                                           eos_token_id=[])  # fmt: skip
    assert got == want and tokens >= 2 * stream_forwards  # decoded speculatively
    assert config.prompt_lookup_num_tokens == 4  # the user's config untouched


# -- sampling: every drawn token from generate's distribution for its own history --


def test_sampled_distributions_with_drafts(monkeypatch):
    """Each accepted token is drawn from the processed distribution generate gives its stream's history."""
    model = model_with(dict(do_sample=True, temperature=0.7, top_k=20, repetition_penalty=1.3))
    prompts = prompts_with_repeats(7)
    options = dict(max_new_tokens=10, eos_token_id=[], seed=0)
    free = generate_tokens(model, prompts, **options)  # drafts that sampling will often agree with
    Oracle(prompts, free, every=6).install(monkeypatch)
    seen, current = [], []  # per draw: (stream, answer length, processed scores); the group verifying
    draw, verify = sampling.Sampler.__call__, groups.DraftingGroup.verify

    def recording(self, scores):
        group = current[0]
        proc = group.processors
        lengths = proc.lengths if proc.lengths is not None else [proc.length] * len(scores)
        seen.extend((group.streams[r].index, int(lengths[r]), scores[r]) for r in range(len(scores)))
        return draw(self, scores)

    def verifying(self, logits, drafts):
        current[:] = [self]
        return verify(self, logits, drafts)

    monkeypatch.setattr(groups.DraftingGroup, "verify", verifying)
    monkeypatch.setattr(sampling.Sampler, "__call__", recording)
    got = generate_tokens(model, prompts, prompt_lookup_num_tokens=4, **options)
    last = {}  # (stream, length) -> the scores of its last draw: the one its accepted token came from
    for stream, length, scores in seen:
        last[(stream, length)] = scores
    spread = 0
    for i, prompt in enumerate(prompts):
        processors = generate_processors(model, prompt, max_new_tokens=10)
        for t in range(len(got[i])):
            history = prompt + got[i][:t]
            logits = model(torch.tensor([history])).logits[0, -1:].float()
            want = processors(torch.tensor([history]), logits)[0]
            have = last[(i, t)]
            assert torch.equal(torch.isinf(have), torch.isinf(want))
            torch.testing.assert_close(have.softmax(-1), want.softmax(-1), atol=1e-5, rtol=1e-4)
            spread = max(spread, int(torch.isfinite(want).sum()))
    assert spread > 1


# -- refusals --


def test_models_with_recurrent_layers_are_refused():
    model = tiny_model("qwen3_5_text")
    with pytest.raises(NotImplementedError, match="recurrent state"):
        generate_tokens(model, prompts_with_repeats(), max_new_tokens=4, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("options, error", [
    (dict(prompt_lookup_num_tokens=0), ValueError),
    (dict(prompt_lookup_num_tokens=3, max_matching_ngram_size=-1), ValueError),
    (dict(prompt_lookup_num_tokens="3"), TypeError),
    (dict(prompt_lookup_num_tokens=3, adaptive_drafts="yes"), TypeError),
    (dict(assistant_model=object()), TypeError),
    (dict(prompt_lookup_num_tokens=3, assistant_model=object()), ValueError),
])  # fmt: skip
def test_bad_speculation_options(llama, options, error):
    with pytest.raises(error, match=list(options)[-1]):
        generate_tokens(llama, prompts_with_repeats(), max_new_tokens=4, **options)


# -- an assistant model's drafts --


@pytest.mark.parametrize("arch, assistant", [("llama", "same"), ("llama", "other"), ("qwen2", "other"),
                                             ("gpt_oss", "same")])  # fmt: skip
def test_assistant_drafts_match_generate(arch, assistant):
    model = tiny_model(arch)
    helper = model if assistant == "same" else tiny_model("mistral")  # another architecture, the same vocabulary
    prompts = prompts_with_repeats(8)
    free = [generate_alone(model, p, NEW) for p in prompts]
    eos = [free[1][6], free[3][3]]
    want = [generate_alone(model, p, NEW, eos=eos) for p in prompts]
    got, tokens, stream_forwards = counted(model, prompts, max_new_tokens=NEW, eos_token_id=eos,
                                           assistant_model=helper, num_assistant_tokens=5)  # fmt: skip
    assert got == want
    if assistant == "same":  # its own drafts are always right: a forward decides up to 6 tokens of a stream
        assert tokens >= 4 * stream_forwards


def test_assistant_with_processors_and_sampling(monkeypatch):
    model, prompts = model_with(), prompts_with_repeats(9)
    options = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=EOS, repetition_penalty=1.5, min_new_tokens=4)
    want = [alone(model, p, **options) for p in prompts]
    assert generate_tokens(model, prompts, assistant_model=tiny_model("qwen2"), **options) == want


def test_assistant_refusals(llama):
    with pytest.raises(NotImplementedError, match="recurrent state"):
        generate_tokens(llama, prompts_with_repeats(), max_new_tokens=4, assistant_model=tiny_model("qwen3_5_text"))
    other = transformers_model_with_vocab(VOCAB * 40)
    with pytest.raises(ValueError, match="same tokenizer"):
        generate_tokens(llama, prompts_with_repeats(), max_new_tokens=4, assistant_model=other)


def transformers_model_with_vocab(vocab: int):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=256)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).eval()
