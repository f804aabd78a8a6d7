"""`model.generate` as the reference: a tiny Llama with a generation config, its answer for a prompt alone, its own
processor list, and a user processor and stopping criterion."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

from .models import tiny_model

EOS = 2


def model_with(config: dict | None = None):
    """A tiny Llama whose generation_config is `config` (bos 1, eos 2)."""
    model = tiny_model("llama")
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=EOS, **(config or {}))
    return model


def alone(model, prompt: list[int], **options) -> list[int]:
    """What `model.generate` answers for `prompt` asked alone (our eos_token_id=[] is generate's None)."""
    if options.get("eos_token_id") == []:
        options["eos_token_id"] = None
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), **options)[0, len(prompt) :].tolist()


def generate_processors(model, prompt: list[int], **options) -> list:
    """generate's own processor list for `prompt` alone, captured independently of hf_parallel."""
    box = {}

    def loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        box["processors"] = logits_processor
        return input_ids

    ids = torch.tensor([prompt])
    model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=loop, **options)
    return box["processors"]


class BanRecent(LogitsProcessor):
    """A user processor reading history content and length: bans the last three tokens and one by length."""

    def __call__(self, input_ids, scores):
        scores = scores.scatter(1, input_ids[:, -3:], -float("inf"))
        scores[:, input_ids.shape[-1] % scores.shape[-1]] = -float("inf")
        return scores


class StopAfterRepeat(StoppingCriteria):
    """A user criterion: stop when the new token already occurs in the last five."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -6:-1] == input_ids[:, -1:]).any(dim=-1)
