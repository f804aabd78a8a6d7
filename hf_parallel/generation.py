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
    options: `GenerationOptions` fields (GenerationConfig names), defaulting to the
    model's generation_config.
    Returns P lists of new tokens, each up to and including EOS when generated.
    """
    check_model(model)
    prompts = as_token_lists("prompts", prompts)
    opts = GenerationOptions.resolve(model, **options)
    if not prompts:
        return []
    for i, prompt in enumerate(prompts):
        check_tokens(model, f"prompt {i}", prompt, opts.max_new_tokens)
    support = check_support(model)
    backend = resolve_backend(opts.attn, model.device)
    return Runner(model, build_layout(prompts, opts.max_new_tokens), opts, backend, support).run()
