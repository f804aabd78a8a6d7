"""CUDA-graph capture of the decode step, once per bucket of live streams and row capacity.

Each decode step is one forward over one token per live stream.  Its shape only
depends on the number of live streams and the row's capacity, so the step is captured
once per bucket of live counts (`bucket`) over a `StaticRow` (`hf_parallel.engine.rows`:
cache and slot ids of a fixed capacity), with the capacity as kv_len, and replayed with the
step's slots and tokens written in place.
Padding rows repeat the last live row: they write the same K/V to the same slot, so
they change nothing, and their logits are dropped.

A captured step holds its graph, its static buffers and the attention backend's
`StaticPlan`, nothing else: the forward it records is handed to the capture and not kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention import AttentionBackend, StaticPlan
from ..row.plan import AttentionPlan, Row

Forward = Callable[[AttentionPlan, torch.Tensor, torch.Tensor], torch.Tensor]  # (plan, tokens, keep) -> logits
FINE_BUCKETS = 64  # live streams past which a bucket may also be 3/4 of a power of two (the step's GEMMs are no
# longer bound by reading the weights, so padded rows cost time)


def bucket(n: int) -> int:
    """Rows of the captured step that serves n live streams: n rounded up to a power of two, or past
    `FINE_BUCKETS` to 1.5 times one (96, 192, 384, ...), so that a large step pads at most a third."""
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power > FINE_BUCKETS and n <= power * 3 // 4 else power


@dataclass
class CapturedStep:
    """One captured decode step: replay after writing the step's inputs into `slots` and `tokens`."""

    graph: torch.cuda.CUDAGraph
    slots: torch.Tensor  # [B] int64, static input
    tokens: torch.Tensor  # [B] int64, static input
    keep: torch.Tensor  # [B] int64, the logit rows (referenced here so its memory outlives the capture)
    logits: torch.Tensor  # [B, V] float32, static output
    plan: StaticPlan  # the attention backend's buffers, rewritten when the live streams change

    def write(self, row: Row, q_slot: torch.Tensor, tokens: torch.Tensor, changed: bool) -> None:
        """This step's inputs, padded by repeating the last live row (and, if the live streams changed, the plan)."""
        n, b = len(tokens), len(self.tokens)
        self.slots[:n].copy_(q_slot)
        self.tokens[:n].copy_(tokens)
        self.slots[n:].copy_(q_slot[-1:].expand(b - n))
        self.tokens[n:].copy_(tokens[-1:].expand(b - n))
        if changed:
            self.plan.update(row, self.slots)


class DecodeGraphs:
    """Captured decode steps keyed by (bucket, the backend's graph key), sharing one memory pool."""

    def __init__(self):
        self.captured: dict[tuple, CapturedStep] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = False  # a capture failed: this model's steps run eagerly

    def step(self, backend: AttentionBackend, row: Row, forward: Forward, q_slot, tokens, changed: bool):
        """Logits [n, V] of the step over `tokens` [n] at `q_slot` [n], replayed (captured first if need be)."""
        n = len(tokens)
        key = (bucket(n), backend.graph_key)
        cap = self.captured.get(key)
        if cap is not None:
            try:
                cap.write(row, q_slot, tokens, changed)
            except ValueError:  # this layout outgrew the captured plan's buffers
                del self.captured[key]
                cap = None
        if cap is None:
            cap = self.captured[key] = self._capture(backend.static_plan(row, key[0]), row, forward, q_slot, tokens)
        cap.graph.replay()
        return cap.logits[:n]

    def _capture(self, plan: StaticPlan, row: Row, forward: Forward, q_slot, tokens) -> CapturedStep:
        size, device = plan.bucket, tokens.device
        slots = torch.empty(size, dtype=torch.long, device=device)
        static_tokens = torch.empty(size, dtype=torch.long, device=device)
        keep = torch.arange(size, device=device)
        cap = CapturedStep(torch.cuda.CUDAGraph(), slots, static_tokens, keep, None, plan)
        cap.write(row, q_slot, tokens, changed=True)

        def run():
            return forward(plan.plan(row, slots), static_tokens, keep)

        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (allocator, autotuning) off the capture stream
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(cap.graph, pool=self.pool):
            cap.logits = run()
        return cap


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream captures warm up on: one per device, since cuBLAS keeps a workspace for every stream it meets."""
    return torch.cuda.Stream(device)
