"""CUDA-graph capture of the decode step, once per bucket of live streams and row capacity.

Each decode step is one forward over one token per live stream.  Its shape only
depends on the number of live streams and the row's capacity, so the step is captured
once per bucket (live count rounded up to a power of two) over a `StaticRow` (cache
and slot ids of a fixed capacity, kept on the model and reused by later calls), with
the capacity as kv_len, and replayed with the step's slots and tokens written in place.
Padding rows repeat the last live row: they write the same K/V to the same slot, so
they change nothing, and their logits are dropped.  Capture is opt-out
(`cuda_graphs=False`) and falls back to eager steps with a warning if it fails.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass

import torch

from .cache import PackedCache
from .layout import Layout
from .plan import SlotIds


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    slots: torch.Tensor  # [B] int64, static input
    tokens: torch.Tensor  # [B] int64, static input
    keep: torch.Tensor  # [B] int64, the logit rows (referenced here so its memory outlives the capture)
    logits: torch.Tensor  # [B, V] float32, static output
    attn_state: object  # the attention path's static per-graph state (None for the reference)


def bucket(n: int) -> int:
    """Rows of the captured step that serves n live streams: n rounded up to a power of two."""
    return 1 << (n - 1).bit_length()


ROW_ROUNDING = 2048  # slots: a row grows in these steps, so similar calls share captured graphs


class StaticRow:
    """A packed row of fixed capacity (cache + slot-id buffers) and its captured decode steps.

    Kept on the model (`model._hf_parallel_row`) while it is large enough; a call that
    needs more slots replaces it.  Slots past the current layout carry segment -1, so
    no query sees them.
    """

    def __init__(self, model, capacity: int):
        config = model.config.get_text_config()
        self.capacity, self.dtype = capacity, model.dtype
        self.cache = PackedCache(config.num_hidden_layers, capacity)
        self.slot_seg = torch.full((capacity,), -1, dtype=torch.int32, device=model.device)
        self.slot_pos = torch.zeros(capacity, dtype=torch.int32, device=model.device)
        self.seg_end = torch.zeros(capacity, dtype=torch.int32, device=model.device)
        self.graphs = DecodeGraphs()

    @classmethod
    def for_model(cls, model, layout: Layout) -> StaticRow:
        row = getattr(model, "_hf_parallel_row", None)
        if row is None or row.capacity < layout.num_slots or row.dtype != model.dtype:
            if row is not None:  # free the old row (and its graphs' memory pool) before allocating the new one
                model._hf_parallel_row = row = None
                gc.collect()
                torch.cuda.empty_cache()
            capacity = -(-layout.num_slots // ROW_ROUNDING) * ROW_ROUNDING
            row = model._hf_parallel_row = cls(model, capacity)
        return row

    def load(self, layout: Layout) -> SlotIds:
        """Write `layout`'s ids into the static buffers; ids of the full capacity."""
        n, g = layout.num_slots, len(layout.segments)
        self.slot_seg.fill_(-1)
        self.slot_seg[:n].copy_(layout.slot_seg)
        self.slot_pos[:n].copy_(layout.slot_pos)
        self.seg_end[:g].copy_(layout.seg_end)
        return SlotIds(self.slot_seg, self.slot_pos, self.seg_end)


class DecodeGraphs:
    """Callable `(q_slot [n], tokens [n], changed) -> logits [n, V]` replaying captured steps.

    Graphs are keyed by (bucket, attention path, streams_per_tile, own_tiles); `bind` the runner of
    the current call before use (it supplies the layout and the eager fallback).
    """

    def __init__(self):
        self.runner = None
        self.captured: dict[tuple, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = False

    def bind(self, runner) -> DecodeGraphs:
        self.runner = runner
        return self

    def __call__(self, q_slot: torch.Tensor, tokens: torch.Tensor, changed: bool) -> torch.Tensor:
        n = len(tokens)
        if not self.failed:
            opts = self.runner.opts
            key = (bucket(n), self.runner.attn, opts.streams_per_tile, opts.own_tiles)
            try:
                if key in self.captured and not self._refresh(self.captured[key], q_slot, tokens, changed):
                    del self.captured[key]  # this layout outgrew the graph's static tile plan
                if key not in self.captured:
                    self.captured[key] = self._capture(key[0], q_slot, tokens)  # filled as it is captured
                cap = self.captured[key]
                cap.graph.replay()
                return cap.logits[:n]
            except RuntimeError as err:  # an op the graph cannot hold: run eagerly from now on
                warnings.warn(f"CUDA-graph capture of the decode step failed ({err}); decoding eagerly")
                self.failed = True
        return self.runner.eager_step(q_slot, tokens)

    def _fill(self, cap: _Captured, q_slot: torch.Tensor, tokens: torch.Tensor) -> None:
        n, b = len(tokens), len(cap.tokens)
        cap.slots[:n].copy_(q_slot)
        cap.tokens[:n].copy_(tokens)
        cap.slots[n:].copy_(q_slot[-1:].expand(b - n))
        cap.tokens[n:].copy_(tokens[-1:].expand(b - n))

    def _refresh(self, cap: _Captured, q_slot, tokens, changed: bool) -> bool:
        """Write this step's inputs (and, if the live streams changed, the tile plan); False if it cannot fit."""
        self._fill(cap, q_slot, tokens)
        if changed and cap.attn_state is not None:
            try:
                cap.attn_state.refill(cap.slots, self.runner.layout)
            except ValueError:
                return False
        return True

    def _capture(self, bucket: int, q_slot: torch.Tensor, tokens: torch.Tensor) -> _Captured:
        runner, device = self.runner, tokens.device
        slots = torch.empty(bucket, dtype=torch.long, device=device)
        static_tokens = torch.empty(bucket, dtype=torch.long, device=device)
        keep = torch.arange(bucket, device=device)
        attn_state = runner.graph_attention_state(bucket)
        cap = _Captured(None, slots, static_tokens, keep, None, attn_state)
        if not self._refresh(cap, q_slot, tokens, True):
            raise RuntimeError("a freshly allocated tile plan cannot hold this layout")

        def step():
            plan = runner.plan(slots, kv_len=runner.capacity)
            if attn_state is not None:
                attn_state.install(plan)
            return runner.forward(plan, static_tokens, keep, step=True)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (allocator, autotuning) off the capture stream
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        cap.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cap.graph, pool=self.pool):
            cap.logits = step()
        return cap
