"""The generation loop over one packed row: prefill every prompt token once, then decode all streams together.

    prefill   every prompt token of the prefix tree once (shared prefixes once), in
              slot order and chunks of `prefill_chunk`, keeping one logit row per prompt
    decode    each step one forward over one new token per live stream, per-token
              positions, per-stream sampling and stopping; finished streams leave

The loop asks its attention backend for each forward's plan and knows nothing else of it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..attention import AttentionBackend
from ..decoding.logits import Processing
from ..decoding.options import GenerationOptions
from ..decoding.sampling import Sampler
from ..kernels import prebuild
from ..models.checks import cache_keyword
from ..models.compiled_parts import RECOMPILE_LIMIT, compiler_imported, recompile_limit
from ..models.placement import loop_device, placement
from ..models.recurrent import SegmentRuns
from ..row.cache import prebuild_writes
from ..row.layout import Layout
from ..row.plan import AttentionPlan, Row, SlotIds, query_group
from .cuda_graphs import bucket
from .patching import Support, use_model
from .rows import RowKeeper, StaticRow
from .speculative import SpeculativeDecode


class Runner:
    """One generation over one packed row: the row's cache and slot ids, and its forwards.

    With CUDA graphs the row is a `StaticRow`, the call's own or a `RowKeeper`'s (which keeps it for later
    calls: same buffers, so the captured decode steps replay); otherwise a fresh cache.
    `run` generates; `prefill`, `decode` and `forward` are its parts (a front end that scores
    runs forwards of its own), to be called inside `using_model()`.
    A model placed over several devices, offloaded or sharded decodes eagerly: no CUDA graphs.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layout: Layout,
        opts: GenerationOptions,
        backend: AttentionBackend,
        support: Support,
        keeper: RowKeeper | None = None,
        assistant_support: Support | None = None,
    ):
        self.model, self.layout, self.opts, self.backend, self.support = model, layout, opts, backend, support
        self.assistant_support = assistant_support  # the assistant model's, where one drafts (`opts.assistant_model`)
        self.device = loop_device(model)
        where = placement(model)
        self.spanning = where.spans
        captured = captures_steps(opts, self.device, where.eager_only, support.recurrent)
        self.static = None
        if captured and keeper is not None:  # the keeper's row, kept between calls
            self.static = keeper.row_for(layout, support.cache)
        elif captured:
            self.static = StaticRow.for_layout(model, layout, support.cache)
        if self.static is not None:
            ids, self.cache, capacity = self.static.load(layout), self.static.cache, self.static.capacity
        else:
            ids = SlotIds.from_layout(layout, self.device)
            self.cache = support.cache(layout.num_slots)
            capacity = layout.num_slots
        self.row = Row(layout, ids, capacity, query_group(model.config))
        self.cache_arg = cache_keyword(model)
        self.compile_failed = False
        self.fuses = fuses_layers(opts, captured, support.recurrent)
        # sibling projections as one GEMM where a GPU runs the whole model (on a CPU a wider GEMM need not be faster);
        # not in a compiled step, whose graph would be guarded on each call's new member forwards
        self.groups = self.device.type == "cuda" and not where.eager_only and opts.compile is not True
        if opts.compile is True and support.recurrent:
            warnings.warn(
                "compile=True is not applied to models with recurrent layers; decoding uncompiled", stacklevel=3
            )
            self.compile_failed = True
        if support.recurrent:
            self.stream_of_segment = torch.full((len(layout.segments),), -1, dtype=torch.long, device=self.device)
            self.stream_of_segment[torch.tensor(layout.answer_segs, device=self.device)] = torch.arange(
                layout.num_prompts, device=self.device
            )

    @torch.inference_mode()
    def run(self) -> list[list[int]]:
        """Every prompt's new tokens, each up to and including EOS when generated."""
        with self.using_model():
            chunks = self.prefill_chunks()
            prefill_builds = self.prebuild_prefill(chunks)
            step_builds = self.prebuild_step()
            with prebuild.awaiting(prefill_builds):  # the prefill's first launch waits for its kernels
                logits = self.prefill(chunks)
            concurrent.futures.wait(prefill_builds + step_builds)  # one that failed fails again at its launch
            return self.decode(logits)

    def relayout(self, layout: Layout) -> None:
        """Lay the row out as `layout` (a refilled row whose prompts came and went): the slot ids rewritten, the
        cache, its capacity and the captured steps kept."""
        ids = self.static.load(layout) if self.static is not None else SlotIds.from_layout(layout, self.device)
        self.layout, self.row = layout, Row(layout, ids, self.row.capacity, self.row.group)

    def using_model(self):
        """`use_model` as this runner's forwards need it: its backend, and its layer parts fused and projections
        grouped where it decides so."""
        return use_model(self.model, self.backend, self.support, self.fuses, self.groups)

    def prebuild_prefill(self, chunks: list) -> list[concurrent.futures.Future]:
        """Start building the kernels of the prefill's forwards (`chunks`: `prefill_chunks`), the K/V write's and
        the backend's (`AttentionBackend.prebuild`), each on a thread of its own, so they build beside each other
        and beside what the first forward does before its first launch."""
        calls = self.support.attention_calls
        futures = prebuild_writes(calls, self.device) if chunks else []
        for chunk in chunks:
            futures += self.backend.prebuild(chunk.plan, calls)
        return futures

    def prebuild_step(self) -> list[concurrent.futures.Future]:
        """Start building the kernels of the first captured decode step, on threads while the prefill runs
        (`AttentionBackend.prebuild`); none where steps are not captured or this one is captured already."""
        n, room = self.layout.num_prompts, self.layout.max_new_tokens
        if self.static is None or self.static.graphs.failed or n == 0 or room < 2:
            return []
        if (bucket(n), self.backend.graph_key) in self.static.graphs.captured:
            return []
        slots = self.layout.answer_slots[:, 0].to(self.device)
        slots = torch.cat([slots, slots[-1:].expand(bucket(n) - n)])  # padded as a captured step pads its rows
        plan = self.backend.static_plan(self.row, bucket(n)).plan(self.row, slots)
        return self.backend.prebuild(plan, self.support.attention_calls)

    def plan(self, q_slot: torch.Tensor, kv_len: int | None = None) -> AttentionPlan:
        """The backend's plan of a forward over the tokens written at `q_slot` [N] (keys up to `kv_len`; by default
        those its queries may see)."""
        return self.backend.plan(self.row, q_slot, kv_len if kv_len is not None else self.row.layout.kv_extent)

    def forward(self, plan: AttentionPlan, tokens: torch.Tensor, keep: torch.Tensor, step: bool = False):
        """One forward over `tokens` [N] at the plan's slots; float logits [len(keep), V] of rows `keep`.

        step: a decode step, run compiled when `compile` is on (prefill chunks run as they are);
        if compilation fails, this and later steps run as they are, with a warning.
        """
        self.cache.plan = plan
        if self.support.recurrent:
            self.cache.segment_runs = self.segment_runs(plan, step)
        # over several devices the last hidden states may sit on another device than `keep`: a host list indexes
        # any device (and accelerate's hooks leave it where it is)
        keep = keep.tolist() if self.spanning else keep
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

    def prefill_chunks(self) -> list[PrefillChunk]:
        """The prefill's forwards: each chunk of `prefill_chunk` prompt slots in slot order, with all it needs on the
        loop's device before the first launches (a copy from the host waits for the GPU's queue: made between two
        chunks, it would idle the GPU while the next chunk launches)."""
        slots, tokens, _ = self.layout.prompt_slots()
        last = self.layout.last_prompt_slots()
        size = self.opts.prefill_chunk_for(self.backend)
        chunks = []
        for chunk, ids in zip(slots.split(size), tokens.split(size)):
            rows, prompts, inverse = (t.to(self.device) for t in _last_rows(chunk, last))
            chunks.append(PrefillChunk(ids.to(self.device), self.plan(chunk.to(self.device)), rows, prompts, inverse))
        return chunks

    def prefill(self, chunks: list[PrefillChunk] | None = None) -> torch.Tensor:
        """Run every prompt token once (`chunks`: `prefill_chunks`, by default made here); logits [P, V] at each
        prompt's last token.  Nothing here waits for the GPU."""
        chunks = chunks if chunks is not None else self.prefill_chunks()
        logits = torch.empty(
            self.layout.num_prompts, self.model.config.get_text_config().vocab_size, device=self.device
        )
        for chunk in chunks:
            out = self.forward(chunk.plan, chunk.ids, chunk.rows)
            logits[chunk.prompts] = out[chunk.inverse]
        if self.support.recurrent:
            self.cache.begin_decode(self.layout.prompt_ends)
        return logits

    def segment_runs(self, plan: AttentionPlan, step: bool) -> SegmentRuns:
        """How the forward's tokens split by segment, for the layers with a recurrent state."""
        if step:  # one token per stream
            return SegmentRuns(rows=self.stream_of_segment[plan.q_seg.long()])
        segs = plan.q_seg.tolist()  # a prefill chunk (or a scoring forward): one host sync
        bounds = [0] + [i for i in range(1, len(segs)) if segs[i] != segs[i - 1]] + [len(segs)]
        runs = [(segs[a], a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        segments = self.layout.segments
        return SegmentRuns(
            runs, [s.parent for s in segments], [s.end for s in segments], frozenset(self.layout.prompt_ends)
        )

    def decode(self, logits: torch.Tensor) -> list[list[int]]:
        """Choose and feed back one token per live stream until every stream stops.

        Each stream's token comes from generate's processors on its own history (`Processing`), then
        greedy argmax or a sample (`Sampler`); a stream stops when any of generate's criteria says so.

        Eager steps drop a stream as soon as it stops.  Captured steps run a bucket of rows
        anyway, so there a stopped stream keeps decoding into its own answer region (which
        only it sees; its tokens are not recorded) until the live streams fit the next
        smaller bucket: the plan is then rebuilt on the host once per bucket, not once per
        stopping stream.  Streams that draft (`opts.speculation`) decode through `SpeculativeDecode`.
        """
        if self.opts.speculation is not None:
            return SpeculativeDecode(self, self.opts.speculation).run(logits)
        n, room = self.layout.num_prompts, self.layout.max_new_tokens
        processing = Processing.for_layout(self.model, self.opts, self.layout, self.device)
        sampler = Sampler(self.opts, self.device)
        out = torch.full((n, room), -1, dtype=torch.long, device=self.device)
        live = torch.arange(n, device=self.device)  # the streams fed this step
        running = torch.ones(n, dtype=torch.bool, device=self.device)  # ... of which have not stopped
        answer_slots = self.layout.answer_slots.to(self.device)
        changed = True  # the set of fed streams changed since the last step
        count = LaggedCount(self.device)
        for step in range(room):
            new = sampler(processing.scores(logits))
            processing.append(new)
            out[live, step] = torch.where(running, new, -1)
            running &= ~processing.stopped(new)
            left = count.previous(running, first=len(live))  # one step late: the GPU runs the step just queued
            if step + 1 == room or left == 0:
                break
            if left < len(live) and (not self.captured_steps or bucket(left) < bucket(len(live))):
                processing.keep(running)
                live, new, running, changed = live[running], new[running], running[running], True
                if len(live) == 0:  # the rest stopped in this step
                    break
                count = LaggedCount(self.device)
            logits = self.step(answer_slots[live, step], new, changed)
            changed = False
        return [[t for t in row if t >= 0] for row in out.tolist()]

    @property
    def captured_steps(self) -> bool:
        """Whether decode steps replay CUDA graphs (over a `StaticRow`) rather than run eagerly."""
        return self.static is not None and not self.static.graphs.failed

    def step(self, q_slot: torch.Tensor, tokens: torch.Tensor, changed: bool) -> torch.Tensor:
        """One decode step: logits [n, V] of the n new tokens, replayed from a captured graph where possible."""
        if self.static is not None and not self.static.graphs.failed:
            try:
                return self.static.graphs.step(self.backend, self.row, self._graph_forward, q_slot, tokens, changed)
            except RuntimeError as err:  # an op the graph cannot hold: run eagerly from now on
                warnings.warn(f"CUDA-graph capture of the decode step failed ({err}); decoding eagerly", stacklevel=2)
                self.static.graphs.failed = True
        plan = self.plan(q_slot, self.row.capacity if self.opts.compile is True else None)  # compiled: one kv_len
        return self.forward(plan, tokens, torch.arange(len(tokens), device=self.device), step=True)

    def _graph_forward(self, plan: AttentionPlan, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.forward(plan, tokens, keep, step=True)


class LaggedCount:
    """How many flags of a decode step's `running` [N] bool are set, read on the host one step late.

    Reading this step's count would make the host wait until the GPU has run the step, and the GPU would then
    idle while the host prepares and launches the next one.  Instead each step's count is copied to pinned host
    memory behind the step's kernels, and the host reads the previous step's, which the GPU finished while this
    step was queued.  Acting one step late costs a stopped stream one more token, decoded into its own answer
    region and not recorded (the stopped rows of a captured step do the same until their bucket shrinks).  On
    the CPU the count is read at once.
    """

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.counts = torch.empty(2, dtype=torch.int64, pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.steps = 0

    def previous(self, running: torch.Tensor, first: int) -> int:
        """The count of the previous call's `running` (`first` at the first call); this call's is queued."""
        if self.device.type != "cuda":
            return int(running.sum())
        i, self.steps = self.steps % 2, self.steps + 1
        self.counts[i].copy_(running.sum(), non_blocking=True)
        self.events[i].record()
        if self.steps == 1:
            return first
        self.events[1 - i].synchronize()
        return int(self.counts[1 - i])


@dataclass
class PrefillChunk:
    """One prefill forward, on the loop's device: its token ids, its plan, the rows whose logits it keeps (the last
    token of each prompt ending in it, once each), and which prompt takes which kept row."""

    ids: torch.Tensor  # [N] int64
    plan: AttentionPlan
    rows: torch.Tensor  # [R] int64, rows of the chunk
    prompts: torch.Tensor  # [K] int64, the prompts ending in the chunk
    inverse: torch.Tensor  # [K] int64, each one's index into rows


def captures_steps(opts: GenerationOptions, device: torch.device, eager_only: bool, recurrent: bool) -> bool:
    """Whether a call's decode steps are captured in CUDA graphs: `cuda_graphs` on a GPU, but not for layers with a
    recurrent state (their steps gather and scatter per-stream states: eager and uncompiled for now) or a model
    placed over several devices, offloaded or sharded (`Placement.eager_only` says why)."""
    return opts.cuda_graphs and device.type == "cuda" and not recurrent and not eager_only


def fuses_layers(opts: GenerationOptions, captured: bool, recurrent: bool) -> bool:
    """Whether a call compiles its layers' small operations (`models.compiled_parts`): compile="layers", or "auto"
    where its decode steps are captured (a CUDA graph replays the fused kernels; eager steps would pay the compiled
    regions' guards on the host); never for layers with a recurrent state."""
    return (opts.compile == "layers" or (opts.compile == "auto" and captured)) and not recurrent


def compiles(opts: GenerationOptions, device: torch.device, eager_only: bool, recurrent: bool) -> bool:
    """Whether a call runs `torch.compile`: its layers' parts (`fuses_layers`) or, with compile=True, its steps (not
    those of layers with a recurrent state)."""
    captured = captures_steps(opts, device, eager_only, recurrent)
    return (opts.compile is True and not recurrent) or fuses_layers(opts, captured, recurrent)


def _last_rows(chunk: torch.Tensor, last: torch.Tensor):
    """Which prompts end inside `chunk` (sorted slots), the unique rows they end at, and each one's row index."""
    idx = torch.searchsorted(chunk, last).clamp(max=len(chunk) - 1)
    prompts = torch.nonzero(chunk[idx] == last).flatten()
    rows, inverse = torch.unique(idx[prompts], return_inverse=True)  # duplicate prompts share a row
    return rows, prompts, inverse


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
