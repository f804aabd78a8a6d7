"""CUDA-graph capture of the decode step, once per bucket of live streams.

Each decode step is one forward over one token per live stream.  Its shape only
depends on the number of live streams, so the step is captured once per bucket
(live count rounded up to a power of two) with the row's full capacity as kv_len,
and replayed with the step's slots and tokens written in place into static tensors.
Padding rows repeat the last live row: they write the same K/V to the same slot, so
they change nothing, and their logits are dropped.  Capture is opt-out
(`cuda_graphs=False`) and falls back to eager steps with a warning if it fails.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    slots: torch.Tensor  # [B] int64, static input
    tokens: torch.Tensor  # [B] int64, static input
    logits: torch.Tensor  # [B, V] float32, static output
    attn_state: object  # the attention path's static per-graph state (None for the reference)


class DecodeGraphs:
    """Callable `(q_slot [n], tokens [n], changed) -> logits [n, V]` replaying captured steps."""

    def __init__(self, runner):
        self.runner = runner
        self.captured: dict[int, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = False

    def __call__(self, q_slot: torch.Tensor, tokens: torch.Tensor, changed: bool) -> torch.Tensor:
        n = len(tokens)
        if not self.failed:
            bucket = 1 << (n - 1).bit_length()
            try:
                if bucket not in self.captured:
                    self.captured[bucket] = self._capture(bucket, q_slot, tokens)
                    changed = True
                return self._replay(self.captured[bucket], q_slot, tokens, changed)
            except RuntimeError as err:  # an op the graph cannot hold: run eagerly from now on
                warnings.warn(f"CUDA-graph capture of the decode step failed ({err}); decoding eagerly")
                self.failed = True
        runner = self.runner
        return runner.forward(runner.plan(q_slot), tokens, torch.arange(n, device=tokens.device))

    def _fill(self, cap: _Captured, q_slot: torch.Tensor, tokens: torch.Tensor) -> None:
        n, b = len(tokens), len(cap.tokens)
        cap.slots[:n].copy_(q_slot)
        cap.tokens[:n].copy_(tokens)
        cap.slots[n:].copy_(q_slot[-1:].expand(b - n))
        cap.tokens[n:].copy_(tokens[-1:].expand(b - n))

    def _replay(self, cap: _Captured, q_slot, tokens, changed: bool) -> torch.Tensor:
        self._fill(cap, q_slot, tokens)
        if changed and cap.attn_state is not None:
            cap.attn_state.refill(cap.slots)
        cap.graph.replay()
        return cap.logits[: len(tokens)]

    def _capture(self, bucket: int, q_slot: torch.Tensor, tokens: torch.Tensor) -> _Captured:
        runner, device = self.runner, tokens.device
        slots = torch.empty(bucket, dtype=torch.long, device=device)
        static_tokens = torch.empty(bucket, dtype=torch.long, device=device)
        keep = torch.arange(bucket, device=device)
        attn_state = runner.graph_attention_state(bucket)
        cap = _Captured(None, slots, static_tokens, None, attn_state)
        self._fill(cap, q_slot, tokens)
        if attn_state is not None:
            attn_state.refill(slots)

        def step():
            plan = runner.plan(slots, kv_len=runner.layout.num_slots)
            if attn_state is not None:
                attn_state.install(plan)
            return runner.forward(plan, static_tokens, keep)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (allocator, autotuning) off the capture stream
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        cap.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cap.graph, pool=self.pool):
            cap.logits = step()
        return cap
