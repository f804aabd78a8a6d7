"""Layout ids, positions and mask against a brute-force mask built from the prompts themselves."""

from __future__ import annotations

import random

import pytest
import torch

from hf_parallel.attention.reference import stream_mask
from hf_parallel.row.layout import build_layout
from hf_parallel.row.plan import AttentionPlan, SlotIds
from tests.helpers.prompts import random_tree_prompts


def token_slots(layout, prompt_index: int, prompt: list[int]) -> list[int]:
    """Slots of prompt p's tokens, found by walking its segment chain."""
    slots = []
    for seg_id in layout.ancestors(layout.prompt_ends[prompt_index]):
        seg = layout.segments[seg_id]
        slots += range(seg.slot_start, seg.slot_start + len(seg.tokens))
    return slots


def brute_force_mask(layout, prompts) -> torch.Tensor:
    """[S, S] visible[q, k]: a token sees exactly the earlier tokens of its own full sequence."""
    n = layout.num_slots
    visible = torch.zeros(n, n, dtype=torch.bool)
    for p, prompt in enumerate(prompts):
        sequence = token_slots(layout, p, prompt) + layout.answer_slots[p].tolist()
        for i, q in enumerate(sequence):
            visible[q, sequence[: i + 1]] = True
    return visible


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_mask_matches_brute_force(seed, interleaved):
    rng = random.Random(seed)
    prompts = random_tree_prompts(rng)
    layout = build_layout(prompts, max_new_tokens=3, interleaved=interleaved)
    ids = SlotIds.from_layout(layout, torch.device("cpu"))
    plan = AttentionPlan.for_slots(torch.arange(layout.num_slots), ids)
    assert torch.equal(stream_mask(plan), brute_force_mask(layout, prompts))


@pytest.mark.parametrize("seed", range(40))
def test_tokens_positions_and_sharing(seed):
    rng = random.Random(seed)
    prompts = random_tree_prompts(rng)
    layout = build_layout(prompts, max_new_tokens=2)
    slots, tokens, positions = layout.prompt_slots()
    stored = dict(zip(slots.tolist(), tokens.tolist()))
    for p, prompt in enumerate(prompts):
        mine = token_slots(layout, p, prompt)
        assert [stored[s] for s in mine] == prompt  # each stream's tokens are exactly its prompt
        assert layout.slot_pos[mine].tolist() == list(range(len(prompt)))  # positions as if alone
        assert layout.slot_pos[layout.answer_slots[p]].tolist() == [len(prompt), len(prompt) + 1]
    distinct_prefixes = {tuple(p[: i + 1]) for p in prompts for i in range(len(p))}
    assert len(slots) == len(distinct_prefixes)  # every shared prefix is stored once
    assert layout.num_slots == len(distinct_prefixes) + 2 * len(prompts)


def test_stream_major_regions_are_contiguous():
    doc, questions = [1] * 10, [[2, 3], [3], [4, 4, 4]]
    layout = build_layout([doc + q for q in questions], max_new_tokens=5)
    for p, q in enumerate(questions):
        question_seg = layout.segments[layout.prompt_ends[p]]
        assert layout.answer_slots[p, 0] == question_seg.slot_start + len(q)  # answer right after its question
    assert layout.segments[0].tokens == doc and layout.segments[0].end == len(layout.segments)


def test_sliding_window_masks_far_keys():
    layout = build_layout([[5] * 10 + [6]], max_new_tokens=1)
    ids = SlotIds.from_layout(layout, torch.device("cpu"))
    plan = AttentionPlan.for_slots(torch.tensor([10]), ids)
    assert stream_mask(plan, sliding_window=4)[0].nonzero().flatten().tolist() == [7, 8, 9, 10]


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        build_layout([[1, 2], []], max_new_tokens=1)
