"""The generation loop: prefill every prompt token once, then decode all streams together.

prefill   every prompt token of the prefix tree once (shared prefixes once), in
          slot order and chunks of `prefill_chunk`, keeping one logit row per prompt
decode    each step one forward over one new token per live stream, per-token
          positions, per-stream sampling and stopping; finished streams leave
"""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import PreTrainedModel

from .attention import GRAPH_STATES, use_attention
from .cache import PackedCache
from .graphs import StaticRow, bucket
from .layout import Layout, build_layout
from .options import GenerationOptions
from .plan import AttentionPlan, SlotIds
from .sampling import Sampler


@torch.inference_mode()
def generate_tokens(model: PreTrainedModel, prompts: list[list[int]], **options) -> list[list[int]]:
    """Answer every prompt as if alone; shared token prefixes are computed once.

    prompts: P complete prompts (token ids).  Their common prefixes are found from the
    tokens (a prefix tree of any depth), so one document with many questions, several
    documents, a shared system prompt or dialogue turns that extend one another all work.
    options: `GenerationOptions` fields (GenerationConfig names), defaulting to the
    model's generation_config.
    Returns P lists of new tokens, each up to and including EOS when generated.
    """
    opts = GenerationOptions.resolve(model, **options)
    if not prompts:
        return []
    check_model(model)
    check_prompts(model, prompts, opts.max_new_tokens)
    layout = build_layout([list(p) for p in prompts], opts.max_new_tokens, opts.layout == "interleaved")
    runner = _Runner(model, layout, opts)
    with use_attention(model, runner.attn):
        return runner.decode(runner.prefill())


class _Runner:
    """One generation over one packed row: the row's cache and slot ids, and its forwards.

    With CUDA graphs the row is a `StaticRow` kept on the model and reused by later
    calls (same buffers, so the captured decode steps replay); otherwise it is fresh.
    """

    def __init__(self, model: PreTrainedModel, layout: Layout, opts: GenerationOptions):
        self.model, self.layout, self.opts = model, layout, opts
        self.device = model.device
        self.attn = opts.attention_for(self.device)
        self.row = StaticRow.for_model(model, layout) if opts.cuda_graphs and self.device.type == "cuda" else None
        if self.row is not None:
            self.ids, self.cache, self.capacity = self.row.load(layout), self.row.cache, self.row.capacity
        else:
            self.ids = SlotIds.from_layout(layout, self.device)
            self.cache = PackedCache(model.config.get_text_config().num_hidden_layers, layout.num_slots)
            self.capacity = layout.num_slots
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.compile_failed = False

    def plan(self, q_slot: torch.Tensor, kv_len: int | None = None) -> AttentionPlan:
        """The plan of a forward over the tokens written at `q_slot` [N]."""
        plan = AttentionPlan.for_slots(q_slot, self.ids, self.layout, kv_len)
        plan.cache["streams_per_tile"] = self.opts.streams_per_tile
        plan.cache["own_tiles"] = self.opts.own_tiles
        return plan

    def graph_attention_state(self, bucket: int):
        """Static per-graph state of the attention path (the Triton tile plan), or None."""
        factory = GRAPH_STATES.get(self.attn)
        return factory(self, bucket) if factory is not None else None

    def forward(
        self, plan: AttentionPlan, tokens: torch.Tensor, keep: torch.Tensor, step: bool = False
    ) -> torch.Tensor:
        """One forward over `tokens` [N] at the plan's slots; float logits [len(keep), V] of rows `keep`.

        step: a decode step, run compiled when `compile` is on (prefill chunks run as they are);
        if compilation fails, this and later steps run as they are, with a warning.
        """
        self.cache.plan = plan
        kwargs = dict(input_ids=tokens[None], position_ids=plan.q_pos.long()[None], use_cache=True,
                      logits_to_keep=keep, pp_plan=plan, **{self.cache_arg: self.cache})  # fmt: skip
        if step and self.opts.compile and not self.compile_failed:
            if self.attn == "triton":
                from .attention.triton import plan_tiles

                plan_tiles(plan, self.model.config)  # on the host, before the compiled forward (kept if set)
            try:
                with _recompile_limit(RECOMPILE_LIMIT):
                    return compiled_call(self.model)(**kwargs).logits[0].float()
            except Exception as err:  # noqa: BLE001 - a real input error recurs below, uncompiled
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(f"torch.compile of the decode step failed ({type(err).__name__}: {err}); "
                              "running it uncompiled")  # fmt: skip
                self.compile_failed = True
        return self.model(**kwargs).logits[0].float()

    def prefill(self) -> torch.Tensor:
        """Run every prompt token once; logits [P, V] at each prompt's last token."""
        slots, tokens, _ = self.layout.prompt_slots()
        last = self.layout.last_prompt_slots()
        logits = torch.empty(len(last), self.model.config.get_text_config().vocab_size, device=self.device)
        size = self.opts.prefill_chunk_for(self.attn)
        for start in range(0, len(slots), size):
            chunk = slots[start : start + size]
            rows, prompts, inverse = _last_rows(chunk, last)
            ids = tokens[start : start + len(chunk)]
            out = self.forward(self.plan(chunk.to(self.device)), ids.to(self.device), rows.to(self.device))
            logits[prompts.to(self.device)] = out[inverse.to(self.device)]
        return logits

    def decode(self, logits: torch.Tensor) -> list[list[int]]:
        """Sample and feed back one token per live stream until every stream stops.

        Eager steps drop a stream as soon as it stops.  Captured steps run a bucket of rows
        anyway, so there a stopped stream keeps decoding into its own answer region (which
        only it sees; its tokens are not recorded) until the live streams fit the next
        smaller bucket: the tile plan is then rebuilt on the host once per bucket, not
        once per stopping stream.
        """
        n = self.layout.num_prompts
        sampler = Sampler(self.opts, self.device)
        step_fn = self._decode_step_fn()
        out = torch.full((n, self.opts.max_new_tokens), -1, dtype=torch.long, device=self.device)
        live = torch.arange(n, device=self.device)  # the streams fed this step
        running = torch.ones(n, dtype=torch.bool, device=self.device)  # ... of which have not stopped
        answer_slots = self.layout.answer_slots.to(self.device)
        changed = True  # the set of fed streams changed since the last step
        for step in range(self.opts.max_new_tokens):
            new = sampler(logits, step)
            out[live, step] = torch.where(running, new, -1)
            running &= ~sampler.is_eos(new)
            left = int(running.sum())  # the one host sync of a step
            if step + 1 == self.opts.max_new_tokens or left == 0:
                break
            if left < len(live) and (not self.captured_steps or left <= bucket(len(live)) // 2):
                live, new, running, changed = live[running], new[running], running[running], True
            logits = step_fn(answer_slots[live, step], new, changed)
            changed = False
        return [[t for t in row if t >= 0] for row in out.tolist()]

    @property
    def captured_steps(self) -> bool:
        """Whether decode steps replay CUDA graphs (over a `StaticRow`)."""
        return self.row is not None

    def _decode_step_fn(self):
        """Eager forward, or CUDA-graph replay when asked for and possible."""
        if self.row is not None:
            return self.row.graphs.bind(self)
        return lambda q_slot, tokens, changed: self.eager_step(q_slot, tokens)

    def eager_step(self, q_slot: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One decode forward without a graph: logits [n, V] of the n new tokens.

        Compiled, the plan spans the whole row (a fixed kv_len, so steps do not recompile).
        """
        plan = self.plan(q_slot, self.capacity if self.opts.compile else None)
        return self.forward(plan, tokens, torch.arange(len(tokens), device=self.device), step=True)


def _last_rows(chunk: torch.Tensor, last: torch.Tensor):
    """Which prompts end inside `chunk` (sorted slots), the unique rows they end at, and each one's row index."""
    idx = torch.searchsorted(chunk, last).clamp(max=len(chunk) - 1)
    prompts = torch.nonzero(chunk[idx] == last).flatten()
    rows, inverse = torch.unique(idx[prompts], return_inverse=True)  # duplicate prompts share a row
    return rows, prompts, inverse


RECOMPILE_LIMIT = 64  # compiled graphs of the model's call: one per bucket (per live count without CUDA graphs)


def _recompile_limit(limit: int):
    """Dynamo's per-function recompile limit raised to at least `limit` (its default, 8, would leave the
    buckets past the eighth, e.g. the ninth of 256 streams, running uncompiled)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), limit)})


def compiled_call(model: PreTrainedModel):
    """`torch.compile` of the model's call, made once per model and kept on it (its compiled graphs too)."""
    call = getattr(model, "_hf_parallel_compiled", None)
    if call is None:
        call = model._hf_parallel_compiled = torch.compile(model.__call__, dynamic=False)
    return call


def check_model(model: PreTrainedModel) -> None:
    """Refuse models the packed row cannot serve, naming the reason."""
    config = model.config.get_text_config()
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{name} is an encoder-decoder model; hf_parallel serves decoder-only causal LMs")
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} does not route attention through transformers' AttentionInterface, so hf_parallel cannot "
            "apply its stream mask"
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise NotImplementedError(f"{name}.forward takes no position_ids; per-stream positions need them")
    if getattr(config, "attention_chunk_size", None):
        raise NotImplementedError(f"{name} uses chunked attention (attention_chunk_size), which hf_parallel lacks")
    if model.training:
        raise ValueError("put the model in eval mode (model.eval()) before generating")


def check_prompts(model: PreTrainedModel, prompts, max_new_tokens: int) -> None:
    """Refuse empty prompts and prompts that would run past the model's positions."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    vocab = model.config.get_text_config().vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
        if limit is not None and len(prompt) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it would exceed the "
                f"model's {limit} positions (max_position_embeddings)"
            )
