"""The launcher of `hf_parallel.kernels.stream_attention`: validates, configures and launches the kernel.

`stream_attention` runs one layer's attention over a tile plan (`hf_parallel.attention.tiles`): the
kernel's launches (KV splits merged by `combine_splits`), an own plan's beside them on a second CUDA
stream, and a prefill's causal runs through PyTorch's causal SDPA.  It refuses, by name, inputs the
kernel would compute wrongly or read out of bounds, before any launch.  Inside `torch.compile` the
launch is one opaque op (`compiled_stream_attention`).
"""

from __future__ import annotations

import contextlib
import functools
import os
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
from ..row.plan import AttentionPlan, SlotIds
from .tiles import CausalRun, TilePlan

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 16


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


def compiled_stream_attention(
    query,
    key,
    value,
    plan: AttentionPlan,
    tiles: TilePlan,
    own: TilePlan | None,
    scaling,
    window,
    softcap,
    sinks,
    overlap,
):
    """`stream_attention` inside `torch.compile`: the launch as one opaque op (`tiles` the plan's tile plan, `own` its
    own plan or None)."""
    ids = plan.ids
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
    holds two programs (docs/benchmarks/kernel.md, "The kernel alone")."""
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
    to end (docs/benchmarks/kernel.md, "Own keys in tiles of their own")."""
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
