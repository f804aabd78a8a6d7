"""Prompts tokenized together give each prompt the ids it gets alone (real SmolLM2 tokenizer)."""

from __future__ import annotations

import copy
from unittest import mock

import pytest

from hf_parallel.frontends.judging import YesNoQuestion, render_judgments
from hf_parallel.frontends.prompting import TOKENIZE_BATCH, render_prompt, render_prompts

DOCUMENT = "The committee met on Tuesday.  It chose a new chair, Ms. Ito, and closed at noon.\n\n" * 20
QUESTIONS = ["Who chairs it?", "When did it close?", " Leading space?", "Ünïcode — and “quotes”?", "x"]


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    """SmolLM2's tokenizer (a chat template, no BOS added), and a copy that adds a BOS to plain text."""
    with_bos = copy.deepcopy(smollm2[1])
    with_bos.add_bos_token = True
    assert with_bos("a")["input_ids"] != with_bos("a", add_special_tokens=False)["input_ids"]
    return smollm2[1], with_bos


@pytest.mark.parametrize("chat", [True, False])
def test_render_prompts_gives_each_prompt_the_ids_of_its_own_call(tokenizers, chat):
    for tokenizer in tokenizers:
        template = "{document}\n\n{question}" if chat else "{document}\n\nQuestion: {question}"
        alone = [render_prompt(tokenizer, template.format(document=DOCUMENT, question=q), chat) for q in QUESTIONS]
        assert render_prompts(tokenizer, DOCUMENT, QUESTIONS, use_chat_template=chat) == alone
        assert render_prompts(tokenizer, DOCUMENT, [], use_chat_template=chat) == []


def test_render_prompts_tokenizes_a_documents_prompts_in_batches(tokenizers):
    tokenizer, many = tokenizers[0], [f"Question {i}?" for i in range(TOKENIZE_BATCH + 6)]
    call = type(tokenizer).__call__
    with mock.patch.object(type(tokenizer), "__call__", autospec=True, side_effect=call) as spy:
        prompts = render_prompts(tokenizer, DOCUMENT, many)
    assert spy.call_count == 2  # batches of TOKENIZE_BATCH: a fast tokenizer encodes each on several threads
    assert prompts == [render_prompt(tokenizer, f"{DOCUMENT}\n\n{q}") for q in many]


def test_render_judgments_gives_each_judgment_the_ids_of_its_own_call(tokenizers):
    questions = [YesNoQuestion("late", "Was it late?"), YesNoQuestion("chair", "Is Ms. Ito the chair?")]
    for tokenizer in tokenizers:
        for chat in (True, False):
            got = render_judgments(tokenizer, DOCUMENT, questions, use_chat_template=chat)
            want = [render_prompt(tokenizer, text, chat) for text in _judgment_texts(questions)]
            assert got == want


def _judgment_texts(questions) -> list[str]:
    from hf_parallel.frontends.judging import TEMPLATE

    return [TEMPLATE.format(context=DOCUMENT, question=q.prompt, judgment=text) for q in questions
            for _, text in q.judgments()]  # fmt: skip
