"""Bad input gets a clear exception naming the problem, before any work in the model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

from hf_parallel import generate_parallel, generate_tokens, stream_tokens
from tests.helpers.models import VOCAB, tiny_model


class WordTokenizer:
    """A minimal tokenizer (whitespace words -> ids) with no chat template, no pad and an optional eos."""

    chat_template = None

    def __init__(self, eos_token_id=2):
        self.eos_token_id = eos_token_id
        self.vocab: dict[str, int] = {}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.vocab.setdefault(w, 3 + len(self.vocab) % (VOCAB - 3)) for w in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        words = {v: k for k, v in self.vocab.items()}
        return " ".join(words.get(i, "?") for i in ids)


def test_empty_question_list_returns_empty(llama):
    assert generate_tokens(llama, []) == []
    assert generate_parallel(llama, WordTokenizer(), "a document", []) == []


@pytest.mark.parametrize("document, questions, match", [
    ("", ["q?"], "document is empty"),
    ("doc", ["ok?", "  "], "question 1 is empty"),
    ("doc", "one string", "list of strings"),
])  # fmt: skip
def test_empty_strings_are_refused(llama, document, questions, match):
    with pytest.raises((ValueError, TypeError), match=match):
        generate_parallel(llama, WordTokenizer(), document, questions)


def test_empty_prompt_and_bad_token_ids(llama):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_tokens(llama, [[3, 4], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_tokens(llama, [[3, VOCAB + 5]], max_new_tokens=2)


def test_bad_token_ids_are_named_by_prompt_where_prompts_share_them(llama):
    """The ids are checked once each over the prompts' prefix tree (a shared document once); an id outside the
    vocabulary, in a shared part or a prompt's own, is still reported against the first prompt holding it."""
    doc = [3, 4, 5, 6]
    for prompts, first in [([doc + [7], doc + [VOCAB + 1], doc + [-2]], 1),
                           ([doc + [7], [3, VOCAB] + doc, [3, VOCAB] + doc + [8]], 1),
                           ([[3, -1] + doc, [3, -1] + doc + [9]], 0)]:  # fmt: skip
        with pytest.raises(ValueError, match=f"prompt {first} has token ids outside the vocabulary"):
            generate_tokens(llama, prompts, max_new_tokens=2)
    call = stream_tokens(llama, [doc + [7], doc + [8]], max_new_tokens=2)
    assert len(dict(call)) == 2
    assert call.stats.ids_checked == len(doc) + 2  # valid ids: the document's once, no prompt scanned whole


def test_prompt_beyond_max_positions(llama):
    limit = llama.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate_tokens(llama, [[3] * (limit - 2)], max_new_tokens=5)


def test_learned_positions_beyond_limit_refused_not_crashing():
    gpt2 = tiny_model("gpt2")
    with pytest.raises(ValueError, match="256 positions"):
        generate_tokens(gpt2, [[3] * 250], max_new_tokens=10)


def test_beam_search_and_unknown_options_are_refused(llama):
    with pytest.raises(NotImplementedError, match="num_beams"):
        generate_tokens(llama, [[3, 4]], num_beams=2)
    for option in ({"penalty_alpha": 0.6, "top_k": 4}, {"guidance_scale": 1.5}, {"force_words_ids": [[5]]},
                   {"num_beam_groups": 2}, {"assistant_tokenizer": object()}):  # fmt: skip
        with pytest.raises(NotImplementedError, match=next(iter(option))):
            generate_tokens(llama, [[3, 4]], max_new_tokens=2, **option)
    with pytest.raises(NotImplementedError, match="num_beams"):  # through generation_config= too
        generate_tokens(llama, [[3, 4]], generation_config=GenerationConfig(num_beams=3))
    with pytest.raises(TypeError, match="unknown generation option 'max_tokens'"):
        generate_tokens(llama, [[3, 4]], max_tokens=4)
    with pytest.raises(TypeError, match="unknown generation options 'colour', 'flavour'"):
        generate_tokens(llama, [[3, 4]], flavour=1, colour=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate_tokens(llama, [[3, 4]], max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown attention path"):
        generate_tokens(llama, [[3, 4]], attn="flash")
    for ablation in ("layout", "own_tiles", "streams_per_tile"):  # benchmark ablations are not user options
        with pytest.raises(TypeError, match=f"unknown generation option '{ablation}'"):
            generate_tokens(llama, [[3, 4]], **{ablation: 1})


def test_beam_search_inherited_from_the_model_config_is_refused():
    model = tiny_model("llama")
    model.generation_config.num_beams = 4
    with pytest.raises(NotImplementedError, match="beam_search"):
        generate_tokens(model, [[3, 4]], max_new_tokens=2)


def test_stop_strings_without_a_tokenizer_are_refused(llama):
    with pytest.raises(ValueError, match="stop_strings need the model's tokenizer: pass tokenizer="):
        generate_tokens(llama, [[3, 4]], max_new_tokens=2, stop_strings=["stop"])


def test_options_generate_refuses_are_refused_as_generate_refuses_them(llama):
    with pytest.raises(ValueError, match="num_return_sequences"):  # generate's own check: greedy gives one answer
        generate_tokens(llama, [[3, 4]], max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="temperature"):  # generate's TemperatureLogitsWarper
        generate_tokens(llama, [[3, 4]], max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(NotImplementedError, match="output_scores"):  # hf_parallel returns token lists
        generate_tokens(llama, [[3, 4]], max_new_tokens=2, output_scores=True)


def test_tokenizer_without_eos_is_refused(llama):
    saved = llama.generation_config.eos_token_id
    llama.generation_config.eos_token_id = None
    try:
        with pytest.raises(ValueError, match="EOS token"):
            generate_parallel(llama, WordTokenizer(eos_token_id=None), "doc words", ["a question"])
    finally:
        llama.generation_config.eos_token_id = saved


def test_model_whose_attention_bypasses_the_interface_is_refused():
    """A layer that computes attention itself (here: SDPA, locked by a config of its own) would ignore the stream
    mask: the probe sees it write K/V without calling hf_parallel's attention, and refuses before any work."""
    model = tiny_model("llama")
    attention = model.model.layers[1].self_attn
    attention.config = copy.deepcopy(attention.config)  # set_attn_implementation no longer reaches it
    attention.config._attn_implementation = "sdpa"
    with pytest.raises(NotImplementedError, match=r"AttentionInterface \(layers \[1\] wrote K/V without it\)"):
        generate_tokens(model, [[3, 4]], max_new_tokens=2)


def test_model_without_position_ids_is_refused(llama):
    class NoPositions(type(llama)):
        def forward(self, input_ids=None, cache=None, **kwargs):  # no position_ids argument
            return super().forward(input_ids=input_ids, cache=cache, **kwargs)

    model = NoPositions(llama.config).eval()
    with pytest.raises(NotImplementedError, match="position_ids"):
        generate_tokens(model, [[3, 4]], max_new_tokens=2)


def test_chunked_attention_is_refused(llama):
    llama.config.attention_chunk_size = 8
    try:
        with pytest.raises(NotImplementedError, match="chunked attention"):
            generate_tokens(llama, [[3, 4]], max_new_tokens=2)
    finally:
        del llama.config.attention_chunk_size


def test_training_mode_is_refused():
    model = tiny_model("llama").train()
    with pytest.raises(ValueError, match="eval mode"):
        generate_tokens(model, [[3, 4]], max_new_tokens=2)


def test_model_method_needs_a_tokenizer(llama):
    with pytest.raises(ValueError, match="tokenizer="):
        llama.generate_parallel("doc", ["q"])


def test_attention_outside_generation_says_so(llama):
    from hf_parallel.attention import BACKENDS, use_attention

    before = llama.config._attn_implementation
    with use_attention(llama, BACKENDS["reference"]), pytest.raises(RuntimeError, match="without a plan"):
        llama(torch.tensor([[3, 4]]))
    assert llama.config._attn_implementation == before


@pytest.mark.parametrize("options, error, match", [
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int, got float"),
    ({"max_new_tokens": "10"}, TypeError, "max_new_tokens must be an int, got str"),
    ({"min_new_tokens": True}, TypeError, "min_new_tokens must be an int, got bool"),
    ({"do_sample": "yes"}, TypeError, "do_sample must be a bool"),
    ({"temperature": "hot", "do_sample": True}, TypeError, "temperature must be a number"),
    ({"prefill_chunk": 1.5}, TypeError, "prefill_chunk must be an int"),
    ({"eos_token_id": "2"}, TypeError, "eos_token_id must be an int or a list of ints"),
    ({"attn": 3}, TypeError, "attn must be a string or an AttentionBackend"),
    ({"repetition_penalty": "1.2"}, TypeError, "repetition_penalty must be a number, got str"),
    ({"num_return_sequences": 2.0}, TypeError, "num_return_sequences must be an int, got float"),
    ({"generation_config": {"top_k": 3}}, TypeError, "generation_config must be a GenerationConfig, got dict"),
])  # fmt: skip
def test_options_of_the_wrong_type_are_named(llama, options, error, match):
    with pytest.raises(error, match=match):
        generate_tokens(llama, [[3, 4]], **options)


@pytest.mark.parametrize("prompts, match", [
    (["hello"], r"prompts\[0\] must be a list of token ids, got str"),
    ("hello", "prompts must be a list of token-id lists, got str"),
    (torch.tensor([3, 4, 5]), "got a 1-D tensor"),
    ([[3, 4.5]], r"prompts\[0\] must hold integer token ids, got float"),
    ([[3, None]], r"prompts\[0\] must hold integer token ids, got NoneType"),
    ([[3, 4], [3, True]], r"prompts\[1\] must hold integer token ids, got bool"),
    (7, "prompts must be a list of token-id lists, got int"),
])  # fmt: skip
def test_prompts_of_the_wrong_type_are_named(llama, prompts, match):
    with pytest.raises(TypeError, match=match):
        generate_tokens(llama, prompts, max_new_tokens=2)


def test_a_2d_tensor_of_prompts_is_one_prompt_per_row(llama):
    prompts = torch.tensor([[3, 4, 5, 6], [3, 4, 7, 8]])
    assert generate_tokens(llama, prompts, max_new_tokens=3, eos_token_id=[]) == generate_tokens(
        llama, prompts.tolist(), max_new_tokens=3, eos_token_id=[]
    )


@pytest.mark.parametrize("document, questions, error, match", [
    (123, ["q?"], TypeError, "document must be a string, got int"),
    ("doc", [123], TypeError, "question 0 must be a string, got int"),
    ("doc", None, TypeError, "questions must be a list of strings, got NoneType"),
])  # fmt: skip
def test_texts_of_the_wrong_type_are_named(llama, document, questions, error, match):
    with pytest.raises(error, match=match):
        generate_parallel(llama, WordTokenizer(), document, questions)


@pytest.mark.parametrize("template, match", [
    ("{document} and nothing else", "has no {question} field"),
    ("{doc} {question}", r"names \['doc'\]"),
    ("{document} {question", "not a valid format string"),
])  # fmt: skip
def test_templates_that_would_fail_or_ask_one_thing_are_refused(llama, template, match):
    with pytest.raises(ValueError, match=match):
        generate_parallel(llama, WordTokenizer(), "a document", ["q one?", "q two?"], template=template)


def test_a_model_that_is_not_a_transformers_model_is_named(llama):
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        generate_tokens(object(), [[3, 4]])
