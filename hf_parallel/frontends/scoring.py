"""Score continuations over one prefix tree: every prompt and candidate in one packed forward.

The log-probability of a continuation reads the logits of the row *before* each of its
tokens, so the tree holds `prompt + continuation[:-1]` (a continuation's last token is
only a target, never an input): a shared context is computed once, each prompt once,
each candidate's own tokens once, and single-token candidates add nothing.  Logits are
kept only at the rows a target is read from; log-softmax is taken in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..attention import AttentionBackend, resolve_backend
from ..decoding.inputs import as_token_lists
from ..decoding.options import GenerationOptions
from ..engine.core import EngineCore
from ..engine.policies import AllAtOnce
from ..engine.requests import check_request
from ..engine.streams import ScoreRequest
from ..models.checks import check_model
from ..row.contents import FixedRow
from ..row.layout import build_layout
from ..runner.model_runner import ModelRunner
from .probe import check_support


@dataclass
class TreeScores:
    """Per-token log-probabilities of every candidate, and what the tree cost.

    token_logprobs:  [P][C_p] float32 tensors [len(continuation)], in input order.
    greedy:          [P][C_p] whether every token of the candidate is its row's argmax (greedy decoding's choice).
    computed_tokens: tokens the packed forward ran (the tree's size, shared prefixes once).
    """

    token_logprobs: list[list[torch.Tensor]]
    greedy: list[list[bool]]
    computed_tokens: int


@torch.inference_mode()
def score_continuations(
    model: PreTrainedModel,
    prompts: list[list[int]],
    continuations: list[list[list[int]]],
    per_token: bool = False,
    attn: str | AttentionBackend = "auto",
    prefill_chunk: int | None = None,
) -> list[list[float]] | list[list[list[float]]]:
    """Log-probability of each continuation given its prompt, every one as if scored alone.

    prompts:       P prompts (token ids).
    continuations: P lists of candidates; candidate c of prompt p is scored as the tokens
                   that follow `prompts[p]`.
    per_token:     return each candidate's per-token log-probabilities instead of their sum.
    attn:          "reference", "triton", "auto" or an `AttentionBackend` (as in `GenerationOptions`).
    prefill_chunk: split the packed forward into chunks of this many tokens (slot order, so
                   causality holds) where one forward would not fit in memory.
    Returns [P][C_p] summed log-probabilities (or [P][C_p][len] per token), in input order.
    """
    scores = score_tree(model, prompts, continuations, attn, prefill_chunk)
    if per_token:
        return [[lp.tolist() for lp in row] for row in scores.token_logprobs]
    return [[float(lp.sum()) for lp in row] for row in scores.token_logprobs]


def score_tree(model, prompts, continuations, attn="auto", prefill_chunk=None) -> TreeScores:
    """`score_continuations`, keeping the per-token tensors, the greedy flags and the tree's size (for the judge,
    the harness backend and benchmarks)."""
    check_model(model)
    prompts = as_token_lists("prompts", prompts)
    if isinstance(continuations, (str, bytes)) or not isinstance(continuations, (list, tuple)):
        raise TypeError(f"continuations must be a list of lists of token-id lists, got {type(continuations).__name__}")
    continuations = [as_token_lists(f"continuations[{p}]", cands) for p, cands in enumerate(continuations)]
    if len(prompts) != len(continuations):
        raise ValueError(f"got {len(prompts)} prompts but {len(continuations)} lists of continuations")
    # no decode steps to capture: a fresh row, freed on return, rather than the model's static one;
    # one forward unless asked for chunks
    chunk = 1 << 62 if prefill_chunk is None else prefill_chunk
    opts = GenerationOptions(max_new_tokens=1, attn=attn, prefill_chunk=chunk, cuda_graphs=False)
    if not prompts:
        return TreeScores([], [], 0)
    profile = check_support(model)
    check_inputs(model, profile, prompts, continuations)
    candidates = [(prompt, cont) for prompt, cands in zip(prompts, continuations) for cont in cands]
    # each candidate reads the rows before its tokens: its prompt and all but its last token (equal sequences and
    # shared prefixes are one run of the tree, computed once)
    layout = build_layout([prompt + cont[:-1] for prompt, cont in candidates], 0)
    backend = resolve_backend(opts.attn, model.device)
    runner = ModelRunner(model, profile, opts, backend, layout.num_slots)
    core = EngineCore(model, runner, AllAtOnce(), FixedRow(layout), opts.prefill_chunk)
    requests = [ScoreRequest(prompt + cont[:-1], None, targets=cont) for prompt, cont in candidates]
    for request in requests:
        core.add(request)
    with torch.inference_mode(), runner.using_model():
        for _ in core.run():
            pass
    scored = iter(requests)
    rows = [[next(scored).scores for _ in cands] for cands in continuations]
    return TreeScores(
        [[torch.from_numpy(scores.logprobs) for scores in row] for row in rows],
        [[bool(scores.greedy.all()) for scores in row] for row in rows],
        layout.num_slots,
    )


def check_inputs(model: PreTrainedModel, profile, prompts, continuations) -> None:
    """Refuse a prompt without candidates, then each (prompt, candidate) as the engine's one door does
    (`engine.requests.check_request`): empty ones, unknown tokens, inputs longer than the model's positions."""
    for p, (prompt, cands) in enumerate(zip(prompts, continuations)):
        if not cands:
            raise ValueError(f"prompt {p} has no candidate continuations")
        for c, cont in enumerate(cands):
            names = dict(name=f"prompt {p}", target_name=f"continuation {c} of prompt {p}")
            check_request(
                model,
                profile,
                prompt,
                targets=cont,
                both=f"prompt {p} with continuation {c}",
                **names,
                ids_checked=c > 0,
            )
