"""Triton stream-id attention: the backend that plans each forward for the kernel's launcher.

`TritonBackend.plan` builds the forward's tile plan (which KV slot ranges each row tile
visits) once on the host; every layer's launch reuses it.  A captured decode step keeps
its tile plan in preallocated buffers (`TritonStaticPlan`), rewritten when streams leave.
A prefill forward's document tokens see an ordinary causal prefix: there PyTorch's causal
SDPA (flash attention on the GPU) serves them, and the kernel the rest of the forward.
Each layer's attention runs through the launcher (`hf_parallel.attention.launcher`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..kernels import prebuild
from ..row.plan import AttentionPlan, Row
from .backend import AttentionBackend, AttentionCall
from .launcher import KernelConfig, compiled_stream_attention, stream_attention
from .reference import check_attention_call, plan_on
from .tiles import MIN_CAUSAL_RUN, MIN_DOT_ROWS, CausalRun, TilePlan, build_tile_plan, causal_runs, segment_table

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
        """Rewrite the buffers for the queries at `q_slot` [bucket] (host); ValueError when they cannot hold them."""
        part = "shared" if self.split else "all"
        host = q_slot.cpu()  # the planners read the slots on the host
        self.tiles.fill_(
            build_tile_plan(row.layout, host, row.group, self.tiles.block_m, self.streams_per_tile, part=part)
        )
        if self.split:
            self.own.fill_(own_plan(row, host, self.own.block_m))


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
        answers or many query heads per KV head the second launch costs more than it saves; docs/benchmarks/kernel.md,
        "Own keys in tiles of their own").
    launch_config: a function `(query, key, tiles, own) -> KernelConfig` that chooses each launch's parameters
        (`own`: the launch of the own plan), for measuring other launches than the defaults; None (the default):
        `launcher.default_config` and `launcher.own_launch_config`.  Not taken inside a compiled step
        (`compile=True`), which then runs uncompiled.
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
        launch_config: Callable[[torch.Tensor, torch.Tensor, TilePlan, bool], KernelConfig] | None = None,
    ):
        if streams_per_tile is not None and streams_per_tile < 1:
            raise ValueError(f"streams_per_tile must be >= 1, got {streams_per_tile}")
        if min_causal_run < 1:
            raise ValueError(f"min_causal_run must be >= 1, got {min_causal_run}")
        self.min_causal_run = min_causal_run
        if own_tiles not in ("auto", "overlap", "serial", None):
            raise ValueError(f"own_tiles must be 'auto', 'overlap', 'serial' or None, got {own_tiles!r}")
        self.streams_per_tile, self.causal_prefill, self.own_tiles = streams_per_tile, causal_prefill, own_tiles
        self.launch_config = launch_config

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
            if self.launch_config is not None:
                raise ValueError("TritonBackend(launch_config=...) is not taken inside a compiled step")
            plan = pp_plan
            out = compiled_stream_attention(
                query, key, value, plan, plan.tiles, plan.own_tiles, scaling, sliding_window, softcap, sinks, overlap
            )
            return out, None
        return self._attend(query, key, value, pp_plan, scaling, sliding_window, softcap, sinks, overlap), None

    def _attend(
        self, query, key, value, plan: TritonPlan, scaling, window, softcap, sinks, overlap, runs: bool = True
    ) -> torch.Tensor:
        """The layer's attention over `plan` (runs=False: its causal runs left out, so only the kernel's launches)."""
        choose, own = self.launch_config, plan.own_tiles
        if plan.runs and window is None and softcap is None and sinks is None:
            config = choose(query, key, plan.run_tiles, False) if choose is not None else None
            return stream_attention(
                query, key, value, plan, plan.run_tiles, scaling, config=config, runs=plan.runs if runs else ()
            )
        config = choose(query, key, plan.tiles, False) if choose is not None else None
        own_config = choose(query, key, own, True) if choose is not None and own is not None else None
        return stream_attention(
            query, key, value, plan, plan.tiles, scaling, window, softcap, sinks, config=config, own=own,
            overlap=overlap, own_config=own_config,
        )  # fmt: skip

    def plan(self, row: Row, q_slot: torch.Tensor, kv_len: int | None = None) -> TritonPlan:
        host = q_slot.cpu()  # once for every planner below, which read the slots on the host (pass host slots)
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
        return (self.name, self.streams_per_tile, self.own_tiles, self.launch_config)


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
