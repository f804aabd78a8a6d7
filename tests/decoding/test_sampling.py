"""Sampling draws from torch's global generator (as `model.generate` does) unless given a `seed`."""

from __future__ import annotations

import torch

from hf_parallel import generate_tokens
from tests.helpers.models import random_tokens


def _prompts():
    gen = torch.Generator().manual_seed(0)
    doc = random_tokens(20, gen)
    return [doc + random_tokens(2 + i, gen) for i in range(4)]


def _sample(model, **options):
    return generate_tokens(model, _prompts(), max_new_tokens=12, eos_token_id=[], do_sample=True, **options)


def test_manual_seed_makes_sampling_reproducible(llama):
    torch.manual_seed(5)
    first = _sample(llama)
    torch.manual_seed(5)
    assert _sample(llama) == first
    torch.manual_seed(6)
    assert _sample(llama) != first  # 48 sampled tokens: equal by chance almost never


def test_a_call_without_seed_advances_the_global_generator_only(llama):
    torch.manual_seed(5)
    _sample(llama)
    after_call = torch.rand(3)
    torch.manual_seed(5)
    _sample(llama)
    assert torch.equal(torch.rand(3), after_call)  # the call did not reseed the global generator


def test_seed_ignores_the_global_generator(llama):
    torch.manual_seed(1)
    first = _sample(llama, seed=3)
    torch.manual_seed(2)
    assert _sample(llama, seed=3) == first
