"""The model runner: one model's packed row and the forwards over it.

A forward feeds tokens at slots of the row (prompt tokens, each stream's newest token, draft tokens) under
the row's current `Layout`, and returns the logits of the tokens asked for.  The runner asks its
attention backend for each forward's plan and knows nothing else of it.  Where rounds are captured (a
GPU), a forward of few enough tokens replays a CUDA graph of its bucket (`runner.graphs`) over a
`StaticRow`; the rest run eagerly.  Which tokens a forward feeds is the engine's business
(`engine.core`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from ..attention import AttentionBackend
from ..decoding.options import GenerationOptions
from ..models.checks import cache_keyword
from ..models.compiled_parts import RECOMPILE_LIMIT, compiler_imported, recompile_limit
from ..models.placement import loop_device, placement
from ..models.recurrent import SegmentRuns, StateLayer
from ..row.cache import prebuild_writes
from ..row.layout import Layout
from ..row.plan import AttentionPlan, Row, SlotIds, query_group, upload
from .graphs import bucket
from .patching import ModelProfile, use_model
from .rows import RowKeeper, StaticRow

_SIGNATURES = itertools.count()


def next_signature() -> int:
    """A `ForwardInputs.signature` no other forward of this process has had."""
    return next(_SIGNATURES)


CAPTURE_LIMIT = 1024  # tokens of the largest captured forward (its float32 logits: [B, V])
CAPTURED_PROMPT = (
    255  # prompt tokens a captured forward may hold (runs of `attention.tiles.MIN_CAUSAL_RUN`: causal SDPA)
)


@dataclass
class ForwardInputs:
    """One forward's tokens and what it returns.

    slots:   [N] int64 (host), each token's slot.
    tokens:  [N] int64 (the loop's device), each token's id.
    keep:    [K] int64 (host), the tokens whose logits return, in that order; None: every token, in order.
    signature: forwards of one signature differ in their queries only by each decoding stream moving on a
             slot, which a captured plan serves as it is; another signature (or None) rewrites it.  A signature
             names one set of queries over one layout in the whole process (`next_signature`), so a row kept
             between calls never replays a plan another call wrote under the same number.
    prompt_tokens: of the N, prompt tokens (a captured forward holds only a few).
    segment_runs: the split by segment, for layers with a recurrent state.
    """

    slots: np.ndarray
    tokens: torch.Tensor
    keep: np.ndarray | None = None
    signature: int | None = None
    prompt_tokens: int = 0
    segment_runs: SegmentRuns | None = None


class ModelRunner:
    """One model's packed row of `capacity` slots: its cache and slot ids, and its forwards (`forward`).

    With CUDA graphs the row is a `StaticRow`, the call's own or a `RowKeeper`'s (which keeps it for later
    calls: same buffers, so captured rounds replay); otherwise a fresh cache.  Forwards run inside
    `using_model()`.  A model placed over several devices, offloaded or sharded runs eagerly: no CUDA graphs.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        profile: ModelProfile,
        opts: GenerationOptions,
        backend: AttentionBackend,
        capacity: int,
        keeper: RowKeeper | None = None,
    ):
        self.model, self.profile, self.opts, self.backend = model, profile, opts, backend
        self.device = loop_device(model)
        where = placement(model)
        self.spanning = where.spans
        captured = captures_rounds(opts, self.device, where.eager_only, profile.recurrent)
        self.static = None
        if captured:  # the keeper's row, kept between calls, or the call's own
            self.static = (
                keeper.row_for(capacity, profile.cache)
                if keeper
                else StaticRow.for_slots(model, capacity, profile.cache)
            )
            self.cache, capacity = self.static.cache, self.static.capacity
        else:
            self.cache = profile.cache(capacity)
        self.cache.triton_writes = opts.tuning.triton_writes  # a kept row's cache: this call's choice
        self.capacity, self.group = capacity, query_group(model.config)
        self.row: Row | None = None
        self.cache_arg = cache_keyword(model)
        self.compile_failed = False
        self.fuses = fuses_layers(opts, captured, profile.recurrent)
        # what a captured round records besides the backend's plan (`fuses` follows from `compile` on a captured row):
        # a kept row's rounds replay only for the same
        self.variant = (opts.compile, opts.tuning)
        # sibling projections as one GEMM where a GPU runs the whole model (on a CPU a wider GEMM need not be faster);
        # not in a compiled step, whose graph would be guarded on each call's new member forwards
        self.groups = self.device.type == "cuda" and not where.eager_only and opts.compile is not True
        if opts.compile is True and profile.recurrent:
            warnings.warn(
                "compile=True is not applied to models with recurrent layers; decoding uncompiled", stacklevel=3
            )
            self.compile_failed = True

    def using_model(self):
        """`use_model` as this runner's forwards need it: its backend, and its layer parts fused and projections
        grouped where it decides so."""
        return use_model(self.model, self.backend, self.profile, self.fuses, self.groups, self.opts.tuning)

    def relayout(self, layout: Layout) -> None:
        """Lay the row out as `layout` (of at most `capacity` slots): the slot ids rewritten, the cache, its
        capacity and the captured rounds kept."""
        if self.static is not None:
            ids = self.static.load(layout)
        else:
            ids = SlotIds(
                *(upload(t, self.device) for t in (layout.slot_seg, layout.slot_pos, layout.seg_end, layout.seg_stop))
            )
        self.row = Row(layout, ids, self.capacity, self.group)

    @property
    def captures(self) -> bool:
        """Whether forwards may replay CUDA graphs (over a `StaticRow`) rather than run eagerly."""
        return self.static is not None and not self.static.graphs.failed

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """Float logits [K, V] of the tokens `inputs.keep` names (every token where None), on the loop's device."""
        n = len(inputs.slots)
        if self.profile.recurrent:
            self.cache.segment_runs = inputs.segment_runs
        if self._replays(inputs):
            graphs = self.static.graphs
            try:
                logits = graphs.forward(
                    self.backend, self.row, self._graph_forward, inputs.slots, inputs.tokens, inputs.signature,
                    self.variant,
                )  # fmt: skip
                return logits[:n] if inputs.keep is None else logits[upload(torch.from_numpy(inputs.keep), self.device)]
            except RuntimeError as err:  # an op the graph cannot hold: run eagerly from now on
                warnings.warn(f"CUDA-graph capture of a round failed ({err}); running eagerly", stacklevel=2)
                graphs.failed = True
        step = inputs.prompt_tokens == 0
        kv_len = self.capacity if step and self.opts.compile is True else self._kv_len(inputs.slots)
        plan = self.backend.plan(self.row, torch.from_numpy(inputs.slots), kv_len)
        keep = torch.arange(n) if inputs.keep is None else torch.from_numpy(inputs.keep)
        return self.run(plan, inputs.tokens, keep, step)

    def run(self, plan: AttentionPlan, tokens: torch.Tensor, keep: torch.Tensor, step: bool = False) -> torch.Tensor:
        """One eager forward over `tokens` [N] at the plan's slots; float logits [len(keep), V] of rows `keep`.

        step: a forward of no prompt tokens, run compiled when `compile` is on; if compilation fails, this and
        later ones run as they are, with a warning.
        """
        self.cache.plan = plan
        # over several devices the last hidden states may sit on another device than `keep`: a host list indexes
        # any device (and accelerate's hooks leave it where it is)
        keep = keep.tolist() if self.spanning else upload(keep, self.device)
        kwargs = dict(
            input_ids=tokens[None],
            position_ids=plan.q_pos.long()[None],
            use_cache=True,
            logits_to_keep=keep,
            pp_plan=plan,
            **{self.cache_arg: self.cache},
        )
        if step and self.opts.compile is True and not self.compile_failed:
            try:
                with recompile_limit(RECOMPILE_LIMIT):
                    return compiled_call(self.model)(**kwargs).logits[0].float()
            except Exception as err:  # noqa: BLE001 - a real input error recurs below, uncompiled
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(
                    f"torch.compile of the decode step failed ({type(err).__name__}: {err}); running it uncompiled",
                    stacklevel=2,
                )
                self.compile_failed = True
        return self.model(**kwargs).logits[0].float().to(self.device)  # the last layer's device: the loop's

    def prebuild(self, inputs: ForwardInputs, decode_streams: int = 0) -> list[concurrent.futures.Future]:
        """Start building, on threads, the kernels a first forward over `inputs` launches (the K/V write's and the
        backend's, `AttentionBackend.prebuild`, for the plan it runs: eager, or the captured round's) and, with
        `decode_streams`, those of the captured round that decodes that many streams, so that the builds run beside
        each other and beside the first forward's host work; the first launch waits for them
        (`kernels.prebuild.awaiting`)."""
        calls = self.profile.attention_calls
        futures = prebuild_writes(calls, self.device)
        if self._replays(inputs):
            futures += self.backend.prebuild(self._static_plan(inputs.slots), calls)
        else:
            plan = self.backend.plan(self.row, torch.from_numpy(inputs.slots), self._kv_len(inputs.slots))
            futures += self.backend.prebuild(plan, calls)
        answers = self.row.layout.answer_slots
        if (
            self.captures
            and decode_streams
            and bucket(decode_streams) != bucket(len(inputs.slots))
            and answers is not None
            and len(answers) >= decode_streams
        ):
            futures += self.backend.prebuild(self._static_plan(answers[:decode_streams, 0].numpy()), calls)
        return futures

    def _replays(self, inputs: ForwardInputs) -> bool:
        """Whether a forward over `inputs` replays a captured round (few enough tokens, few enough of them prompt
        tokens), rather than running eagerly."""
        graphs = self.static.graphs if self.static is not None else None
        return (
            graphs is not None
            and not graphs.failed
            and len(inputs.slots) <= CAPTURE_LIMIT
            and (inputs.prompt_tokens <= CAPTURED_PROMPT)
        )

    def _static_plan(self, slots: np.ndarray) -> AttentionPlan:
        """A captured round's plan over these slots, padded to their bucket as a replay pads them (for a prebuild)."""
        size = bucket(len(slots))
        padded = torch.from_numpy(np.concatenate([slots, np.repeat(slots[-1:], size - len(slots))]))
        return self.backend.static_plan(self.row, size).plan(self.row, upload(padded, self.device))

    def reset_states(self) -> None:
        """Drop every recurrent state the row holds (its contents start afresh)."""
        for layer in self.cache.layers:
            if isinstance(layer, StateLayer):
                layer.segments.clear()
                layer.pool = None

    def _kv_len(self, slots: np.ndarray) -> int:
        """Keys a forward may see: the slots the row holds (a row whose prompts come and go), else up to the last
        query's slot."""
        extent = self.row.layout.kv_extent
        return extent if extent is not None else int(slots.max()) + 1

    def _graph_forward(self, plan: AttentionPlan, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.run(plan, tokens, keep, step=True)


def captures_rounds(opts: GenerationOptions, device: torch.device, eager_only: bool, recurrent: bool) -> bool:
    """Whether a call's rounds may replay CUDA graphs: `cuda_graphs` on a GPU, but not for layers with a recurrent
    state (their rounds gather and scatter per-stream states: eager and uncompiled for now) or a model placed over
    several devices, offloaded or sharded (`Placement.eager_only` says why)."""
    return opts.cuda_graphs and device.type == "cuda" and not recurrent and not eager_only


def fuses_layers(opts: GenerationOptions, captured: bool, recurrent: bool) -> bool:
    """Whether a call compiles its layers' small operations (`models.compiled_parts`): compile="layers", or "auto"
    where its rounds are captured (a CUDA graph replays the fused kernels; eager rounds would pay the compiled
    regions' guards on the host); never for layers with a recurrent state."""
    return (opts.compile == "layers" or (opts.compile == "auto" and captured)) and not recurrent


def compiles(opts: GenerationOptions, device: torch.device, eager_only: bool, recurrent: bool) -> bool:
    """Whether a call runs `torch.compile`: its layers' parts (`fuses_layers`) or, with compile=True, its steps (not
    those of layers with a recurrent state)."""
    captured = captures_rounds(opts, device, eager_only, recurrent)
    return (opts.compile is True and not recurrent) or fuses_layers(opts, captured, recurrent)


def compiled_call(model: PreTrainedModel):
    """The model's call through `torch.compile`: one compiled function for every model (dynamo guards on the model
    it is handed), so nothing is kept on the model and no reference cycle through it forms."""
    return functools.partial(_compiled_model_call(), model)


@functools.cache
def _compiled_model_call():
    """Dynamo's automatic dynamic shapes: the first live count compiles static, the second recompiles with the
    token count symbolic, and that graph serves every later count but one (sizes 0 and 1 specialize), so a call
    whose streams stop one by one compiles at most three graphs, not one per bucket."""
    compiler_imported()
    return torch.compile(_call_model, dynamic=None)


def _call_model(model, **kwargs):
    return model(**kwargs)
