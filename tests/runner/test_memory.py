"""The shared prefix's KV exists once, however many questions are asked."""

from __future__ import annotations

import pytest
import torch

from hf_parallel import generate_tokens
from hf_parallel.runner.patching import ModelProfile
from tests.helpers.models import random_tokens


@pytest.mark.parametrize("n_questions", [1, 8, 32])
def test_cache_holds_one_copy_of_the_document(llama, n_questions, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    doc, question_len, new = random_tokens(100, gen), 3, 4
    prompts = [
        doc + [3 + i] + random_tokens(question_len - 1, gen) for i in range(n_questions)
    ]  # no shared question prefix
    caches = []
    build = ModelProfile.cache
    monkeypatch.setattr(ModelProfile, "cache", lambda self, n: caches.append(build(self, n)) or caches[-1])
    generate_tokens(llama, prompts, max_new_tokens=new, eos_token_id=[])
    cache = caches[-1]  # the call's (a first call on a model also builds one for its probe forward)
    assert cache.num_slots == len(doc) + n_questions * (question_len + new)
    layer = cache.layers[0]
    heads, head_dim = llama.config.num_key_value_heads, llama.config.hidden_size // llama.config.num_attention_heads
    assert layer.keys.shape == (1, heads, cache.num_slots, head_dim)
    per_slot = 2 * heads * head_dim * 4 * llama.config.num_hidden_layers
    assert cache.stored_bytes() == per_slot * (len(doc) + n_questions * (question_len + new))
