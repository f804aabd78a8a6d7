"""The shared prefix's KV exists once, however many questions are asked."""

from __future__ import annotations

import pytest
import torch

from hf_parallel import stream_tokens
from tests.helpers.models import random_tokens


@pytest.mark.parametrize("n_questions", [1, 8, 32])
def test_cache_holds_one_copy_of_the_document(llama, n_questions):
    gen = torch.Generator().manual_seed(0)
    doc, question_len, new = random_tokens(100, gen), 3, 4
    prompts = [
        doc + [3 + i] + random_tokens(question_len - 1, gen) for i in range(n_questions)
    ]  # no shared question prefix
    call = stream_tokens(llama, prompts, max_new_tokens=new, eos_token_id=[])
    assert len(dict(call)) == n_questions
    slots = len(doc) + n_questions * (question_len + new)
    assert call.stats.row_slots == slots
    heads, head_dim = llama.config.num_key_value_heads, llama.config.hidden_size // llama.config.num_attention_heads
    per_slot = 2 * heads * head_dim * 4 * llama.config.num_hidden_layers  # K and V, float32, every layer
    assert call.stats.row_bytes == per_slot * slots
