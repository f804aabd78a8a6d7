"""`generate_tokens`: answer every prompt as if alone, shared token prefixes computed once."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention import resolve_backend
from .inputs import as_token_lists, check_tokens
from .layout import build_layout
from .options import GenerationOptions
from .runner import Runner
from .support import check_model, check_support


@torch.inference_mode()
def generate_tokens(model: PreTrainedModel, prompts, **options) -> list[list[int]]:
    """Answer every prompt as if alone; shared token prefixes are computed once.

    prompts: P complete prompts, lists of token ids (or a 2-D tensor, one prompt per row).
    Their common prefixes are found from the tokens (a prefix tree of any depth), so one
    document with many questions, several documents, a shared system prompt or dialogue
    turns that extend one another all work.
    options: what `model.generate` takes (GenerationConfig names, generation_config=,
    logits_processor=, stopping_criteria=, prefix_allowed_tokens_fn=), merged as generate
    merges them, but beam search; `tokenizer=` (for stop_strings); and hf_parallel's own
    (`GenerationOptions`).
    Returns P * num_return_sequences lists of new tokens, each prompt's answers contiguous
    (as generate orders them), each up to and including EOS when generated.
    """
    check_model(model)
    prompts = as_token_lists("prompts", prompts)
    opts = GenerationOptions.resolve(model, **options)
    if not prompts:
        return []
    budgets = []  # new tokens each prompt may get (generate's max_length - prompt length)
    for i, prompt in enumerate(prompts):
        check_tokens(model, f"prompt {i}", prompt)
        budgets.append(opts.request.prepare(model, prompt).budget)  # generate's lists, captured before any work
        check_tokens(model, f"prompt {i}", prompt, budgets[-1])
    support = check_support(model)
    backend = resolve_backend(opts.attn, model.device)
    streams = [prompt for prompt in prompts for _ in range(opts.num_return_sequences)]  # one prompt stored once
    return Runner(model, build_layout(streams, max(budgets)), opts, backend, support).run()
