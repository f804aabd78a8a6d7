"""`generate_tokens` and `stream_tokens`: answer every prompt as if alone, shared token prefixes computed once.

A call checks its inputs, probes the model and sizes its row, then runs the engine core (`engine.core`) with
the admission policy that fits: everything at once where the row holds the whole call (`AllAtOnce`), else
documents admitted as room frees up (`Refill`, or `Waves` with refill=False).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..attention import AttentionBackend, resolve_backend
from ..decoding.inputs import as_token_lists, check_tokens, in_vocabulary
from ..decoding.options import GenerationOptions
from ..decoding.sampling import Sampler
from ..engine.core import EngineCore
from ..engine.drafts import AssistantDrafter
from ..engine.policies import AllAtOnce, Refill, Waves
from ..engine.requests import check_request
from ..engine.stats import Stats
from ..engine.streams import Request
from ..models.checks import check_model
from ..models.compiled_parts import compiler_unimported, import_compiler
from ..models.placement import loop_device, placement
from ..row.contents import FixedRow
from ..row.layout import Layout, build_layout, layout_prompts
from ..row.prefix_tree import PrefixTree
from ..runner.model_runner import ModelRunner, compiles
from ..runner.patching import ModelProfile, model_lock
from ..runner.rows import RowKeeper
from ..runner.sizing import size_row
from .probe import check_support


def generate_tokens(
    model: PreTrainedModel, prompts, session: RowKeeper | None = None, stats: Stats | None = None, **options
) -> list[list[int]]:
    """Answer every prompt as if alone; shared token prefixes are computed once.

    prompts: P complete prompts, lists of token ids (or a 2-D tensor, one prompt per row).
    Their common prefixes are found from the tokens (a prefix tree of any depth), so one
    document with many questions, several documents, a shared system prompt or dialogue
    turns that extend one another all work.  Any number of prompts: what does not fit the
    memory budget (`max_memory`) waits for room.
    options: what `model.generate` takes (GenerationConfig names, generation_config=,
    logits_processor=, stopping_criteria=, prefix_allowed_tokens_fn=), merged as generate
    merges them, but beam search; `tokenizer=` (for stop_strings); and hf_parallel's own
    (`GenerationOptions`).
    session: a `RowKeeper` (such as `hf_parallel.Session`) keeping the packed row between
    calls (else the call frees it).
    stats: a `Stats` the call counts what it does into, added to what it holds (several calls'
    totals, through any function that passes generation options on); else the call's own.
    Returns P * num_return_sequences lists of new tokens, each prompt's answers contiguous
    (as generate orders them), each up to and including EOS when generated.
    Refuses before any generation: an empty prompt, ids outside the vocabulary, a prompt past
    the model's positions or a model in training mode (ValueError), unknown or mistyped
    options (TypeError), and a model or decoding method hf_parallel cannot serve
    (NotImplementedError, naming why).
    """
    call = Generation.prepare(model, prompts, options, session, stats)
    out: list[list[int] | None] = [None] * len(call.streams)
    for index, tokens in call.run():
        out[index] = tokens
    return out


def stream_tokens(
    model: PreTrainedModel, prompts, session: RowKeeper | None = None, stats: Stats | None = None, **options
) -> Streamed:
    """`generate_tokens`, yielding `(index, tokens)` as each stream finishes (index into its result list); once
    exhausted, the iterator's `stats` say what the call did (`engine.stats.Stats`).

    While the iterator runs, the model's attention goes through hf_parallel's; it is restored when
    the iterator is exhausted or closed, and until then another thread's call on the model waits.
    """
    return Streamed(Generation.prepare(model, prompts, options, session, stats))


def generate_layout(model: PreTrainedModel, layout: Layout, session: RowKeeper | None = None, **options):
    """`generate_tokens` over the prompts of a layout `build_layout` made (the reference paper's interleaved one
    included: a benchmark's ablation), each prompt once, all at once in a row of that layout."""
    call = Generation.prepare(model, layout_prompts(layout), options, session)
    if call.opts.num_return_sequences != 1:
        raise ValueError("generate_layout answers each prompt of the layout once: num_return_sequences is 1")
    call.layout, call.fixed = layout, True
    out: list[list[int] | None] = [None] * layout.num_prompts
    for index, tokens in call.run():
        out[index] = tokens
    return out


class Streamed:
    """The answers of one call as they finish (`stream_tokens`); `stats`, what it did (`engine.stats.Stats`: the ids
    it checked once prepared, the rest as it runs, complete once exhausted)."""

    def __init__(self, call: Generation):
        self.call, self.answers = call, call.run()

    def __iter__(self) -> Streamed:
        return self

    def __next__(self) -> tuple[int, list[int]]:
        return next(self.answers)

    def close(self) -> None:
        self.answers.close()

    @property
    def stats(self) -> Stats:
        return self.call.stats


@dataclass
class Generation:
    """One call's checked inputs: its prompts, options, the model's profile, backend and row keeper; `run`
    answers."""

    model: PreTrainedModel
    prompts: list[list[int]]
    max_new_tokens: list[int]  # each prompt's (generate's max_length less its length, as generate counts)
    opts: GenerationOptions
    profile: ModelProfile | None
    backend: AttentionBackend
    session: RowKeeper | None
    layout: Layout | None  # the streams' prefix tree laid out at once (None: no streams)
    assistant: ModelProfile | None = None  # the assistant model's, where it drafts
    fixed: bool = False  # the layout is the row's, whatever the memory budget says
    stats: Stats = field(default_factory=Stats)

    @property
    def streams(self) -> list[int]:
        return [p for p in range(len(self.prompts)) for _ in range(self.opts.num_return_sequences)]

    @classmethod
    @torch.inference_mode()
    def prepare(cls, model, prompts, options: dict, session, stats: Stats | None = None) -> Generation:
        """Check the model, the prompts and the options, and probe the model; refuses as `generate_tokens` says.
        Generate prepares each prompt and the probe runs the model: one call at a time on a model (`model_lock`)."""
        check_model(model)
        prompts = as_token_lists("prompts", prompts)
        with model_lock(model).held():
            return cls._checked(model, prompts, options, session, Stats() if stats is None else stats)

    @classmethod
    def _checked(cls, model, prompts: list[list[int]], options: dict, session, stats: Stats) -> Generation:
        opts = GenerationOptions.resolve(model, **options)
        # a call that will compile imports the compiler beside the support probe's first forward (where it is the
        # model's first); whether it will is the runner's rule, before the probe says whether layers are recurrent
        if compiler_unimported() and compiles(opts, loop_device(model), placement(model).eager_only, recurrent=False):
            import_compiler()
        profile = check_support(model) if prompts else None
        limits = [
            check_request(model, profile, p, opts, name=f"prompt {i}", ids_checked=True) for i, p in enumerate(prompts)
        ]
        streams = [prompt for prompt in prompts for _ in range(opts.num_return_sequences)]  # one prompt stored once
        layout = build_layout(streams, max(limits, default=1)) if streams else None
        # the ids checked once each where prompts share them (a document's once, not once per question); where one
        # is outside the vocabulary, each prompt's are checked in turn, so that the error names the first such prompt
        shared = [seg.tokens for seg in layout.segments] if layout is not None else []
        stats.ids_checked += sum(map(len, shared))
        if shared and not in_vocabulary(model, shared):
            for i, prompt in enumerate(prompts):
                stats.ids_checked += len(prompt)
                check_tokens(model, f"prompt {i}", prompt)
        assistant = check_assistant(model, opts.assistant_model) if opts.assistant_model is not None else None
        backend = resolve_backend(opts.attn, model.device)
        stats.calls, stats.prompts = stats.calls + 1, stats.prompts + len(prompts)
        return cls(model, prompts, limits, opts, profile, backend, session, layout, assistant, stats=stats)

    def run(self) -> Iterator[tuple[int, list[int]]]:
        """(stream index, new tokens) of every stream as it finishes: all at once where the memory budget holds
        the call, else as room frees up."""
        if not self.prompts:
            return
        with model_lock(self.model).held():  # until the last stream is yielded, or the iterator closed
            yield from self._run()

    def _run(self) -> Iterator[tuple[int, list[int]]]:
        model, opts, layout = self.model, self.opts, self.layout
        n = opts.num_return_sequences
        chunk = opts.prefill_chunk_for(self.backend)
        kept = self.session.row_bytes() if self.session is not None else 0
        size = size_row(model, self.profile, chunk, opts.max_memory, len(layout.prompt_ends), kept)
        if self.fixed or (layout.num_slots <= size.capacity and len(layout.prompt_ends) <= size.streams):
            policy, contents = AllAtOnce(self.stats), FixedRow(layout)
            order = range(len(self.prompts))
        else:
            policy = (Refill if opts.refill else Waves)(size, self.stats)
            contents = PrefixTree(size.capacity, split_written=not self.profile.recurrent)
            order = [p for group in document_groups(layout, n) for p in group]
        capacity = contents.capacity
        runner = ModelRunner(model, self.profile, opts, self.backend, capacity, self.session)
        self.stats.row_slots = runner.cache.num_slots
        assistant = self._assistant(capacity)
        streams = len(layout.prompt_ends)
        core = EngineCore(model, runner, policy, contents, chunk, size.streams, assistant, prebuild=streams)
        sampler = Sampler(opts, runner.device)  # one for the call: a seed gives one sequence of draws
        documents = _documents(layout, n)
        for p in order:
            request = Request(self.prompts[p], opts, n, self.max_new_tokens[p], sampler=sampler, document=documents[p])
            core.add(request)
            for stream in request.streams:
                stream.index = p * n + stream.answer
        bar = tqdm(total=len(layout.prompt_ends), unit="answer", disable=not _show_progress(opts.progress))
        helper = assistant.runner.using_model() if assistant is not None else contextlib.nullcontext()
        with bar, runner.using_model(), helper, torch.inference_mode():
            for stream in core.run():
                bar.update()
                yield stream.index, stream.tokens
        self.stats.row_bytes = runner.cache.stored_bytes()

    def _assistant(self, capacity: int) -> AssistantDrafter | None:
        if self.assistant is None:
            return None
        opts = replace(self.opts, cuda_graphs=False, compile=False, speculation=None, assistant_model=None)
        runner = ModelRunner(self.opts.assistant_model, self.assistant, opts, self.backend, capacity)
        vocab = self.model.config.get_text_config().vocab_size
        return AssistantDrafter(runner, self.opts.speculation, vocab, self.opts.eos_ids)


def check_assistant(model: PreTrainedModel, assistant) -> ModelProfile:
    """The assistant's `ModelProfile`; TypeError for an assistant that is not a causal LM, ValueError for one of
    another vocabulary or device, NotImplementedError for one with recurrent layers or that hf_parallel cannot
    serve."""
    if not isinstance(assistant, PreTrainedModel):
        raise TypeError(f"assistant_model must be a transformers causal LM, got {type(assistant).__name__}")
    main, its = model.config.get_text_config().vocab_size, assistant.config.get_text_config().vocab_size
    if abs(main - its) > 1024:  # one tokenizer's vocabulary padded to two sizes is still one tokenizer
        raise ValueError(
            f"assistant_model has a vocabulary of {its} tokens and the model {main}: drafts need the same tokenizer"
        )
    if assistant.device != model.device:
        raise ValueError(f"assistant_model is on {assistant.device} and the model on {model.device}: put both on one")
    profile = check_support(assistant)
    if profile.recurrent:
        raise NotImplementedError(
            f"assistant_model: {type(assistant).__name__} has layers with a recurrent state, which a rejected "
            "draft token would leave advanced"
        )
    return profile


def document_groups(layout: Layout, n: int = 1) -> list[list[int]]:
    """The prompts grouped by the root of their prefix tree (a document), groups by first appearance; `layout`
    holds each prompt `n` times."""
    groups: dict[int, list[int]] = {}
    for p, end in enumerate(layout.prompt_ends[::n]):
        groups.setdefault(layout.ancestors(end)[0], []).append(p)
    return [groups[root] for root in sorted(groups)]


def _documents(layout: Layout, n: int) -> list[int]:
    """Each prompt's document number (the root segment of its prefix tree)."""
    return [layout.ancestors(end)[0] for end in layout.prompt_ends[::n]]


def _show_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress
