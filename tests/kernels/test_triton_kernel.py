"""The Triton stream-id kernel against the specification (`reference_attention`, `stream_mask`).

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1) on small
shapes; on CUDA the same tests run at full size.  Every kernel output is poisoned with
NaN before the launch, so a row the kernel fails to write fails the comparison.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # @triton.jit picks the interpreter at decoration time: set it before any kernel is defined
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from hf_parallel import generate_tokens  # noqa: E402
from hf_parallel.attention import launcher  # noqa: E402
from hf_parallel.attention import tiles as tile_plans  # noqa: E402
from hf_parallel.attention import triton as triton_path  # noqa: E402
from hf_parallel.attention.reference import reference_attention, stream_mask  # noqa: E402
from hf_parallel.attention.triton import TritonBackend  # noqa: E402
from hf_parallel.frontends.generate import generate_layout  # noqa: E402
from hf_parallel.kernels import prebuild  # noqa: E402
from hf_parallel.kernels import stream_attention as kernels  # noqa: E402
from hf_parallel.row.layout import build_layout  # noqa: E402
from hf_parallel.row.plan import AttentionPlan, Row, SlotIds  # noqa: E402
from tests.helpers.models import generate_alone, random_tokens, tiny_model  # noqa: E402
from tests.helpers.project import ROOT  # noqa: E402
from tests.helpers.prompts import random_tree_prompts  # noqa: E402

if not CUDA and type(kernels.stream_attention_fwd).__name__ != "InterpretedFunction":
    # Another test module imported triton first, so its standard library and our kernels were defined
    # compiled; redefine them under the interpreter (tests/conftest.py setting TRITON_INTERPRET avoids this).
    import triton.language
    import triton.language.standard

    for module in (triton.language.standard, triton.language, kernels):
        importlib.reload(module)

DEVICE = torch.device("cuda" if CUDA else "cpu")
# (atol, rtol) of the kernel's output vs the fp32 reference on the same rounded inputs.  With
# inputs ~N(0, 1) (|v| < 5), rounding P to the input dtype before P@V moves an output by at
# most eps/2 * max|v| (the atol; eps = the dtype's machine epsilon), and rounding the output
# itself by eps/2 relative (the rtol).  fp32 runs both dots in IEEE fp32: only summation
# order and exp2's rounding differ (about 1e-6 seen), so 1e-5 leaves a 10x margin.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5 * 2**-11, 2**-11),  # eps = 2**-10
    torch.bfloat16: (5 * 2**-8, 2**-8),  # eps = 2**-7
}
DTYPES = list(TOLERANCE)
# shapes: small under the interpreter, model-sized on CUDA
DOC = 1000 + 37 if CUDA else 37  # not a multiple of any tile
STREAMS = [1, 3, 17, 64, 256] if CUDA else [1, 3, 17]
HEADS = [(32, 32), (28, 4), (8, 1)] if CUDA else [(2, 2), (7, 1), (4, 2)]  # MHA, Qwen-like GQA group of 7, MQA
HEAD_DIMS = [128, 64, 80] if CUDA else [16, 32, 24]  # 80 / 24: not a power of two, padded in-kernel
BLOCK_N = None if CUDA else 16  # small KV tiles on the CPU, so ranges span several tiles
MODULE = torch.nn.Module().eval()


def doc_questions(n_streams: int, seed: int, max_new_tokens: int = 9, interleaved: bool = False):
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(DOC, gen)
    prompts = [doc + random_tokens(1 + (7 * i) % 9, gen) for i in range(n_streams)]
    return build_layout(prompts, max_new_tokens, interleaved)


def make_plan(layout, q_slot: torch.Tensor, kv_len: int | None = None) -> AttentionPlan:
    return AttentionPlan.for_slots(q_slot.to(DEVICE), SlotIds.from_layout(layout, DEVICE), kv_len)


def decode_slots(layout, step: int, seed: int) -> torch.Tensor:
    """One query per live stream at answer step `step`; a random half of the streams has left."""
    streams = list(range(layout.num_prompts))
    live = sorted(random.Random(seed).sample(streams, max(1, len(streams) // 2))) if len(streams) > 2 else streams
    return layout.answer_slots[live, step]


def random_qkv(plan, heads, kv_heads, dim, dtype, seed, cache_order="hsd"):
    """q [1, H, N, D] and K/V views [1, H_kv, kv_len, D] into a larger cache buffer (strided, like the cache)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n, slots = plan.q_slot.numel(), plan.ids.slot_seg.numel() + 5
    q = torch.randn(1, heads, n, dim, generator=gen, device=DEVICE).to(dtype)
    shape = (1, kv_heads, slots, dim) if cache_order == "hsd" else (1, slots, kv_heads, dim)
    k, v = (torch.randn(shape, generator=gen, device=DEVICE).to(dtype) for _ in range(2))
    if cache_order != "hsd":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return q, k[:, :, : plan.kv_len], v[:, :, : plan.kv_len]


def check(layout, q_slot, heads=(4, 2), dim=16, dtype=torch.float32, seed=0, kv_len=None, tiles=None,
          streams_per_tile=None, num_splits=None, cache_order="hsd", own_split=False, overlap=False,
          whole_blocks=True, **attn):  # fmt: skip
    """Kernel output == reference_attention (fp32, same inputs) within the dtype's tolerance (own_split: the
    shared and own plans, their partial outputs merged)."""
    plan = make_plan(layout, q_slot, kv_len)
    q, k, v = random_qkv(plan, *heads, dim, dtype, seed, cache_order)
    sinks = attn.pop("sinks", None)
    want = reference_attention(MODULE, q.float(), k.float(), v.float(), None, pp_plan=plan, s_aux=sinks, **attn)[0]
    group = heads[0] // heads[1]
    part, own = ("shared", None) if own_split else ("all", None)
    if isinstance(own_split, tile_plans.TilePlan):  # the own plan given (a static plan's buffers)
        own = own_split
    elif own_split:
        spt = triton_path.own_streams_per_tile(group)
        own = tile_plans.build_tile_plan(layout, q_slot, group, streams_per_tile=spt, device=DEVICE, part="own")
    tiles = tiles or tile_plans.build_tile_plan(layout, q_slot, group, streams_per_tile=streams_per_tile, device=DEVICE,
                                                part=part)  # fmt: skip
    out = torch.full((1, q.shape[2], heads[0], dim), float("nan"), dtype=dtype, device=DEVICE)
    config = launcher.default_config(q, k, tiles)
    config = launcher.KernelConfig(BLOCK_N or config.block_n, num_splits or config.num_splits, config.num_warps,
                                   whole_blocks=whole_blocks)  # fmt: skip
    launcher.stream_attention(q, k, v, plan, tiles, config=config, out=out, sinks=sinks, own=own, overlap=overlap,
                              **attn)  # fmt: skip
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
    return tiles


# -- the grid: streams x dtype x prefill/decode, heads and head dims cycled through --


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_streams", STREAMS)
def test_grid(n_streams, dtype, mode):
    i = STREAMS.index(n_streams) + DTYPES.index(dtype)
    layout = doc_questions(n_streams, seed=n_streams)
    q_slot = layout.prompt_slots()[0] if mode == "prefill" else decode_slots(layout, 4, seed=i)
    splits = [None, 1, 3][i % 3]
    check(layout, q_slot, HEADS[i % len(HEADS)], HEAD_DIMS[i % len(HEAD_DIMS)], dtype, seed=i, num_splits=splits)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("splits", [1, 3])
def test_unmasked_blocks_change_no_output(mode, splits):
    """The blocks every row of a tile sees whole run unmasked; masking them too (`whole_blocks=False`, the ablation)
    matches the reference as well, and gives the same output: the same products, summed in the same order (bit for
    bit under the interpreter; on the GPU within the dtype's tolerance, the compiler may schedule the loops apart)."""
    layout = doc_questions(17, seed=5)
    q_slot = layout.prompt_slots()[0] if mode == "prefill" else decode_slots(layout, 4, seed=5)
    plan = make_plan(layout, q_slot)
    q, k, v = random_qkv(plan, 7, 1, 16, torch.bfloat16, seed=5)
    tiles = tile_plans.build_tile_plan(layout, plan.q_slot, 7, device=DEVICE)
    outs = []
    for whole in (True, False):
        check(layout, q_slot, (7, 1), 16, torch.bfloat16, seed=5, num_splits=splits, whole_blocks=whole)
        config = launcher.KernelConfig(BLOCK_N or 64, splits, 4, whole_blocks=whole)
        outs.append(launcher.stream_attention(q, k, v, plan, tiles, config=config))
    if CUDA:
        torch.testing.assert_close(outs[0], outs[1], atol=TOLERANCE[torch.bfloat16][0], rtol=0)
    else:
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dim", HEAD_DIMS + ([256] if CUDA else []))
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_heads_and_head_dims(heads, dim):
    layout = doc_questions(3, seed=dim)
    check(layout, decode_slots(layout, 2, seed=0), heads, dim, torch.bfloat16, seed=dim)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("attn", [dict(sliding_window=12), dict(softcap=5.0), dict(sliding_window=5, softcap=2.0,
                                  scaling=0.3)], ids=["window", "softcap", "window+softcap+scale"])  # fmt: skip
def test_sliding_window_and_softcap(attn, mode):
    layout = doc_questions(3, seed=1)
    q_slot = layout.prompt_slots()[0] if mode == "prefill" else decode_slots(layout, 6, seed=1)
    check(layout, q_slot, (4, 2), 32, torch.float32, num_splits=2, **attn)
    check(layout, q_slot, (4, 2), 32, torch.bfloat16, **attn)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 12])
def test_attention_sinks(mode, splits, window):
    """gpt-oss's sinks (a logit per query head, a key with no value), alone and on sliding-window layers."""
    layout = doc_questions(3, seed=2)
    q_slot = layout.prompt_slots()[0] if mode == "prefill" else decode_slots(layout, 6, seed=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(splits)).to(DEVICE) * 3  # some above the scores
    for dtype in (torch.float32, torch.bfloat16):
        check(layout, q_slot, (4, 2), 32, dtype, num_splits=splits, sinks=sinks, sliding_window=window)


@pytest.mark.parametrize("seed", range(12))
def test_random_prefix_trees(seed):
    """Deep trees (shared system prompts, branches, prompts that are prefixes of others), chunked prefill and decode."""
    rng = random.Random(seed)
    layout = build_layout(random_tree_prompts(rng), max_new_tokens=5, interleaved=seed % 3 == 2)
    slots = layout.prompt_slots()[0]
    start = rng.randrange(len(slots))
    check(layout, slots[start : start + rng.randint(1, 40)], (4, 2), 16, seed=seed)  # a prefill chunk
    check(layout, layout.answer_slots[:, rng.randrange(5)], (2, 2), 16, seed=seed, num_splits=2)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_interleaved_layout(mode):
    layout = doc_questions(5, seed=2, interleaved=True)
    q_slot = layout.prompt_slots()[0] if mode == "prefill" else decode_slots(layout, 7, seed=2)
    check(layout, q_slot, (4, 2), 16)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_one_stream_per_tile(mode):
    layout = doc_questions(5, seed=3)
    q_slot = layout.prompt_slots()[0] if mode == "prefill" else layout.answer_slots[:, 3]
    tiles = check(layout, q_slot, (4, 2), 16, streams_per_tile=1)
    q_seg = layout.slot_seg[q_slot]
    for members in tiles.tile_query.cpu().tolist():
        assert len({int(q_seg[n]) for n in members if n >= 0}) == 1
    if mode == "decode":  # every stream reads the document for itself
        assert tiles.num_tiles == layout.num_prompts


def test_edges():
    layout = doc_questions(4, seed=4)
    check(layout, layout.answer_slots[:, 0])  # decode right after the prompts
    check(layout, layout.answer_slots[:1, 8], num_splits=4)  # one stream left, at its last step
    check(layout, layout.answer_slots[:, 5], kv_len=layout.num_slots)  # the whole row as keys (CUDA-graph shape)
    check(layout, layout.prompt_slots()[0][:1])  # the very first token
    check(layout, layout.answer_slots[:, 2], cache_order="shd")  # K/V strided as [1, S, H_kv, D] transposed
    one = build_layout([[5]], max_new_tokens=1)  # a one-token prompt that is the whole cache
    check(one, torch.tensor([0]), kv_len=1)


def test_more_ranges_than_the_kernel_reads_at_once():
    layout = doc_questions(17, seed=9)
    q_slot = layout.answer_slots[:, 3]
    tiles = tile_plans.build_tile_plan(layout, q_slot, 2, block_m=64, device=DEVICE)
    assert tiles.num_tiles == 1 and tiles.max_tile_ranges == 17  # one range a stream, the first merged with the doc
    check(layout, q_slot, tiles=dataclasses.replace(tiles, max_tile_ranges=1), num_splits=3)  # 16 at a time


def test_padding_rows_repeat_the_last_query():
    """A captured decode step pads its rows by repeating the last live query: same output rows."""
    layout = doc_questions(5, seed=5)
    q_slot = layout.answer_slots[[0, 2, 3], 4]
    check(layout, torch.cat([q_slot, q_slot[-1:].expand(5)]), (4, 2), 16)


def test_plan_stays_valid_across_steps_and_refills_in_place():
    """One plan over whole answer regions serves every decode step; `fill_` swaps in a smaller live set."""
    layout = doc_questions(6, seed=6)
    buffers = tile_plans.TilePlan.allocate(layout, max_queries=6, group=2, block_m=16, device=DEVICE)
    buffers.fill_(tile_plans.build_tile_plan(layout, layout.answer_slots[:, 0], 2, block_m=16))
    for step in (0, 3, 8):
        check(layout, layout.answer_slots[:, step], kv_len=layout.num_slots, tiles=buffers)
    live = [1, 4, 5]
    buffers.fill_(tile_plans.build_tile_plan(layout, layout.answer_slots[live, 2], 2, block_m=16))
    for step in (2, 7):
        check(layout, layout.answer_slots[live, step], kv_len=layout.num_slots, tiles=buffers)


def test_static_plan_refills_for_the_live_streams():
    """The Triton backend's `StaticPlan` (a captured step's tile buffers), refilled as streams leave."""
    layout = doc_questions(6, seed=11)
    row = Row(layout, SlotIds.from_layout(layout, DEVICE), layout.num_slots, group=2)
    static = TritonBackend().static_plan(row, bucket=8)
    assert static.bucket == 8  # what a captured step is sized by
    for live, steps in [(list(range(6)), (0, 3)), ([1, 4, 5], (4, 8)), ([2], (8,))]:
        live = live + live[-1:] * (8 - len(live))  # the bucket's padding rows repeat the last live row
        static.update(row, layout.answer_slots[live, steps[0]].to(DEVICE))
        for t in steps:
            q_slot = layout.answer_slots[live, t].to(DEVICE)
            assert static.plan(row, q_slot).tiles is static.tiles
            check(layout, q_slot, kv_len=layout.num_slots, tiles=static.tiles)


def test_static_own_split_plans_refill_for_the_live_streams():
    """With `own_tiles`, a captured step's buffers hold both plans, both refilled as streams leave."""
    layout = doc_questions(6, seed=12)
    row = Row(layout, SlotIds.from_layout(layout, DEVICE), layout.num_slots, group=2)
    static = TritonBackend(own_tiles="serial").static_plan(row, bucket=8)
    for live, steps in [(list(range(6)), (0, 3)), ([1, 4, 5], (4, 8)), ([2], (8,))]:
        live = live + live[-1:] * (8 - len(live))  # the bucket's padding rows repeat the last live row
        static.update(row, layout.answer_slots[live, steps[0]].to(DEVICE))
        for t in steps:
            q_slot = layout.answer_slots[live, t].to(DEVICE)
            plan = static.plan(row, q_slot)
            assert plan.tiles is static.tiles and plan.own_tiles is static.own
            check(layout, q_slot, kv_len=layout.num_slots, tiles=static.tiles, own_split=static.own)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_captured_step_replays_with_refilled_plan():
    """The generation loop's use: capture once with preallocated tiles, write slots and refill between replays."""
    layout, rows, heads, dim = doc_questions(6, seed=10), 8, (4, 2), 64
    ids = SlotIds.from_layout(layout, DEVICE)
    slots = torch.empty(rows, dtype=torch.long, device=DEVICE)
    tiles = tile_plans.TilePlan.allocate(layout, rows, group=2, device=DEVICE)
    q, k, v = random_qkv(make_plan(layout, slots.fill_(0), layout.num_slots), *heads, dim, torch.bfloat16, 0)
    out = torch.empty(1, rows, heads[0], dim, dtype=q.dtype, device=DEVICE)

    def step():
        plan = AttentionPlan(slots, ids.slot_seg[slots], ids.slot_pos[slots], layout.num_slots, ids)
        launcher.stream_attention(q, k, v, plan, tiles, out=out)

    def write(live, t):  # pad by repeating the last live row, as the generation loop does
        s = layout.answer_slots[live, t].to(DEVICE)
        slots[: len(s)], slots[len(s) :] = s, s[-1]

    graph, previous = torch.cuda.CUDAGraph(), None
    for live, t in [(list(range(6)), 0), (list(range(6)), 3), ([1, 4], 4), ([1, 4], 8), ([2], 8)]:
        write(live, t)
        if live != previous:
            tiles.fill_(tile_plans.build_tile_plan(layout, slots, 2, block_m=tiles.block_m))
        if previous is None:
            step()  # compile outside the capture
            with torch.cuda.graph(graph):
                step()
        out.fill_(float("nan"))
        graph.replay()
        plan = make_plan(layout, slots, layout.num_slots)
        want = reference_attention(MODULE, q.float(), k.float(), v.float(), None, pp_plan=plan)[0]
        torch.testing.assert_close(out.float(), want, atol=TOLERANCE[q.dtype][0], rtol=TOLERANCE[q.dtype][1])
        previous = live


def scanned_slots(tiles, tile: int, members: list[int], q_slot: list[int], kv_len: int):
    """What the kernel visits for one tile, its ranges clipped as the kernel clips them: [(range, slots)]."""
    tile_stop = kv_len
    out = []
    for r in range(tiles.range_ptr[tile], tiles.range_ptr[tile + 1]):
        start, stop, clip, by_ids = tiles.ranges[r].tolist()
        stop = min(stop, q_slot[clip] + 1) if clip >= 0 else stop
        out.append((r, range(start, min(stop, tile_stop))))
    return out


def random_forwards(seed: int, interleaved: bool):
    """(layout, q_slot, plan, stream mask) of a random prefix tree's prefill tail and of one decode step."""
    rng = random.Random(seed)
    layout = build_layout(random_tree_prompts(rng), max_new_tokens=4, interleaved=interleaved)
    prefill = layout.prompt_slots()[0]
    for q_slot in (prefill[rng.randrange(len(prefill)) :], layout.answer_slots[:, rng.randrange(4)]):
        plan = make_plan(layout, q_slot)
        yield layout, q_slot, plan, stream_mask(plan).cpu()


@pytest.mark.parametrize("streams_per_tile", [None, 1, 2])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_plan_scans_exactly_the_visible_slots(seed, interleaved, streams_per_tile):
    """Stream-major: a tile visits exactly the union of its queries' visible slots (interleaved: a superset),
    and each query's limits (then causality) reproduce its row of the stream mask exactly."""
    for layout, q_slot, plan, mask in random_forwards(seed, interleaved):
        tiles = tile_plans.build_tile_plan(layout, q_slot, group=1, block_m=16, streams_per_tile=streams_per_tile)
        slots = q_slot.tolist()
        rows = [[n for n in members if n >= 0] for members in tiles.tile_query.tolist()]
        assert sorted(n for members in rows for n in members) == list(range(len(slots)))  # each query in one tile
        for t, members in enumerate(rows):
            scanned = scanned_slots(tiles, t, members, slots, plan.kv_len)
            seen = {k for _, keys in scanned for k in keys}
            visible = set(mask[members].any(0).nonzero().flatten().tolist())
            assert visible <= seen and (interleaved or seen == visible)
            seg = layout.slot_seg.tolist()
            for j, n in enumerate(members):
                by_plan = {k for r, keys in scanned for k in keys if (k <= slots[n] or seg[k] != seg[slots[n]])
                           and k < tiles.limits[r, j] and (not tiles.ranges[r, 3] or mask[n, k])}  # fmt: skip
                assert by_plan == set(mask[n].nonzero().flatten().tolist())


def _row_layouts(rng: random.Random):
    """Stream-major layouts of random prefix trees, built at once and as rows whose prompts came and went."""
    from hf_parallel.row.prefix_tree import PrefixTree

    yield build_layout(random_tree_prompts(rng), max_new_tokens=rng.randint(1, 5))
    prompts = random_tree_prompts(rng) + random_tree_prompts(rng)
    forest, resident = PrefixTree(rng.randint(40, 120)), []
    for index, prompt in enumerate(prompts):
        if forest.place(index, prompt, 3) is not None:
            resident.append(index)
        if resident and rng.random() < 0.3:
            forest.release(resident.pop(rng.randrange(len(resident))))
            forest.collect()
    if resident:
        yield forest.snapshot()


@pytest.mark.parametrize("seed", range(12))
def test_refilled_rows_match_the_reference(seed):
    """Rows whose prompts came and went place a question before its document's slots, or a document in several
    free regions: the kernel sees ancestors wherever they lie, for prefill chunks, decode steps and mixed
    forwards (keys up to the row's extent)."""
    from hf_parallel.row.prefix_tree import PrefixTree

    rng = random.Random(seed)
    forest, doc = PrefixTree(4 * DOC), random_tokens(DOC + 3, torch.Generator().manual_seed(seed))
    for i in range(4):  # four short prompts fill the row; the first and third leave
        forest.place(i, [100 + i] * (DOC - 3), 3)
    for i in (0, 2):
        forest.release(i)
    forest.collect()
    forest.place(4, doc + [5], 3)  # the document in two free regions, its answer room in a third piece of one
    forest.release(1)
    forest.collect()
    forest.place(5, doc + [6, 7], 3)  # its next question wherever it fits, here before the document
    layouts = [forest.snapshot()] + list(_row_layouts(rng))[1:]
    parents = [(s.slot_start, layouts[0].segments[s.parent].slot_start) for s in layouts[0].segments if s.parent >= 0]
    assert any(start < parent for start, parent in parents)  # a segment before its ancestor's slots
    for layout in layouts:
        prompt = layout.prompt_slots()[0]
        answers = torch.tensor([layout.segments[a].slot_start for a in layout.answer_segs])
        step = answers + torch.randint(0, 3, answers.shape)
        mixed = torch.cat([step[torch.randperm(len(step))[: rng.randint(1, len(step))]],
                           prompt[rng.randrange(len(prompt)) :]])  # fmt: skip
        for q_slot in (prompt, step, mixed):
            check(layout, q_slot, heads=rng.choice(HEADS), dim=16, kv_len=layout.num_slots, seed=seed)


@pytest.mark.parametrize("seed", range(12))
def test_own_split_matches_the_reference(seed):
    """`TritonBackend(own_tiles=...)`'s two plans of a decode forward (the segments several streams see in packed
    tiles, each stream's own in small tiles), merged by log-sum-exp: rows built at once and refilled, GQA and MHA,
    KV splits, sinks counted once, windows; on CUDA also beside each other on a second stream."""
    rng = random.Random(seed)
    for layout in [doc_questions(rng.choice(STREAMS), seed)] + list(_row_layouts(rng)):
        answers = torch.tensor([layout.segments[a].slot_start for a in layout.answer_segs])
        last = torch.tensor([layout.segments[a].slot_start + layout.segments[a].length - 1 for a in layout.answer_segs])
        ahead = torch.randint(0, 3, answers.shape, generator=torch.Generator().manual_seed(seed))
        step = torch.minimum(answers + ahead, last)
        heads = rng.choice(HEADS)
        attn = rng.choice([{}, dict(sliding_window=7), dict(sinks=torch.randn(heads[0]).to(DEVICE) * 3)])
        check(layout, step, heads, 16, seed=seed, kv_len=layout.num_slots, num_splits=rng.choice([None, 1, 3]),
              own_split=True, overlap=CUDA and seed % 2 == 0, **attn)  # fmt: skip


@pytest.mark.parametrize("seed", range(20))
def test_own_split_plans_partition_every_querys_visible_slots(seed):
    """The shared plan and the own plan together visit each decode query's visible slots exactly once."""
    rng = random.Random(seed)
    for layout in list(_row_layouts(rng)):
        answers = torch.tensor([layout.segments[a].slot_start for a in layout.answer_segs])
        plan = make_plan(layout, answers, layout.num_slots)
        mask, slots, seg = stream_mask(plan).cpu(), answers.tolist(), layout.slot_seg.tolist()
        seen = {n: [] for n in range(len(slots))}
        for part, spt in (("shared", None), ("own", 2)):
            tiles = tile_plans.build_tile_plan(layout, answers, group=1, block_m=16, streams_per_tile=spt, part=part)
            for t, members in enumerate(tiles.tile_query.tolist()):
                members = [n for n in members if n >= 0]
                for j, n in enumerate(members):
                    for r, keys in scanned_slots(tiles, t, members, slots, plan.kv_len):
                        seen[n] += [k for k in keys if (k <= slots[n] or seg[k] != seg[slots[n]])
                                    and k < tiles.limits[r, j]]  # fmt: skip
        for n, keys in seen.items():
            assert sorted(keys) == mask[n].nonzero().flatten().tolist()  # each visible slot once, nothing else


def test_own_split_generates_as_model_generate():
    """Decode through `TritonBackend(own_tiles="serial")`: `model.generate`'s tokens (prefill as without it)."""
    model = tiny_model("llama").to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    doc = random_tokens(30, gen)
    prompts = [doc + random_tokens(n, gen) for n in (1, 4, 7)] + [random_tokens(5, gen)]
    got = generate_layout(model, build_layout(prompts, 6), max_new_tokens=6, eos_token_id=[], cuda_graphs=False,
                          attn=TritonBackend(own_tiles="serial"))  # fmt: skip
    assert got == [generate_alone(model, p, 6) for p in prompts]


def test_a_launch_config_chooses_every_launch_and_answers_stay_generates():
    """`TritonBackend(launch_config=...)` chooses each launch of both plans (here: every KV block masked, the
    ablation of `KernelConfig.whole_blocks`), and decoding through it gives `model.generate`'s tokens."""
    model = tiny_model("llama").to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    doc = random_tokens(30, gen)
    prompts = [doc + random_tokens(n, gen) for n in (1, 4, 7)]
    asked = []

    def masked(query, key, tiles, own):
        asked.append(own)
        return dataclasses.replace((launcher.own_launch_config if own else launcher.default_config)(query, key, tiles),
                       whole_blocks=False)  # fmt: skip

    got = generate_tokens(model, prompts, max_new_tokens=4, eos_token_id=[], cuda_graphs=False,
                          attn=TritonBackend(own_tiles="serial", launch_config=masked))  # fmt: skip
    assert got == [generate_alone(model, p, 4) for p in prompts]
    assert set(asked) == {False, True}


def test_own_tiles_auto_splits_long_answers_of_wide_tiles():
    """own_tiles="auto" (the default) splits decode forwards where answers are long and packed tiles wide (at most 2
    query heads per KV head), and leaves every other row one plan."""
    short, long = build_layout([[3, 4, 5]], 128), build_layout([[3, 4, 5]], triton_path.OWN_TILES_MIN_ANSWER)
    row = lambda layout, group: Row(layout, SlotIds.from_layout(layout, DEVICE), layout.num_slots, group)  # noqa: E731
    auto = TritonBackend()
    assert auto.own_tiles == "auto"
    assert auto.splits(row(long, 1)) and auto.splits(row(long, 2))
    assert not auto.splits(row(short, 1)) and not auto.splits(row(long, 7))
    assert TritonBackend(own_tiles="serial").splits(row(short, 7))
    assert not TritonBackend(own_tiles=None).splits(row(long, 1))


def test_default_backend_splits_long_answers_and_generates_as_model_generate(monkeypatch):
    """The default Triton path with answers past `OWN_TILES_MIN_ANSWER` (lowered to 6 here) decodes through the two
    plans and gives `model.generate`'s tokens."""
    monkeypatch.setattr(triton_path, "OWN_TILES_MIN_ANSWER", 6)
    calls = []
    original = triton_path.stream_attention
    monkeypatch.setattr(
        triton_path, "stream_attention", lambda *a, **k: calls.append(k.get("own")) or original(*a, **k)
    )
    model = tiny_model("llama").to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    doc = random_tokens(25, gen)
    prompts = [doc + random_tokens(n, gen) for n in (2, 5, 3)]
    got = generate_tokens(model, prompts, max_new_tokens=6, eos_token_id=[], attn="triton")
    assert got == [generate_alone(model, p, 6) for p in prompts]
    assert any(own is not None for own in calls)  # decode steps ran the own plan


@pytest.mark.parametrize("seed", range(40))
def test_array_planner_gives_the_per_tile_planners_plan(seed, monkeypatch):
    """Layouts whose segments are slot ranges are planned over whole arrays; the plan (tiles, ranges, clips and
    limits) is exactly the per-tile planner's, for prefill chunks, decode steps and mixed forwards, with and
    without causal runs left out."""
    rng = random.Random(seed)
    for layout in _row_layouts(rng):
        prompt = layout.prompt_slots()[0]
        answers = torch.tensor([layout.segments[a].slot_start for a in layout.answer_segs])
        mixed = torch.cat([answers[torch.randperm(len(answers))[: rng.randint(1, len(answers))]],
                           prompt[rng.randrange(len(prompt)) :]])  # fmt: skip
        for q_slot in (prompt, answers, mixed):
            group, block_m = rng.choice([(1, None), (2, None), (4, None), (2, 16), (1, 128)])
            runs = tile_plans.causal_runs(layout, q_slot, min_len=rng.randint(2, 6))
            got = tile_plans.build_tile_plan(layout, q_slot, group, block_m, skip=runs)
            with monkeypatch.context() as patch:
                patch.setattr(tile_plans, "segment_table", lambda layout: None)
                want = tile_plans.build_tile_plan(layout, q_slot, group, block_m, skip=runs)
            assert (got.block_m, got.group, got.max_tile_ranges) == (want.block_m, want.group, want.max_tile_ranges)
            for name in ("tile_query", "range_ptr", "ranges", "limits"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_launcher_refuses_bad_inputs():
    layout = doc_questions(2, seed=7)
    plan = make_plan(layout, layout.answer_slots[:, 1])
    tiles = tile_plans.build_tile_plan(layout, plan.q_slot, 2, device=DEVICE)
    q, k, v = random_qkv(plan, 4, 2, 16, torch.float32, 0)
    with pytest.raises(TypeError, match="float16"):
        launcher.stream_attention(q.double(), k.double(), v.double(), plan, tiles)
    with pytest.raises(TypeError, match="float16"):
        launcher.stream_attention(q, k.half(), v, plan, tiles)
    with pytest.raises(ValueError, match="unit stride"):
        strided = torch.zeros(*k.shape[:3], 32, device=DEVICE)[..., ::2]
        launcher.stream_attention(q, strided, strided, plan, tiles)
    with pytest.raises(ValueError, match="at most 256"):
        big = torch.zeros(1, 4, q.shape[2], 512, device=DEVICE)
        launcher.stream_attention(big, big[:, :2], big[:, :2], plan, tiles)
    with pytest.raises(ValueError, match="group"):
        launcher.stream_attention(q, k[:, :1], v[:, :1], plan, tiles)
    with pytest.raises(ValueError, match="needs a TritonPlan with its tiles"):
        TritonBackend().attention(MODULE, q, k, v, None, pp_plan=AttentionPlan.for_slots(plan.q_slot, plan.ids))
    with pytest.raises(ValueError, match="block_m"):
        tile_plans.build_tile_plan(layout, plan.q_slot, group=2, block_m=24)


@pytest.mark.skipif(CUDA, reason="the interpreter runs the kernel on the CPU only")
def test_an_interpreter_that_cannot_run_the_kernel_is_named(monkeypatch):
    """Triton's interpreter before 3.7 fails under NumPy 2.4 at the kernel's first loop (triton-lang/triton#9171):
    the launcher says so and what to install, before the launch.  A launch only recorded, to be built for a GPU
    (eval/kernel_resources.py), is not interpreted, and goes through."""
    layout = doc_questions(2, seed=7)
    plan = make_plan(layout, layout.answer_slots[:, 1])
    tiles = tile_plans.build_tile_plan(layout, plan.q_slot, 2, device=DEVICE)
    q, k, v = random_qkv(plan, 4, 2, 16, torch.float32, 0)
    monkeypatch.setattr(launcher.triton, "__version__", "3.6.0")
    monkeypatch.setattr(launcher.np, "__version__", "2.4.0")
    launcher.interpreter_problem.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0's interpreter .* NumPy 2\.4\.0 .* triton>=3\.7"):
            launcher.stream_attention(q, k, v, plan, tiles)
        with prebuild.collecting() as launches:
            launcher.stream_attention(q, k, v, plan, tiles)
        assert len(launches) == 1
    finally:
        monkeypatch.undo()
        launcher.interpreter_problem.cache_clear()
    launcher.stream_attention(q, k, v, plan, tiles)  # the installed versions


def test_default_decode_launch_as_built_for_hopper(tmp_path):
    """`default_config` sizes a decode step's grid at twice the SMs' programs: one wave only where two of its
    programs fit on an SM at once.  Built for sm_90 on any machine (eval/kernel_resources.py: the launcher's own
    launch, compiled by Triton with its ptxas), at the grid's heads: an SM of an H100 or H200 holds 228 KiB of
    shared memory (1 KiB of it reserved per program) and 64Ki registers.  The build fuses multiplies and adds, as
    the kernel was measured, also where Triton's default does not (TRITON_DEFAULT_FP_FUSION=0, Triton 3.10's)."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend to build with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels compiled, not interpreted
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    done = subprocess.run([sys.executable, "eval/kernel_resources.py", "--arch", "90", "--json", str(tmp_path / "r")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads((tmp_path / "r").read_text())
    assert [r["shape"] for r in rows] == ["codellama-7b", "qwen2.5-7b"]
    for r in rows:
        assert r["block_m"] == 64 and r["warps"] == 4, r  # the grid's tiles: 64 rows, 128 threads
        assert 2 * (r["shared_bytes"] + 1024) <= 228 * 1024, r
        assert 2 * r["warps"] * 32 * (-(-r["registers"] // 8) * 8) <= 65536, r  # allocated 8 registers at a time
        assert r["local_bytes"] == 0, r  # no spills to local memory
        assert r["fused_multiply_adds"] > 0, r


@pytest.mark.parametrize("streams_per_tile", [None, 1])
def test_backend_plans_once_and_every_layer_runs_on_it(streams_per_tile):
    """`TritonBackend.plan` builds the forward's tiles on the host; its attention (a layer) matches the reference."""
    layout = doc_questions(3, seed=8)
    row = Row(layout, SlotIds.from_layout(layout, DEVICE), layout.num_slots, group=2)
    backend = TritonBackend(streams_per_tile)
    plan = backend.plan(row, layout.answer_slots[:, 1].to(DEVICE))
    tiles = plan.tiles
    assert tiles.num_tiles == (3 if streams_per_tile == 1 else 1)
    q, k, v = random_qkv(plan, 4, 2, 16, torch.float32, 0)
    for _ in range(2):  # two layers
        out, weights = backend.attention(MODULE, q, k, v, None, pp_plan=plan)
        assert plan.tiles is tiles and weights is None
        want = reference_attention(MODULE, q, k, v, None, pp_plan=plan)[0]
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# -- causal runs: a prefill forward's document tokens through causal SDPA, the rest through the kernel --

RUN = tile_plans.MIN_CAUSAL_RUN if CUDA else 32  # the interpreter: runs of a few dozen tokens, as small shapes


def run_backend() -> TritonBackend:
    """The Triton backend with runs of RUN tokens or more through causal SDPA."""
    return TritonBackend(min_causal_run=RUN)


def two_documents(seed: int, max_new_tokens: int = 4):
    """Two documents of RUN + 40 tokens, the first with three questions (the second question long enough to be a
    run of its own, but its slots do not follow its document's), the second with one."""
    gen = torch.Generator().manual_seed(seed)
    doc, other = random_tokens(RUN + 40, gen), random_tokens(RUN + 40, gen)
    prompts = [doc + random_tokens(3, gen), doc + random_tokens(RUN + 5, gen), doc + random_tokens(2, gen),
               other + random_tokens(4, gen)]  # fmt: skip
    return build_layout(prompts, max_new_tokens), prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=str)
@pytest.mark.parametrize("chunk", ["whole", "tail", "mixed"])
def test_causal_runs_through_sdpa_match_the_reference(chunk, heads, dtype):
    layout, prompts = two_documents(seed=len(chunk))
    slots = layout.prompt_slots()[0]
    doc_len = len(prompts[0]) - 3
    q_slot = {"whole": slots, "tail": slots[doc_len - RUN - 20 : doc_len], "mixed": slots[doc_len - RUN - 8 :]}[chunk]
    row = Row(layout, SlotIds.from_layout(layout, DEVICE), layout.num_slots, group=heads[0] // heads[1])
    plan = run_backend().plan(row, q_slot.to(DEVICE))
    runs = [(r.first, r.stop, r.key_start) for r in plan.runs]
    if chunk == "tail":  # a later chunk of the document: its queries see the chunks before (bottom-right causal)
        assert runs == [(0, RUN + 20, 0)]
    else:  # each document's tokens; not the long question, whose slots follow its sibling's
        first_doc = [(0, doc_len, 0)] if chunk == "whole" else [(0, RUN + 8, 0)]
        other = layout.segments[layout.prompt_ends[3]]  # the second document and its question: one segment
        at = int((q_slot == other.slot_start).nonzero())
        assert runs == first_doc + [(at, at + len(prompts[3]), other.slot_start)]
    in_tiles = {int(n) for n in plan.run_tiles.tile_query.flatten() if n >= 0}
    assert in_tiles == set(range(len(q_slot))) - {n for a, b, _ in runs for n in range(a, b)}
    q, k, v = random_qkv(plan, *heads, 16 if not CUDA else 128, dtype, seed=1)
    atol, rtol = TOLERANCE[dtype]
    for window in (None, 50):  # a sliding window: the kernel computes every query
        out = run_backend().attention(MODULE, q, k, v, None, pp_plan=plan, sliding_window=window)[0]
        want = reference_attention(MODULE, q.float(), k.float(), v.float(), None, pp_plan=plan, sliding_window=window)
        torch.testing.assert_close(out.float(), want[0], atol=atol, rtol=rtol)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=str)
def test_a_chunk_of_one_document_returns_sdpa_output_uncopied(heads, monkeypatch):
    """A prefill forward whose queries are one document's run alone hands SDPA's output on as the layer's (a
    transposed view, the layout a model reshapes for free), not a copy into a new output; a forward with other
    queries beside the run still writes one output."""
    layout, prompts = two_documents(seed=7)
    slots = layout.prompt_slots()[0]
    doc_len = len(prompts[0]) - 3
    row = Row(layout, SlotIds.from_layout(layout, DEVICE), layout.num_slots, group=heads[0] // heads[1])
    made = []
    sdpa = launcher.F.scaled_dot_product_attention
    monkeypatch.setattr(
        launcher.F, "scaled_dot_product_attention", lambda *a, **k: made.append(sdpa(*a, **k)) or made[-1]
    )
    for q_slot, alone in ((slots[:doc_len], True), (slots[: doc_len + 3], False)):
        plan = run_backend().plan(row, q_slot.to(DEVICE))
        q, k, v = random_qkv(plan, *heads, 16, torch.float32, seed=2)
        made.clear()
        out = run_backend().attention(MODULE, q, k, v, None, pp_plan=plan)[0]
        assert len(made) == 1 and out.shape == (1, len(q_slot), heads[0], 16)
        shares = out.untyped_storage().data_ptr() == made[0].untyped_storage().data_ptr()
        assert shares == alone
        want = reference_attention(MODULE, q, k, v, None, pp_plan=plan)[0]
        torch.testing.assert_close(out, want, **dict(zip(("atol", "rtol"), TOLERANCE[torch.float32])))


def test_decode_steps_and_short_documents_have_no_runs():
    layout, _ = two_documents(seed=3)
    assert tile_plans.causal_runs(layout, layout.answer_slots[:, 0], RUN) == ()
    short = build_layout([[1] * (RUN - 1) + [2], [1] * (RUN - 1) + [3]], 3)  # a document one token short of a run
    assert tile_plans.causal_runs(short, short.prompt_slots()[0], RUN) == ()
    interleaved, _ = build_layout([[1] * (RUN + 3) + [2]], 3, interleaved=True), None
    assert tile_plans.causal_runs(interleaved, interleaved.answer_slots[0], RUN) == ()


def test_long_documents_generate_as_model_generate():
    """Prefill through causal SDPA (document tokens) and the kernel (questions), then decode: == model.generate."""
    model = tiny_model("llama").to(DEVICE)
    _, prompts = two_documents(seed=5, max_new_tokens=5)
    # on CUDA the prompts reach 2 * RUN + 50 tokens, past the tiny config's 256 positions (default rope: no table)
    model.config.max_position_embeddings = max(map(len, prompts)) + 5
    layout = build_layout(prompts, 5)
    assert tile_plans.causal_runs(layout, layout.prompt_slots()[0][: RUN + 100], RUN)  # the SDPA path does run
    got = generate_layout(model, layout, max_new_tokens=5, eos_token_id=[], cuda_graphs=False, attn=run_backend(),
                          prefill_chunk=RUN + 100)  # fmt: skip
    assert got == [generate_alone(model, p, 5) for p in prompts]


# -- end to end: generate_tokens(attn="triton") == model.generate per prompt alone (fp32, greedy) --

E2E = [("llama", {}), ("gemma2", {}), ("mistral", {"streams_per_tile": 1}), ("gpt_oss", {}), ("qwen3_5_text", {}),
       ("gemma2", {"own_tiles": "serial"}), ("mistral", {"own_tiles": "serial"}), ("gpt_oss", {"own_tiles": "serial"}),
       ("qwen3_5_text", {"own_tiles": "serial"})]  # fmt: skip  # the own split with softcaps, windows, sinks
E2E_CUDA = [("qwen2", {}), ("gemma", {}), ("phi3", {}), ("gpt2", {}), ("llama", {"interleaved": True})]


@pytest.mark.parametrize(
    "arch,options",
    E2E + [pytest.param(*case, marks=pytest.mark.skipif(not CUDA, reason="CUDA only (slow in the interpreter)"))
           for case in E2E_CUDA],
    ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()) or "default",
)  # fmt: skip
def test_generate_matches_model_generate(arch, options):
    model = tiny_model(arch).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    doc = random_tokens(30, gen)
    prompts = [doc + random_tokens(n, gen) for n in (1, 4, 7)] + [random_tokens(5, gen)]  # and a second root
    # eager decode: CUDA-graph capture of this path is the generation loop's business, tested there
    backend = TritonBackend(options.get("streams_per_tile"), own_tiles=options.get("own_tiles", "auto"))
    layout = build_layout(prompts, 6, interleaved=options.get("interleaved", False))
    got = generate_layout(model, layout, max_new_tokens=6, eos_token_id=[], cuda_graphs=False, attn=backend)
    assert got == [generate_alone(model, p, 6) for p in prompts]
