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
from ..decoding.inputs import as_token_lists, check_length, check_tokens
from ..decoding.options import GenerationOptions
from ..engine.probe import check_support
from ..engine.runner import Runner
from ..models.checks import check_model
from ..row.layout import Layout, build_layout


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
    check_inputs(model, prompts, continuations)
    sequences, seq_of = tree_sequences(prompts, continuations)
    layout = build_layout(sequences, 0)  # no answer room: the tree is exactly the tokens to run
    rows, targets, sizes = target_rows(layout, continuations, seq_of)
    support = check_support(model)
    backend = resolve_backend(opts.attn, model.device)
    runner = Runner(model, layout, opts, backend, support)
    with torch.inference_mode(), runner.using_model():
        logprobs, greedy = (t.cpu() for t in _run(runner, rows, targets, opts.prefill_chunk))
    flat = iter(zip(logprobs.split(sizes), greedy.split(sizes)))
    per_candidate = [[next(flat) for _ in cands] for cands in continuations]
    return TreeScores(
        [[lp for lp, _ in row] for row in per_candidate],
        [[bool(hit.all()) for _, hit in row] for row in per_candidate],
        layout.num_slots,
    )


def check_inputs(model: PreTrainedModel, prompts, continuations) -> None:
    """Refuse empty prompts or candidates, unknown tokens, and inputs longer than the model's positions."""
    for p, (prompt, cands) in enumerate(zip(prompts, continuations)):
        check_tokens(model, f"prompt {p}", prompt)
        if not cands:
            raise ValueError(f"prompt {p} has no candidate continuations")
        for c, cont in enumerate(cands):
            check_tokens(model, f"continuation {c} of prompt {p}", cont)
            # positions: a continuation's last token is only a target, never an input
            check_length(model, f"prompt {p} with continuation {c}", prompt + cont[:-1])


def tree_sequences(prompts, continuations) -> tuple[list[list[int]], list[int]]:
    """The distinct token sequences the tree must hold (prompt + continuation[:-1]) and each candidate's one."""
    index: dict[tuple[int, ...], int] = {}
    seq_of = []
    for prompt, cands in zip(prompts, continuations):
        for cont in cands:
            seq_of.append(index.setdefault(tuple(prompt + cont[:-1]), len(index)))
    return [list(s) for s in index], seq_of


def target_rows(layout: Layout, continuations, seq_of):
    """Every (row slot [M], target token [M]) pair read, candidate after candidate, and each one's count."""
    rows, targets, sizes = [], [], []
    flat = (cont for cands in continuations for cont in cands)
    for s, cont in zip(seq_of, flat):
        rows.append(_tail_slots(layout, layout.prompt_ends[s], len(cont)))
        targets.append(torch.tensor(cont))
        sizes.append(len(cont))
    return torch.cat(rows), torch.cat(targets), sizes


def _tail_slots(layout: Layout, seg_id: int, n: int) -> torch.Tensor:
    """Slots [n] of the last `n` tokens of the sequence ending in segment `seg_id`, in order."""
    parts = []
    while n > 0:
        seg = layout.segments[seg_id]
        take = min(n, len(seg.tokens))
        stop = seg.slot_start + len(seg.tokens)
        parts.append(torch.arange(stop - take, stop))
        n, seg_id = n - take, seg.parent
    return torch.cat(parts[::-1])


def _run(runner: Runner, rows: torch.Tensor, targets: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the tree in slot order, `chunk` tokens per forward; log p(target | row) [M] float32 and whether the
    target is the row's argmax [M] bool."""
    device = runner.device
    slots, tokens, _ = runner.layout.prompt_slots()
    keep, inverse = torch.unique(rows, return_inverse=True)  # sorted; candidates may share rows
    inverse, targets = inverse.to(device), targets.to(device)
    out = torch.empty(len(rows), dtype=torch.float32, device=device)
    greedy = torch.empty(len(rows), dtype=torch.bool, device=device)
    for start in range(0, len(slots), chunk):
        part = slots[start : start + chunk]
        lo = int(torch.searchsorted(keep, part[0]))  # rows inside this chunk: keep[lo:hi]
        hi = int(torch.searchsorted(keep, part[-1], side="right"))
        local = torch.searchsorted(part, keep[lo:hi]) if hi > lo else torch.tensor([len(part) - 1])
        plan = runner.plan(part.to(device))
        logits = runner.forward(plan, tokens[start : start + len(part)].to(device), local.to(device))
        if hi == lo:
            continue  # this chunk only fills the cache
        sel = (inverse >= lo) & (inverse < hi)
        row = inverse[sel] - lo
        # log_softmax, as a plain forward's scorer (lm-eval's HF backend among them) takes it: on the CPU,
        # logits - logsumexp rounds differently (SmolLM2: up to 1.6e-5 a token, 5e-4 over a 60-token passage)
        out[sel] = torch.log_softmax(logits, dim=-1)[row, targets[sel]]
        greedy[sel] = logits.argmax(dim=-1)[row] == targets[sel]
    return out, greedy
