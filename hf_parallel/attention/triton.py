"""Triton stream-id attention: the backend, and the launcher of `hf_parallel.kernels.stream_attention`.

`TritonBackend.plan` builds the forward's tile plan (which KV slot ranges each row tile
visits) once on the host; every layer's launch reuses it.  A captured decode step keeps
its tile plan in preallocated buffers (`TritonStaticPlan`), rewritten when streams leave.
A prefill forward's document tokens see an ordinary causal prefix: there PyTorch's causal
SDPA (flash attention on the GPU) serves them, and the kernel the rest of the forward.
The launcher (`stream_attention`) refuses, by name, inputs the kernel would compute wrongly.
"""

from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
import triton
from packaging.version import Version
from torch.nn.attention.bias import causal_lower_right

from ..kernels import prebuild
from ..kernels import stream_attention as kernels
from ..row.plan import AttentionPlan, Row, SlotIds
from .backend import AttentionBackend, AttentionCall
from .reference import check_attention_call, plan_on
from .tiles import MIN_CAUSAL_RUN, MIN_DOT_ROWS, CausalRun, TilePlan, build_tile_plan, causal_runs, segment_table

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 16
OWN_TILES_MIN_ANSWER = 512  # own_tiles="auto": answer room per stream from which decode splits off own keys


@dataclass
class TritonPlan(AttentionPlan):
    """A plan with the forward's tile plan, built before the forward (every layer reuses it).

    tiles:     every query's row tiles (with own_tiles: of the segments several streams see).
    own_tiles: the row tiles of the segments one stream alone sees (`TritonBackend(own_tiles=...)`), or None.
    runs:      runs of queries that see a plain causal prefix (a document's tokens), for causal SDPA.
    run_tiles: the row tiles of the other queries (None without runs).  A layer with a sliding
               window, a softcap or sinks, which plain SDPA does not take, runs `tiles` instead.
    """

    tiles: TilePlan | None = None
    runs: tuple[CausalRun, ...] = ()
    run_tiles: TilePlan | None = None
    own_tiles: TilePlan | None = None  # with `TritonBackend(own_tiles=...)`: `tiles` the shared part, this the own


class TritonStaticPlan:
    """A captured step's tile plan in buffers sized for `bucket` queries, refilled when streams leave.

    `plan` builds the captured forward's plan over the buffers (q_slot: [bucket] int64, the step's static slot
    buffer); `update` rewrites them on the host and raises ValueError when the live streams need more ranges
    than they hold (capture again)."""

    def __init__(self, backend: TritonBackend, row: Row, bucket: int):
        self.bucket, self.streams_per_tile = bucket, backend.streams_per_tile
        self.split = backend.splits(row)
        self.tiles = TilePlan.allocate(
            row.layout, bucket, row.group, streams_per_tile=self.streams_per_tile, device=row.device
        )
        self.own = None
        if self.split:
            spt = own_streams_per_tile(row.group)
            self.own = TilePlan.allocate(row.layout, bucket, row.group, streams_per_tile=spt, device=row.device)

    def plan(self, row: Row, q_slot: torch.Tensor) -> TritonPlan:
        return TritonPlan.for_slots(q_slot, row.ids, kv_len=row.capacity, tiles=self.tiles, own_tiles=self.own)

    def update(self, row: Row, q_slot: torch.Tensor) -> None:
        """Rewrite the buffers for the streams live at `q_slot` [bucket]; ValueError when they cannot hold them."""
        part = "shared" if self.split else "all"
        host = q_slot.cpu()  # once for both plans: the planners read the slots on the host
        tiles = build_tile_plan(row.layout, host, row.group, self.tiles.block_m, self.streams_per_tile, part=part)
        self.tiles.fill_(tiles.to(q_slot.device))
        if self.split:
            self.own.fill_(own_plan(row, host, self.own.block_m).to(q_slot.device))


class TritonBackend(AttentionBackend):
    """The stream mask evaluated in-kernel from index tensors, KV tiles visited by a per-forward tile plan.

    streams_per_tile: most streams packed into one row tile (None: as many as fit).  `1` reads
        the document once per stream, as a prefix-caching server does: the benchmark's P = 1.
    causal_prefill: a prefill forward's document tokens through causal SDPA (False: the kernel
        computes every query; the benchmark's ablation).
    min_causal_run: the fewest consecutive tokens of one segment that go through SDPA (`causal_runs`); shorter
        runs stay in the kernel's tiles.
    own_tiles: "auto", "overlap", "serial" or None: decode forwards (one query per stream) of a stream-major
        row run two plans, the segments several streams see in packed tiles and each stream's own (its question
        and answer) in tiles of one dot's rows (`own_streams_per_tile`), so a stream's own keys meet only its
        rows, not every row of a packed tile; their partial outputs merge by log-sum-exp.  "overlap" runs the
        second launch on a second CUDA stream beside the first, "serial" after it.  "auto" (the default):
        "overlap" where own keys are many and packed tiles wide, that is answers of at least
        `OWN_TILES_MIN_ANSWER` tokens and at most 2 query heads per KV head, else None (one plan: with short
        answers or many query heads per KV head the second launch costs more than it saves; docs/benchmarks.md,
        "Own keys in tiles of their own").
    Raises ValueError for a `streams_per_tile` or `min_causal_run` below 1, or an unknown `own_tiles`.
    """

    name = "hf_parallel_triton"
    prefill_chunk = 8192  # no dense mask to bound it, and fewer forwards cost less host time

    def __init__(
        self,
        streams_per_tile: int | None = None,
        causal_prefill: bool = True,
        own_tiles: str | None = "auto",
        min_causal_run: int = MIN_CAUSAL_RUN,
    ):
        if streams_per_tile is not None and streams_per_tile < 1:
            raise ValueError(f"streams_per_tile must be >= 1, got {streams_per_tile}")
        if min_causal_run < 1:
            raise ValueError(f"min_causal_run must be >= 1, got {min_causal_run}")
        self.min_causal_run = min_causal_run
        if own_tiles not in ("auto", "overlap", "serial", None):
            raise ValueError(f"own_tiles must be 'auto', 'overlap', 'serial' or None, got {own_tiles!r}")
        self.streams_per_tile, self.causal_prefill, self.own_tiles = streams_per_tile, causal_prefill, own_tiles

    def attention(
        self,
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=None,
        dropout=0.0,
        sliding_window=None,
        softcap=None,
        pp_plan: TritonPlan | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """HF attention-interface function.  query [1, H, N, D]; key, value [1, H_kv, S, D] -> [1, N, H, D].

        Refuses what `check_attention_call` refuses, and a plan without tiles (ValueError)."""
        check_attention_call(module, query, attention_mask, dropout, pp_plan, kwargs)
        pp_plan = plan_on(pp_plan, query.device)
        if getattr(pp_plan, "tiles", None) is None:
            raise ValueError("the Triton attention path needs a TritonPlan with its tiles (TritonBackend.plan)")
        sinks = kwargs.get("s_aux")
        overlap = self.own_tiles != "serial"
        if torch.compiler.is_compiling():  # inside torch.compile: the kernel as one opaque op
            out = _compiled_stream_attention(
                query, key, value, pp_plan, scaling, sliding_window, softcap, sinks, overlap
            )
            return out, None
        return self._attend(query, key, value, pp_plan, scaling, sliding_window, softcap, sinks, overlap), None

    @staticmethod
    def _attend(
        query, key, value, plan: TritonPlan, scaling, window, softcap, sinks, overlap, runs: bool = True
    ) -> torch.Tensor:
        """The layer's attention over `plan` (runs=False: its causal runs left out, so only the kernel's launches)."""
        if plan.runs and window is None and softcap is None and sinks is None:
            return stream_attention(query, key, value, plan, plan.run_tiles, scaling, runs=plan.runs if runs else ())
        return stream_attention(
            query, key, value, plan, plan.tiles, scaling, window, softcap, sinks, own=plan.own_tiles, overlap=overlap
        )

    def plan(self, row: Row, q_slot: torch.Tensor, kv_len: int | None = None) -> TritonPlan:
        host = q_slot.cpu()  # once for every planner below, which read the slots on the host
        args = (row.layout, host, row.group, None, self.streams_per_tile, row.device)
        if self.splits(row) and _one_query_per_stream(row.layout, host):
            return TritonPlan.for_slots(
                q_slot,
                row.ids,
                kv_len,
                tiles=build_tile_plan(*args, part="shared"),
                own_tiles=own_plan(row, host, device=row.device),
            )
        runs = causal_runs(row.layout, host, self.min_causal_run) if self.causal_prefill else ()
        run_tiles = build_tile_plan(*args, skip=runs) if runs else None
        return TritonPlan.for_slots(
            q_slot, row.ids, kv_len, tiles=build_tile_plan(*args), runs=runs, run_tiles=run_tiles
        )

    def prebuild(self, plan: TritonPlan, calls: list[AttentionCall]) -> list[Future]:
        """Each kernel the forward over `plan` launches that this process has not built, built on a thread of its
        own (`prebuild.start`).  The launches are collected by running the forward's attention once per call on
        stand-in tensors of the launches' dtypes, strides' alignment and sizes (the keys a single slot wide,
        broadcast over the plan's kv_len), which is all that picks a build; a prefill's causal runs are SDPA's,
        not collected."""
        device = plan.q_slot.device
        if device.type != "cuda":
            return []
        with prebuild.collecting() as launches:
            for call in calls:
                query = torch.empty(
                    1, plan.q_slot.numel(), call.heads, call.head_dim, dtype=call.dtype, device=device
                ).transpose(1, 2)
                kv = query.new_empty(1, call.kv_heads, 1, call.head_dim).expand(-1, -1, plan.kv_len, -1)
                sinks = query.new_zeros(call.heads, dtype=torch.float32) if call.sinks else None
                self._attend(query, kv, kv, plan, None, call.window, call.softcap, sinks, overlap=False, runs=False)
        return prebuild.start(device, launches)

    def static_plan(self, row: Row, bucket: int) -> TritonStaticPlan:
        return TritonStaticPlan(self, row, bucket)

    def splits(self, row: Row) -> bool:
        """Whether decode forwards over `row` run the shared and own plans (`own_tiles`; stream-major rows only,
        every segment a slot range)."""
        if self.own_tiles is None or segment_table(row.layout) is None:
            return False
        return self.own_tiles != "auto" or (row.layout.max_new_tokens >= OWN_TILES_MIN_ANSWER and row.group <= 2)

    @property
    def graph_key(self) -> tuple:
        return (self.name, self.streams_per_tile, self.own_tiles)


def own_streams_per_tile(group: int) -> int:
    """Streams per tile of the own plan: as many as one decode query each fills the smallest dot with."""
    return max(1, MIN_DOT_ROWS // group)


def own_plan(row: Row, q_slot: torch.Tensor, block_m: int | None = None, device=None) -> TilePlan:
    """The own part's tile plan of a decode forward over `row` (`TritonBackend(own_tiles=...)`)."""
    return build_tile_plan(row.layout, q_slot, row.group, block_m, own_streams_per_tile(row.group), device, part="own")


def _one_query_per_stream(layout, q_slot: torch.Tensor) -> bool:
    """A decode forward: every query in a segment of its own."""
    q_seg = layout.slot_seg[q_slot.cpu()]
    return len(torch.unique(q_seg)) == len(q_seg)


@torch.library.custom_op("hf_parallel::stream_attention", mutates_args=())
def _stream_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_slot: torch.Tensor, q_seg: torch.Tensor,
    q_pos: torch.Tensor, slot_seg: torch.Tensor, slot_pos: torch.Tensor, seg_end: torch.Tensor,
    seg_stop: torch.Tensor, tile_query: torch.Tensor, range_ptr: torch.Tensor, ranges: torch.Tensor,
    limits: torch.Tensor, block_m: int, group: int, max_tile_ranges: int, scaling: float, window: int, softcap: float,
    sinks: Optional[torch.Tensor],  # noqa: UP045 - the schema parser of torch.library reads Optional
    own_tile_query: Optional[torch.Tensor], own_range_ptr: Optional[torch.Tensor],  # noqa: UP045
    own_ranges: Optional[torch.Tensor], own_limits: Optional[torch.Tensor],  # noqa: UP045
    own_block_m: int, own_max_tile_ranges: int, overlap: bool,
) -> torch.Tensor:  # fmt: skip
    """`stream_attention` with every input a tensor or a number, so torch.compile treats it as one op.
    own_*: the own plan's tensors (`TritonBackend(own_tiles=...)`), or None."""
    plan = AttentionPlan(q_slot, q_seg, q_pos, key.shape[2], SlotIds(slot_seg, slot_pos, seg_end, seg_stop))
    tiles = TilePlan(tile_query, range_ptr, ranges, limits, block_m, group, max_tile_ranges)
    own = (own_tile_query, own_range_ptr, own_ranges, own_limits)
    own_tiles = TilePlan(*own, own_block_m, group, own_max_tile_ranges) if own_tile_query is not None else None
    return stream_attention(
        query, key, value, plan, tiles, scaling, window or None, softcap or None, sinks, own=own_tiles, overlap=overlap
    )


@_stream_attention_op.register_fake
def _(query, key, value, *args):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _compiled_stream_attention(query, key, value, plan: TritonPlan, scaling, window, softcap, sinks, overlap):
    ids, tiles, own = plan.ids, plan.tiles, plan.own_tiles
    return _stream_attention_op(
        query,
        key,
        value,
        plan.q_slot,
        plan.q_seg,
        plan.q_pos,
        ids.slot_seg,
        ids.slot_pos,
        ids.seg_end,
        ids.seg_stop,
        tiles.tile_query,
        tiles.range_ptr,
        tiles.ranges,
        tiles.limits,
        tiles.block_m,
        tiles.group,
        tiles.max_tile_ranges,
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        window or 0,
        softcap or 0.0,
        sinks,
        *((own.tile_query, own.range_ptr, own.ranges, own.limits) if own is not None else (None,) * 4),
        own.block_m if own is not None else 0,
        own.max_tile_ranges if own is not None else 0,
        overlap,
    )


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the kernel (defaults from `default_config`)."""

    block_n: int  # keys per KV tile
    num_splits: int  # KV splits per row tile (flash-decoding); 1 = write the output directly
    num_warps: int = 4
    num_stages: int = 2
    whole_blocks: bool = True  # the KV blocks every row of a tile sees whole run unmasked (False: the ablation)


def default_config(query: torch.Tensor, key: torch.Tensor, tiles: TilePlan) -> KernelConfig:
    """The launch of `tiles` over `key` [1, H_kv, S, D]: 64-key tiles 3 stages deep for 16-bit inputs of head dim
    <= 128 (32-key tiles, 2 stages, for fp32 or wider heads), and on CUDA KV splits until the grid holds twice as
    many programs as the GPU has SMs (at most `MAX_SPLITS`, each split at least 4 KV tiles): one wave where an SM
    holds two programs (docs/benchmarks.md, "The kernel alone")."""
    wide = query.dtype == torch.float32 or triton.next_power_of_2(query.shape[-1]) > 128
    block_n, stages = (32, 2) if wide else (64, 3)  # fp32 or head dim 256: registers and shared memory
    splits = 1
    programs = tiles.num_tiles * key.shape[1]  # none when causal runs take every query: no partial outputs either
    if query.device.type == "cuda" and programs:
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        splits = max(1, min(MAX_SPLITS, (2 * sms) // programs, key.shape[2] // (4 * block_n)))  # >= 4 KV tiles each
    return KernelConfig(block_n, splits, num_warps=4 if tiles.block_m <= 64 else 8, num_stages=stages)


def own_launch_config(query: torch.Tensor, key: torch.Tensor, own: TilePlan) -> KernelConfig:
    """The own plan's launch (`TritonBackend(own_tiles=...)`): `default_config`'s, since a wider one is slower end
    to end (docs/benchmarks.md, "Own keys in tiles of their own")."""
    return default_config(query, key, own)


def stream_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    tiles: TilePlan,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    runs: tuple[CausalRun, ...] = (),
    own: TilePlan | None = None,
    overlap: bool = False,
    own_config: KernelConfig | None = None,
) -> torch.Tensor:
    """Run the kernel.  query [1, H, N, D]; key, value [1, H_kv, kv_len, D] -> out [1, N, H, D] (new if None;
    a forward of one run alone, a chunk of one document, returns SDPA's output as it is, a transposed view).

    sinks: [H] attention-sink logits (gpt-oss), or None.  With more than one KV split per tile,
    each split writes a partial output and `combine_splits` merges them.  runs: queries that
    `tiles` leaves out, each run a causal prefix, through causal SDPA (no window, softcap or sinks).
    own: a second plan over the same queries (`build_tile_plan(part="own")`, `tiles` then its "shared"
    part), launched after `tiles` (`overlap`: beside it, on a second CUDA stream), its partial outputs
    merged with the first's (`own_config`: its launch config, by default `own_launch_config`'s, with `config`'s
    KV tiles and stages where `config` is given).
    Raises ValueError, TypeError or RuntimeError, naming the problem, for inputs the kernel would compute wrongly
    or read out of bounds (shapes, dtypes, strides, devices, the plan's size), and ValueError for causal runs
    beside a sliding window, a softcap or sinks.
    """
    _check_inputs(query, key, value, plan, tiles)
    if own is not None:
        _check_inputs(query, key, value, plan, own)
    if sinks is not None:
        if sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must hold one logit per query head, [{query.shape[1]}]; got {tuple(sinks.shape)}")
        sinks = sinks.detach().float().contiguous()
    _, heads, n, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5
    if runs and (sliding_window is not None or softcap is not None or sinks is not None):
        raise ValueError("causal runs go through plain SDPA, which takes no sliding window, softcap or sinks")
    if out is None and not tiles.num_tiles and own is None and [(r.first, r.stop) for r in runs] == [(0, n)]:
        # a chunk of one document alone: SDPA's output as the layer's ([1, N, H, D], flash attention's own layout)
        return causal_attention(query, key, value, runs[0], scale).unsqueeze(0).transpose(1, 2)
    cfg = config or default_config(query, key, tiles)
    own_cfg = own_config
    if own is not None and own_cfg is None:
        own_cfg = own_launch_config(query, key, own)
        if config is not None:  # the given KV tiles and stages for both plans
            own_cfg = KernelConfig(
                config.block_n, own_cfg.num_splits, own_cfg.num_warps, config.num_stages, config.whole_blocks
            )
    splits = cfg.num_splits + (own_cfg.num_splits if own_cfg is not None else 0)
    out = torch.empty(1, n, heads, dim, dtype=query.dtype, device=query.device) if out is None else out
    part_o = torch.empty(splits, n, heads, dim, dtype=torch.float32, device=query.device) if splits > 1 else out
    part_lse = torch.empty(splits, n, heads, dtype=torch.float32, device=query.device) if splits > 1 else out
    args = (scale, softcap, sliding_window, sinks)
    with _on_device(query.device):  # Triton launches on the current device: a layer's may be another GPU
        side = _attention_stream(query.device) if own is not None and overlap and query.is_cuda else None
        if side is not None:  # the own plan beside the first (a fork and a join: capturable in a CUDA graph)
            side.wait_stream(torch.cuda.current_stream(query.device))
            with torch.cuda.stream(side):
                _launch(query, key, value, out, part_o, part_lse, plan, own, own_cfg, True, *args, cfg.num_splits)
        if tiles.num_tiles or own is not None:
            _launch(query, key, value, out, part_o, part_lse, plan, tiles, cfg, splits > 1, *args)
        if own is not None and side is None:
            _launch(query, key, value, out, part_o, part_lse, plan, own, own_cfg, True, *args, cfg.num_splits)
        if side is not None:
            torch.cuda.current_stream(query.device).wait_stream(side)
        if splits > 1:  # only with tiles (`default_config`)
            block_d = max(16, triton.next_power_of_2(dim))
            prebuild.run_kernel(
                kernels.combine_splits, (triton.cdiv(n * heads, 16),),
                part_o, part_lse, out, n * heads, heads, splits, out.stride(1), out.stride(2),
                HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_R=16,
            )  # fmt: skip
    for run in runs:  # after the kernel: combine_splits writes every row
        out[0, run.first : run.stop] = causal_attention(query, key, value, run, scale).transpose(0, 1)
    return out


def causal_attention(query, key, value, run: CausalRun, scale: float) -> torch.Tensor:
    """[H, n, D]: the run's queries over keys run.key_start .. each query's slot, by PyTorch's causal SDPA (flash
    attention on the GPU).  A run that starts after its first key is aligned at the bottom right."""
    q = query[:, :, run.first : run.stop]
    k, v = key[:, :, run.key_start : run.key_stop], value[:, :, run.key_start : run.key_stop]
    if q.shape[2] == k.shape[2]:  # the call Transformers' `sdpa` attention makes
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    else:  # the bottom-right causal bias dispatches without grouped-query support: K/V repeated per query head
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)
    return out[0]


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _attention_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of an overlapped launch: one per device, kept (a capture records it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(index)
    return _STREAMS[index]


_STREAMS: dict[int, torch.cuda.Stream] = {}


def _launch(
    query,
    key,
    value,
    out,
    part_o,
    part_lse,
    plan: AttentionPlan,
    tiles: TilePlan,
    cfg: KernelConfig,
    to_parts: bool,
    scaling: float,
    softcap: float | None,
    window: int | None,
    sinks,
    split_offset: int = 0,
) -> None:
    """One launch of the kernel over `tiles`: into `out`, or (to_parts) its cfg.num_splits partial outputs, from
    partial output `split_offset` on."""
    _, heads, n, dim = query.shape
    ids = plan.ids
    interpreted = query.device.type != "cuda"  # TRITON_INTERPRET=1 (checked by _check_inputs)
    prebuild.run_kernel(
        kernels.stream_attention_fwd, (tiles.num_tiles, key.shape[1], cfg.num_splits),
        query, key, value, out, part_o, part_lse, sinks if sinks is not None else part_lse,
        plan.q_slot, plan.q_seg, plan.q_pos, ids.slot_seg, ids.slot_pos, ids.seg_end, ids.seg_stop,
        tiles.tile_query, tiles.range_ptr, tiles.ranges, tiles.limits,
        query.stride(1), query.stride(2), key.stride(1), key.stride(2), value.stride(1), value.stride(2),
        out.stride(1), out.stride(2),
        key.shape[2], n, heads, cfg.num_splits, split_offset, scaling, softcap or 1.0, window or 0,
        GROUP=tiles.group, QUERIES=tiles.block_m // tiles.group, BLOCK_M=tiles.block_m, BLOCK_N=cfg.block_n,
        HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None, RANGES=min(128, max(16, triton.next_power_of_2(tiles.max_tile_ranges))),
        SPLIT=to_parts, PRECISION="ieee" if query.dtype == torch.float32 or interpreted else None,
        DOT_F32=interpreted and query.dtype == torch.bfloat16, USE_SINKS=sinks is not None,
        WHOLE_BLOCKS=cfg.whole_blocks,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _check_inputs(query, key, value, plan: AttentionPlan, tiles: TilePlan) -> None:
    """Refuse, by name, what the kernel would compute wrongly or read out of bounds."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"expected query [1, H, N, D] and key/value [1, H_kv, S, D]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"Triton attention takes one of {DTYPES} for q, k and v; got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if key.shape != value.shape or key.shape[-1] != query.shape[-1] or query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"key/value {tuple(key.shape)} must match each other and query's head dim "
            f"{query.shape[-1]} (at most {MAX_HEAD_DIM})"
        )
    if query.shape[1] != key.shape[1] * tiles.group:
        raise ValueError(f"{query.shape[1]} query heads / {key.shape[1]} KV heads != the plan's group {tiles.group}")
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        raise ValueError("Triton attention needs unit stride along the head dim of q, k and v")
    if query.shape[2] != plan.q_slot.numel() or key.shape[2] > plan.ids.slot_seg.numel():
        raise ValueError(
            f"{query.shape[2]} queries / {key.shape[2]} keys do not fit the plan "
            f"({plan.q_slot.numel()} queries, {plan.ids.slot_seg.numel()} slots)"
        )
    ids = plan.ids
    index = (plan.q_slot, plan.q_seg, plan.q_pos, ids.slot_seg, ids.slot_pos, ids.seg_end, ids.seg_stop)
    if any(not t.is_contiguous() for t in index):
        raise ValueError("the plan's q_slot/q_seg/q_pos and slot ids must be contiguous (the kernel indexes them flat)")
    devices = {t.device for t in (query, key, value, plan.q_slot, plan.ids.slot_seg, tiles.tile_query)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, the plan and the tile plan must share one device; got {sorted(map(str, devices))}")
    if query.device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton attention runs on CUDA (or on the CPU under TRITON_INTERPRET=1)")
        if not prebuild.recording() and (problem := interpreter_problem()):  # a recorded launch is only built
            raise RuntimeError(problem)


@functools.cache
def interpreter_problem() -> str | None:
    """Why the installed Triton's interpreter cannot run the kernel, or None.  NumPy 2.4 no longer converts a
    one-element array to an integer, which Triton's interpreter before 3.7 does for every loop bound that is a
    tensor (triton-lang/triton#9171): the kernel would fail deep inside it."""
    if Version(triton.__version__).release < (3, 7) and Version(np.__version__).release >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run the kernel under NumPy {np.__version__} "
            "(triton-lang/triton#9171): install numpy<2.4 or triton>=3.7"
        )
    return None
