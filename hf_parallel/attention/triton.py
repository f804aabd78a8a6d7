"""Triton stream-id attention: the launcher of the kernel in `hf_parallel.triton_kernels`.

The tile plan (which KV slot ranges each row tile visits) is built once per forward
by `tiles.build_tile_plan` and memoized in the plan; every layer reuses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from ..plan import AttentionPlan, SlotIds
from ..triton_kernels import stream_attention as kernels
from .reference import check_attention_call
from .tiles import SplitTiles, TilePlan, build_split_plans, build_tile_plan, query_group

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 16


def triton_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    pp_plan: AttentionPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function.  query [1, H, N, D]; key, value [1, H_kv, S, D] -> [1, N, H, D]."""
    check_attention_call(module, query, attention_mask, dropout, pp_plan, kwargs)
    if torch.compiler.is_compiling():  # inside torch.compile: the kernel as an opaque op, its tiles planned before
        if "triton_plan" not in pp_plan.cache:
            raise RuntimeError("a compiled forward cannot plan its tiles (a host sync): put them in "
                               "pp_plan.cache['triton_plan'] before calling the compiled model")  # fmt: skip
        return _compiled_stream_attention(query, key, value, pp_plan, pp_plan.cache["triton_plan"], scaling,
                                          sliding_window, softcap), None  # fmt: skip
    tiles = _forward_tiles(pp_plan, query.shape[1] // max(key.shape[1], 1), query.device)
    out = stream_attention(query, key, value, pp_plan, tiles, scaling, sliding_window, softcap)
    return out, None


def plan_tiles(plan: AttentionPlan, model_config) -> TilePlan | SplitTiles:
    """The forward's tile plan, built now on the host (before a compiled forward, which cannot)."""
    return _forward_tiles(plan, query_group(model_config), plan.q_slot.device)


@torch.library.custom_op("hf_parallel::stream_attention", mutates_args=())
def _stream_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_slot: torch.Tensor, q_seg: torch.Tensor,
    q_pos: torch.Tensor, slot_seg: torch.Tensor, slot_pos: torch.Tensor, seg_end: torch.Tensor,
    tile_query: torch.Tensor, range_ptr: torch.Tensor, ranges: torch.Tensor, limits: torch.Tensor,
    block_m: int, group: int, max_tile_ranges: int, scaling: float, window: int, softcap: float,
    own_tile_query: torch.Tensor | None, own_range_ptr: torch.Tensor | None, own_ranges: torch.Tensor | None,
    own_limits: torch.Tensor | None, own_block_m: int, own_max_tile_ranges: int,
) -> torch.Tensor:  # fmt: skip
    """`stream_attention` with every input a tensor or a number, so torch.compile treats it as one op
    (the own_* tensors: the own plan of `SplitTiles`, None without one)."""
    plan = AttentionPlan(q_slot, q_seg, q_pos, key.shape[2], SlotIds(slot_seg, slot_pos, seg_end))
    tiles = TilePlan(tile_query, range_ptr, ranges, limits, block_m, group, max_tile_ranges)
    if own_tile_query is not None:
        own = TilePlan(own_tile_query, own_range_ptr, own_ranges, own_limits, own_block_m, group, own_max_tile_ranges)
        tiles = SplitTiles(tiles, own)
    return stream_attention(query, key, value, plan, tiles, scaling, window or None, softcap or None)


@_stream_attention_op.register_fake
def _(query, key, value, *args):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _compiled_stream_attention(query, key, value, plan: AttentionPlan, tiles: TilePlan | SplitTiles, scaling, window,
                               softcap):  # fmt: skip
    ids = plan.ids
    main, own = (tiles.shared, tiles.own) if isinstance(tiles, SplitTiles) else (tiles, None)
    own_args = (own.tile_query, own.range_ptr, own.ranges, own.limits, own.block_m, own.max_tile_ranges) if own else (
        None, None, None, None, 0, 0)  # fmt: skip
    return _stream_attention_op(
        query, key, value, plan.q_slot, plan.q_seg, plan.q_pos, ids.slot_seg, ids.slot_pos, ids.seg_end,
        main.tile_query, main.range_ptr, main.ranges, main.limits, main.block_m, main.group,
        main.max_tile_ranges, scaling if scaling is not None else query.shape[-1] ** -0.5, window or 0, softcap or 0.0,
        *own_args,
    )  # fmt: skip


def _forward_tiles(plan: AttentionPlan, group: int, device: torch.device) -> TilePlan | SplitTiles:
    """The forward's tile plan, built by the first layer and reused by the others (or set by the caller)."""
    if "triton_plan" not in plan.cache:
        if plan.layout is None:
            raise ValueError("the Triton attention path plans its tiles from the layout: build the plan with one")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a captured forward cannot plan its tiles (a host sync): put a `TilePlan.allocate`d "
                "plan in pp_plan.cache['triton_plan'] before capture and `fill_` it between replays"
            )
        spt = plan.cache.get("streams_per_tile")
        if plan.cache.get("own_tiles"):
            split = build_split_plans(plan.layout, plan.q_slot, group, None, None, spt, device)
            empty = [part.ranges.shape[0] == 0 for part in (split.shared, split.own)]  # e.g. a document's prefill
            plan.cache["triton_plan"] = split.own if empty[0] else split.shared if empty[1] else split
        else:
            plan.cache["triton_plan"] = build_tile_plan(plan.layout, plan.q_slot, group, None, spt, device)
    return plan.cache["triton_plan"]


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters (defaults from `default_config`; eval/gpu_kernel_check.py sweeps them)."""

    block_n: int  # keys per KV tile
    num_splits: int  # KV splits per row tile (flash-decoding); 1 = write the output directly
    num_warps: int = 4
    num_stages: int = 2


def default_config(query: torch.Tensor, key: torch.Tensor, tiles: TilePlan) -> KernelConfig:
    """64-key tiles 3 stages deep (16-bit, head dim <= 128; best of eval/gpu_kernel_check.py's sweep on an
    H200 for decode and prefill alike), and KV splits until the grid fills the GPU twice over."""
    wide = query.dtype == torch.float32 or triton.next_power_of_2(query.shape[-1]) > 128
    block_n, stages = (32, 2) if wide else (64, 3)  # fp32 or head dim 256: registers and shared memory
    splits = 1
    if query.device.type == "cuda":
        sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        programs = tiles.num_tiles * key.shape[1]
        splits = max(1, min(MAX_SPLITS, (2 * sms) // programs, key.shape[2] // (4 * block_n)))  # >= 4 KV tiles each
    return KernelConfig(block_n, splits, num_warps=4 if tiles.block_m <= 64 else 8, num_stages=stages)


def stream_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: AttentionPlan, tiles: TilePlan | SplitTiles,
    scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
    config: KernelConfig | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Run the kernel.  query [1, H, N, D]; key, value [1, H_kv, kv_len, D] -> out [1, N, H, D] (new if None).

    With `SplitTiles` the shared plan runs in `config`'s KV splits and the own plan in one more;
    `combine_splits` merges them all (`config` sets both plans' tiles, the own plan never splits).
    """
    split = isinstance(tiles, SplitTiles)
    _check_inputs(query, key, value, plan, tiles.shared if split else tiles)
    if split:
        _check_inputs(query, key, value, plan, tiles.own)
    _, heads, n, dim = query.shape
    main = tiles.shared if split else tiles
    cfg = config or default_config(query, key, main)
    splits = cfg.num_splits
    parts = splits + 1 if split else splits  # partial outputs to merge (1: the kernel writes `out` itself)
    out = torch.empty(1, n, heads, dim, dtype=query.dtype, device=query.device) if out is None else out
    part_o = torch.empty(parts, n, heads, dim, dtype=torch.float32, device=query.device) if parts > 1 else out
    part_lse = torch.empty(parts, n, heads, dtype=torch.float32, device=query.device) if parts > 1 else out
    attn = dict(scaling=scaling if scaling is not None else dim**-0.5, softcap=softcap, window=sliding_window)
    _launch(query, key, value, out, part_o, part_lse, plan, main, cfg, parts > 1, **attn)
    if split:  # the own plan: one more partial output, after the shared plan's splits
        own = default_config(query, key, tiles.own)
        own_cfg = KernelConfig(config.block_n if config else own.block_n, 1, own.num_warps, own.num_stages)
        _launch(query, key, value, out, part_o[splits:], part_lse[splits:], plan, tiles.own, own_cfg, True, **attn)
    if parts > 1:
        block_d = max(16, triton.next_power_of_2(dim))
        kernels.combine_splits[(triton.cdiv(n * heads, 16),)](
            part_o, part_lse, out, n * heads, heads, parts, out.stride(1), out.stride(2),
            HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_R=16,
        )  # fmt: skip
    return out


def _launch(query, key, value, out, part_o, part_lse, plan: AttentionPlan, tiles: TilePlan, cfg: KernelConfig,
            to_parts: bool, scaling: float, softcap: float | None, window: int | None) -> None:  # fmt: skip
    """One launch of the kernel over `tiles`: into `out`, or (to_parts) its cfg.num_splits partial outputs."""
    _, heads, n, dim = query.shape
    ids = plan.ids
    interpreted = query.device.type != "cuda"  # TRITON_INTERPRET=1 (checked by _check_inputs)
    kernels.stream_attention_fwd[(tiles.num_tiles, key.shape[1], cfg.num_splits)](
        query, key, value, out, part_o, part_lse,
        plan.q_slot, plan.q_seg, plan.q_pos, ids.slot_seg, ids.slot_pos, ids.seg_end,
        tiles.tile_query, tiles.range_ptr, tiles.ranges, tiles.limits,
        query.stride(1), query.stride(2), key.stride(1), key.stride(2), value.stride(1), value.stride(2),
        out.stride(1), out.stride(2),
        key.shape[2], n, heads, cfg.num_splits, scaling, softcap or 1.0, window or 0,
        GROUP=tiles.group, QUERIES=tiles.block_m // tiles.group, BLOCK_M=tiles.block_m, BLOCK_N=cfg.block_n,
        HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None, RANGES=min(128, max(16, triton.next_power_of_2(tiles.max_tile_ranges))),
        SPLIT=to_parts, PRECISION="ieee" if query.dtype == torch.float32 or interpreted else None,
        DOT_F32=interpreted and query.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _check_inputs(query, key, value, plan: AttentionPlan, tiles: TilePlan) -> None:
    """Refuse, by name, what the kernel would compute wrongly or read out of bounds."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"expected query [1, H, N, D] and key/value [1, H_kv, S, D]; got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")  # fmt: skip
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"Triton attention takes one of {DTYPES} for q, k and v; got "
                        f"{query.dtype}, {key.dtype}, {value.dtype}")  # fmt: skip
    if key.shape != value.shape or key.shape[-1] != query.shape[-1] or query.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"key/value {tuple(key.shape)} must match each other and query's head dim "
                         f"{query.shape[-1]} (at most {MAX_HEAD_DIM})")  # fmt: skip
    if query.shape[1] != key.shape[1] * tiles.group:
        raise ValueError(f"{query.shape[1]} query heads / {key.shape[1]} KV heads != the plan's group {tiles.group}")
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        raise ValueError("Triton attention needs unit stride along the head dim of q, k and v")
    if query.shape[2] != plan.q_slot.numel() or key.shape[2] > plan.ids.slot_seg.numel():
        raise ValueError(f"{query.shape[2]} queries / {key.shape[2]} keys do not fit the plan "
                         f"({plan.q_slot.numel()} queries, {plan.ids.slot_seg.numel()} slots)")  # fmt: skip
    index = (plan.q_slot, plan.q_seg, plan.q_pos, plan.ids.slot_seg, plan.ids.slot_pos, plan.ids.seg_end)
    if any(not t.is_contiguous() for t in index):
        raise ValueError("the plan's q_slot/q_seg/q_pos and slot ids must be contiguous (the kernel indexes them flat)")
    devices = {t.device for t in (query, key, value, plan.q_slot, plan.ids.slot_seg, tiles.tile_query)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, the plan and the tile plan must share one device; got {sorted(map(str, devices))}")
    if query.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton attention runs on CUDA (or on the CPU under TRITON_INTERPRET=1)")
