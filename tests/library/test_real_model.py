"""SmolLM2-135M-Instruct on real SQuAD paragraphs: parallel answers == model.generate one at a time."""

from __future__ import annotations

import json
import zipfile

import pytest

from hf_parallel import generate_parallel, generate_tokens, render_prompts
from tests.helpers.models import generate_alone
from tests.helpers.project import SHARED_DATA

pytestmark = pytest.mark.slow
NEW = 12


def squad_paragraphs(count: int, max_questions: int):
    path = SHARED_DATA / "squad-dev-v1.1.json.zip"
    if not path.exists():
        pytest.skip(f"real SQuAD data not found at {path} (it ships beside the project, not with it)")
    with zipfile.ZipFile(path) as archive:
        data = json.loads(archive.read("dev-v1.1.json"))
    paragraphs = [p for article in data["data"][:count] for p in article["paragraphs"][:1]]
    return [(p["context"], [qa["question"] for qa in p["qas"][:max_questions]]) for p in paragraphs]


def test_squad_paragraphs_token_identical(smollm2):
    model, tokenizer = smollm2
    for context, questions in squad_paragraphs(count=2, max_questions=5):
        prompts = render_prompts(tokenizer, context, questions)
        eos = tokenizer.eos_token_id
        got = generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=eos)
        assert got == [generate_alone(model, p, NEW, eos) for p in prompts]


def test_generate_parallel_text_matches_generate(smollm2):
    model, tokenizer = smollm2
    ((context, questions),) = squad_paragraphs(count=1, max_questions=4)
    answers = generate_parallel(model, tokenizer, context, questions, max_new_tokens=NEW)
    assert answers == model.generate_parallel(context, questions, tokenizer=tokenizer, max_new_tokens=NEW)
    for prompt, answer in zip(render_prompts(tokenizer, context, questions), answers):
        alone = generate_alone(model, prompt, NEW, tokenizer.eos_token_id)
        assert answer == tokenizer.decode(alone, skip_special_tokens=True).strip()


def test_chat_template_prompts_share_the_document(smollm2):
    _, tokenizer = smollm2
    prompts = render_prompts(tokenizer, "A long shared document. " * 20, ["First?", "Second question?"])
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared > 100  # the chat header and the whole document are one shared prefix
    assert prompts[0] == tokenizer(tokenizer.apply_chat_template(
        [{"role": "user", "content": "A long shared document. " * 20 + "\n\nFirst?"}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]  # fmt: skip
