"""The attention-backend seam: what the generation loop asks of an attention path.

A backend plans each forward on the host (`plan`), runs per layer inside the model
through transformers' AttentionInterface (`attention`, registered under `name`), and
gives a captured decode step a plan over static buffers (`static_plan`) that is
rewritten in place between replays.  The loop knows nothing else of it: a new path
(a kernel, a mask, sinks) is a new subclass, and nothing in the loop changes.  The
pattern is flashinfer's wrappers (plan once per step, run per layer) and nano-vllm's
captured graphs (static buffers written before each replay).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..row.plan import AttentionPlan, Row


@dataclass(frozen=True)
class AttentionCall:
    """What one kind of the model's attention calls passes besides the tensors' values, as the support probe saw
    it: head counts and size, dtype, and the sliding window, softcap and sinks (`s_aux`) of its layers."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False


class StaticPlan:
    """The plan of a captured decode step of up to `bucket` queries, over buffers that outlive the capture.

    `plan` runs inside the capture, so it may use device ops only; `update` runs on the host
    before a replay whose live streams changed.  This one holds no buffers of its own: it
    serves backends whose `plan` with a given kv_len is device ops alone (derived from the
    step's static slot buffer and the row's static ids).
    """

    def __init__(self, backend: AttentionBackend, row: Row, bucket: int):
        self.backend, self.bucket = backend, bucket

    def plan(self, row: Row, q_slot: torch.Tensor) -> AttentionPlan:
        """The captured forward's plan; q_slot: [bucket] int64, the round's static slot buffer."""
        return self.backend.plan(row, q_slot, kv_len=row.capacity)

    def update(self, row: Row, q_slot: torch.Tensor) -> None:
        """Rewrite the buffers for the queries at `q_slot` [bucket] (host), before a replay whose queries changed;
        ValueError when they cannot hold them (capture again)."""


class AttentionBackend:
    """One attention path.  Subclasses set `name` and implement `attention`; most keep the rest.

    name:          the implementation name registered with transformers' AttentionInterface.
    prefill_chunk: prompt tokens per forward by default (the reference's dense mask bounds it).
    """

    name: str = ""
    prefill_chunk: int = 2048

    def attention(self, module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
        """HF attention-interface function: query [1, H, N, D]; key, value [1, H_kv, S, D] -> [1, N, H, D].

        The forward's plan arrives as the keyword `pp_plan` (the type `plan` returned)."""
        raise NotImplementedError

    def plan(self, row: Row, q_slot: torch.Tensor, kv_len: int | None = None) -> AttentionPlan:
        """The plan of a forward over the tokens written at `q_slot` [N] (host work allowed; host slots spare the
        planner a wait for the GPU)."""
        return AttentionPlan.for_slots(q_slot, row.ids, kv_len)

    def static_plan(self, row: Row, bucket: int) -> StaticPlan:
        """Buffers for the plan of a captured decode step of up to `bucket` queries."""
        return StaticPlan(self, row, bucket)

    def prebuild(self, plan: AttentionPlan, calls: list[AttentionCall]) -> list[Future]:
        """Start building, on threads beside the caller, the kernels that a forward over `plan` launches for each
        of `calls`; the caller waits on the futures before that forward.  A kernel's first build is slow (compiling
        and assembling), so the first call builds the decode step's while its prefill runs (docs/benchmarks/gpu.md,
        "The first call").  This one builds nothing (no kernel of its own)."""
        return []

    @property
    def graph_key(self) -> tuple:
        """What a captured step depends on besides its bucket: steps captured under another key are not reused."""
        return (self.name,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
