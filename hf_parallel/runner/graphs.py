"""CUDA-graph capture of a round's forward, once per bucket of tokens and row capacity.

A round's forward feeds N tokens (one per decoding stream, a draft's more, a few prompt tokens) at
their slots.  Its shape depends only on N and the row's capacity, so it is captured once per bucket
of token counts (`bucket`) over a `StaticRow` (`runner.rows`: cache and slot ids of a fixed
capacity), with the capacity as kv_len, and replayed with the round's slots and tokens written in
place; the logits of every fed token come out, and the round keeps the rows it asked for.  Padding
repeats the last token at its slot: the same K/V to the same slot, so it changes nothing, and its
logits are dropped.

A captured round holds its graph, its static buffers and the attention backend's `StaticPlan`,
nothing else: the forward it records is handed to the capture and not kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..attention import AttentionBackend, StaticPlan
from ..row.plan import AttentionPlan, Row, upload

Forward = Callable[[AttentionPlan, torch.Tensor, torch.Tensor], torch.Tensor]  # (plan, tokens, keep) -> logits
FINE_BUCKETS = 64  # tokens past which a bucket may also be 3/4 of a power of two (the forward's GEMMs are no
# longer bound by reading the weights, so padded rows cost time)


def bucket(n: int) -> int:
    """Tokens of the captured forward that serves n: n rounded up to a power of two, or past `FINE_BUCKETS` to 1.5
    times one (96, 192, 384, ...), so that a large forward pads at most a third."""
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power > FINE_BUCKETS and n <= power * 3 // 4 else power


@dataclass
class CapturedRound:
    """One captured forward: replay after writing the round's inputs into `slots` and `tokens`."""

    graph: torch.cuda.CUDAGraph
    slots: torch.Tensor  # [B] int64, static input
    tokens: torch.Tensor  # [B] int64, static input
    keep: torch.Tensor  # [B] int64, every row (referenced here so its memory outlives the capture)
    logits: torch.Tensor  # [B, V] float32, static output
    plan: StaticPlan  # the attention backend's buffers, rewritten when the queries change
    planned: object = None  # the signature of the queries the plan was written for (None: none yet)

    def write(self, row: Row, q_slot: np.ndarray, tokens: torch.Tensor, signature: int | None) -> None:
        """This round's inputs (slots on the host), padded by repeating the last token (and, for queries of another
        signature than the plan's, or of none, the plan: `ForwardInputs.signature`)."""
        n, b = len(tokens), len(self.tokens)
        padded = np.concatenate([q_slot, np.repeat(q_slot[-1:], b - n)])
        host = torch.from_numpy(padded)
        self.slots.copy_(upload(host, self.slots.device))
        self.tokens[:n].copy_(tokens)
        self.tokens[n:].copy_(tokens[-1:].expand(b - n))
        if signature is None or signature != self.planned:
            self.plan.update(row, host)
            self.planned = signature


class RoundGraphs:
    """Captured forwards keyed by (bucket, the backend's graph key, the caller's variant: what else changes the
    recorded forward), sharing one memory pool; `captures` counts the captures made."""

    def __init__(self):
        self.captured: dict[tuple, CapturedRound] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = False  # a capture failed: this model's rounds run eagerly
        self.captures = 0

    def forward(
        self,
        backend: AttentionBackend,
        row: Row,
        forward: Forward,
        q_slot: np.ndarray,
        tokens,
        signature: int | None,
        variant: tuple = (),
    ):
        """Logits [B, V] of every token of the bucketed forward over `tokens` [n] at `q_slot` [n] (host), replayed
        (captured first if need be); rows past n are padding.  `signature`: `ForwardInputs.signature`."""
        key = (bucket(len(tokens)), backend.graph_key, variant)
        cap = self.captured.get(key)
        if cap is not None:
            try:
                cap.write(row, q_slot, tokens, signature)
            except ValueError:  # this layout outgrew the captured plan's buffers
                del self.captured[key]
                cap = None
        if cap is None:
            cap = self.captured[key] = self._capture(backend.static_plan(row, key[0]), row, forward, q_slot, tokens,
                                                     signature)  # fmt: skip
        cap.graph.replay()
        return cap.logits

    def _capture(
        self, plan: StaticPlan, row: Row, forward: Forward, q_slot, tokens, signature: int | None
    ) -> CapturedRound:
        size, device = plan.bucket, tokens.device
        slots = torch.empty(size, dtype=torch.long, device=device)
        static_tokens = torch.empty(size, dtype=torch.long, device=device)
        keep = torch.arange(size, device=device)
        cap = CapturedRound(torch.cuda.CUDAGraph(), slots, static_tokens, keep, None, plan)
        cap.write(row, q_slot, tokens, signature)

        def run():
            return forward(plan.plan(row, slots), static_tokens, keep)

        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (allocator, autotuning) off the capture stream
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(cap.graph, pool=self.pool):
            cap.logits = run()
        self.captures += 1
        return cap


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream captures warm up on: one per device, since cuBLAS keeps a workspace for every stream it meets."""
    return torch.cuda.Stream(device)
