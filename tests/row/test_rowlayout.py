"""A row whose prompts come and go (`PrefixTree`): after any placements and releases, the snapshot's stream mask
is exactly each resident prompt's own sequence, resident prefixes are reused, and freed room is reused."""

from __future__ import annotations

import random

import pytest
import torch

from hf_parallel.attention.reference import stream_mask
from hf_parallel.row.plan import AttentionPlan, SlotIds
from hf_parallel.row.prefix_tree import PrefixTree
from tests.helpers.prompts import random_tree_prompts

ROOM = 3


def sequences(layout, prompts):
    """Each resident stream's slots: its prompt's tokens along its segment chain, then its answer region."""
    out = {}
    for row, index in enumerate(layout.streams):
        chain = layout.ancestors(layout.answer_segs[row])
        slots, tokens = [], []
        for seg_id in chain:
            seg = layout.segments[seg_id]
            slots += range(seg.slot_start, seg.slot_start + seg.length)
            tokens += seg.tokens
        assert tokens == prompts[index]  # the chain holds exactly the prompt
        out[index] = slots
    return out


def check(forest: PrefixTree, prompts):
    layout = forest.snapshot()
    seqs = sequences(layout, prompts)
    used = sorted(s for seq in seqs.values() for s in seq)
    assert len(set(used)) == forest.used() and len(used) >= forest.used()  # shared slots, no stray region
    want = torch.zeros(layout.num_slots, layout.num_slots, dtype=torch.bool)
    for seq in seqs.values():
        for i, q in enumerate(seq):
            want[q, seq[: i + 1]] = True
    ids = SlotIds.from_layout(layout, torch.device("cpu"))
    got = stream_mask(AttentionPlan.for_slots(torch.arange(layout.num_slots), ids))
    assert torch.equal(got, want)  # visibility by ancestry and causality by slot, as if each prompt were alone


@pytest.mark.parametrize("seed", range(40))
def test_random_admissions_and_releases(seed):
    rng = random.Random(seed)
    prompts = random_tree_prompts(rng) + random_tree_prompts(rng)
    forest = PrefixTree(rng.randint(12, 40))
    waiting, resident = list(range(len(prompts))), []
    for _ in range(40):
        if resident and (not waiting or rng.random() < 0.4):
            forest.release(resident.pop(rng.randrange(len(resident))))
        elif waiting:
            index = waiting[0]
            if forest.place(index, prompts[index], ROOM) is not None:
                resident.append(waiting.pop(0))
            elif resident:
                forest.release(resident.pop(0))
        forest.collect()
        check(forest, prompts)
        assert forest.slots.free == unoccupied(forest)
        pending = forest.pending()  # what prefill writes next: every pending node once, after its pending ancestors
        assert len({id(n) for n in pending}) == len(pending)
        for i, node in enumerate(pending):
            ancestor = node.parent
            while ancestor is not forest.root:
                assert ancestor not in pending[i:]
                ancestor = ancestor.parent
        unwritten = [n for n in forest.nodes() if n.tokens and n.written < len(n.tokens)]
        assert {id(n) for n in unwritten} == {id(n) for n in pending}
        if pending and rng.random() < 0.5:  # some of the first pending node's tokens written
            pending[0].written = rng.randint(1, len(pending[0].tokens))


def unoccupied(forest) -> list[list[int]]:
    """The free list a row must keep: the maximal runs of slots no resident node holds, in slot order."""
    taken = [False] * forest.capacity
    for node in forest.nodes():
        taken[node.slot : node.end] = [True] * node.length
    runs, start = [], None
    for slot, used in enumerate(taken + [True]):
        if not used and start is None:
            start = slot
        elif used and start is not None:
            runs.append([start, slot])
            start = None
    return runs


def test_a_resident_document_is_reused_and_freed_room_is_taken_again():
    doc = list(range(10, 30))
    questions = [[40 + i, 41 + i] for i in range(4)]
    forest = PrefixTree(20 + 2 * (2 + ROOM))
    assert forest.place(0, doc + questions[0], ROOM) is not None
    assert forest.place(1, doc + questions[1], ROOM) is not None  # the document is not stored again
    assert forest.used() == 20 + 2 * (2 + ROOM)
    assert forest.place(2, doc + questions[2], ROOM) is None  # full
    forest.release(0)
    forest.collect()  # stream 0's question and answer regions are free; the document stays for stream 1
    assert forest.place(2, doc + questions[2], ROOM) is not None  # the freed region, after the document
    assert forest.used() == 20 + 2 * (2 + ROOM)
    forest.release(1)
    forest.release(2)
    forest.collect()
    assert forest.used() == 0 and forest.slots.free == [[0, forest.capacity]]


def test_a_prefix_no_stream_uses_is_reused_until_collected():
    forest = PrefixTree(40)
    forest.place(0, list(range(10, 30)) + [5], ROOM)
    forest.release(0)  # the document has no user now, but stays until `collect`
    forest.place(1, list(range(10, 30)) + [6, 7], ROOM)
    forest.collect()
    assert forest.used() == 20 + 2 + ROOM  # the document once, stream 1's own tokens and answer


def test_a_freed_region_before_its_document_holds_a_question():
    """Ancestors are seen wherever they lie: the smallest free region that holds a question and its answer room
    takes it, here one before its document's slots."""
    forest = PrefixTree(30)
    forest.place(0, [1, 2, 3], ROOM)  # slots 0..5
    forest.place(1, list(range(10, 20)), ROOM)  # the document: slots 6..18
    forest.release(0)
    forest.collect()  # 0..5 free, before the document; 19..29 free after it
    forest.place(2, list(range(10, 20)) + [7, 8], 2)  # 4 slots: the smaller free region
    check(forest, {1: list(range(10, 20)), 2: list(range(10, 20)) + [7, 8]})
    assert forest.answers[2].parent.slot == 0 and forest.answers[2].slot == 2


def test_a_document_no_free_region_holds_takes_several():
    """A prompt whose new tokens no free region holds takes several, largest first, as a chain of nodes that later
    prompts of its document walk through; prefill writes the chain parents first."""
    forest = PrefixTree(40)
    for i in range(4):  # streams of 10 slots: 0..9, 10..19, 20..29, 30..39
        forest.place(i, [100 + i] * 7, ROOM)
    for node in forest.pending():  # prefilled
        node.written = len(node.tokens)
    for i in (0, 2):
        forest.release(i)
    forest.collect()  # 0..9 and 20..29 free
    doc = list(range(10, 22))
    assert forest.place(4, doc + [5], ROOM) is not None  # 16 slots: the answer room (3), then 13 tokens in two
    chain = []
    node = forest.answers[4].parent
    while node is not forest.root:
        chain.append(node)
        node = node.parent
    assert len(chain) == 2 and sum(len(n.tokens) for n in chain) == 13
    assert forest.pending() == chain[::-1]
    forest.release(1)
    forest.collect()
    assert forest.place(5, doc + [6], ROOM) is not None  # the document reused through its chain
    assert forest.used() == 13 + 3 + 1 + ROOM + 10
    check(forest, {3: [103] * 7, 4: doc + [5], 5: doc + [6]})


def test_a_prompt_waits_when_the_free_slots_do_not_hold_it():
    forest = PrefixTree(21)
    forest.place(0, [1] * 10, ROOM)
    assert forest.place(1, [2] * 5, ROOM, spare=ROOM) is None  # 8 slots fit, not 8 more spare
    assert forest.place(1, [2] * 5, ROOM) is not None
    assert forest.slots.free == []
