"""`generate_tokens` and `stream_tokens`: answer every prompt as if alone, shared token prefixes computed once.

A workload that fits the memory budget runs as one packed row (`Runner`).  One that does
not is admitted as room frees up (`RefillLoop`: continuous refill, or static waves), a
document's prompts together; models with recurrent layers, and streams that draft
(prompt lookup), run it in waves of rows.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..attention import AttentionBackend, resolve_backend
from ..decoding.inputs import as_token_lists, check_length, check_tokens, in_vocabulary
from ..decoding.options import GenerationOptions
from ..models.checks import check_model
from ..models.compiled_parts import compiler_unimported, import_compiler
from ..models.placement import loop_device, placement
from ..row.forest import Forest
from ..row.layout import Layout, build_layout
from .admission import Admission
from .budget import RowBudget, row_budget, too_large
from .patching import Support, model_lock
from .probe import check_support
from .refill import RefillLoop
from .rows import RowKeeper
from .runner import Runner, compiles


def generate_tokens(model: PreTrainedModel, prompts, session: RowKeeper | None = None, **options) -> list[list[int]]:
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
    Returns P * num_return_sequences lists of new tokens, each prompt's answers contiguous
    (as generate orders them), each up to and including EOS when generated.
    Refuses before any generation: an empty prompt, ids outside the vocabulary, a prompt past
    the model's positions or a model in training mode (ValueError), unknown or mistyped
    options (TypeError), and a model or decoding method hf_parallel cannot serve
    (NotImplementedError, naming why).
    """
    call = Call.prepare(model, prompts, options, session)
    out: list[list[int] | None] = [None] * len(call.streams)
    for index, tokens in call.run():
        out[index] = tokens
    return out


def stream_tokens(model: PreTrainedModel, prompts, session: RowKeeper | None = None, **options):
    """`generate_tokens`, yielding `(index, tokens)` as each stream finishes (index into its result list).

    While the iterator runs, the model's attention goes through hf_parallel's; it is restored when
    the iterator is exhausted or closed, and until then another thread's call on the model waits.
    """
    return Call.prepare(model, prompts, options, session).run()


@dataclass
class Call:
    """One call's checked inputs: its streams, options, model support, backend and row keeper; `run` answers."""

    model: PreTrainedModel
    streams: list[list[int]]
    room: int  # most new tokens of any stream (each stream's own limit is generate's, per prompt)
    opts: GenerationOptions
    support: Support
    backend: AttentionBackend
    session: RowKeeper | None
    layout: Layout | None  # the streams' prefix tree (None: no streams)
    assistant: Support | None = None  # the assistant model's, where it drafts

    @classmethod
    @torch.inference_mode()
    def prepare(cls, model, prompts, options: dict, session) -> Call:
        """Check the model, the prompts and the options, and probe the model; refuses as `generate_tokens` says.
        Generate prepares each prompt and the probe runs the model: one call at a time on a model (`model_lock`)."""
        check_model(model)
        prompts = as_token_lists("prompts", prompts)
        with model_lock(model).held():
            return cls._checked(model, prompts, options, session)

    @classmethod
    def _checked(cls, model, prompts: list[list[int]], options: dict, session) -> Call:
        opts = GenerationOptions.resolve(model, **options)
        budgets = []  # new tokens each prompt may get (generate's max_length - prompt length)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            budgets.append(opts.request.prepare(model, prompt).budget)  # generate's lists, captured before any work
            check_length(model, f"prompt {i}", prompt, budgets[-1])
        streams = [prompt for prompt in prompts for _ in range(opts.num_return_sequences)]  # one prompt stored once
        room = max(budgets, default=1)
        layout = build_layout(streams, room) if streams else None
        # the ids checked once each where prompts share them (a document's once, not once per question); where one
        # is outside the vocabulary, each prompt's are checked in turn, so that the error names the first such prompt
        if layout is not None and not in_vocabulary(model, [seg.tokens for seg in layout.segments]):
            for i, prompt in enumerate(prompts):
                check_tokens(model, f"prompt {i}", prompt)
        # a call that will compile imports the compiler beside the support probe's first forward (where it is the
        # model's first); whether it will is the Runner's rule, before the probe says whether layers are recurrent
        if compiler_unimported() and compiles(opts, loop_device(model), placement(model).eager_only, recurrent=False):
            import_compiler()
        support = check_support(model) if prompts else None
        if opts.speculation is not None and support is not None and support.recurrent:
            raise NotImplementedError(
                f"speculative decoding: {type(model).__name__} has layers with a recurrent state, which a "
                "rejected draft token would leave advanced; decode without prompt_lookup_num_tokens or assistant_model"
            )
        assistant = check_assistant(model, opts.assistant_model) if opts.assistant_model is not None else None
        backend = resolve_backend(opts.attn, model.device)
        return cls(model, streams, room, opts, support, backend, session, layout, assistant)

    def run(self) -> Iterator[tuple[int, list[int]]]:
        """(stream index, new tokens) of every stream as it finishes: one row where the memory budget holds the
        call, else waves of rows (recurrent layers) or continuous refill."""
        if not self.streams:
            return
        with model_lock(self.model).held():  # until the last stream is yielded, or the iterator closed
            yield from self._runs()

    def _runs(self) -> Iterator[tuple[int, list[int]]]:
        layout = self.layout
        chunk = self.opts.prefill_chunk_for(self.backend)
        kept = self.session.row_bytes() if self.session is not None else 0
        budget = row_budget(self.model, self.support, chunk, self.opts.max_memory, len(self.streams), kept)
        bar = tqdm(total=len(self.streams), unit="answer", disable=not _show_progress(self.opts.progress))
        with bar:
            if layout.num_slots <= budget.capacity and len(self.streams) <= budget.streams:
                runs = self._one_row(layout)
            elif self.support.recurrent or self.opts.speculation is not None:
                runs = self._waves(layout, budget)
            else:
                runs = self._refill(layout, budget)
            for index, tokens in runs:
                bar.update()
                yield index, tokens

    def _one_row(self, layout: Layout) -> Iterator[tuple[int, list[int]]]:
        runner = Runner(self.model, layout, self.opts, self.backend, self.support, self.session, self.assistant)
        yield from enumerate(runner.run())

    def _waves(self, layout: Layout, budget: RowBudget) -> Iterator[tuple[int, list[int]]]:
        """Rows one after another, each as many streams (a document's together) as fit it."""
        order = [index for group in document_groups(layout) for index in group]
        for wave in _waves(self.streams, order, self.room, budget):
            wave_layout = build_layout([self.streams[i] for i in wave], self.room)
            runner = Runner(
                self.model, wave_layout, self.opts, self.backend, self.support, self.session, self.assistant
            )
            yield from zip(wave, runner.run())

    def _refill(self, layout: Layout, budget: RowBudget) -> Iterator[tuple[int, list[int]]]:
        empty = Forest(budget.capacity).snapshot(self.room)
        runner = Runner(self.model, empty, self.opts, self.backend, self.support, self.session)
        admission = Admission(self.streams, document_groups(layout), self.room, budget, self.opts.refill)
        loop = RefillLoop(runner, self.streams, admission, self.room)
        with runner.using_model():
            rounds = loop.run()
            while True:
                with torch.inference_mode():
                    finished = next(rounds, None)
                if finished is None:
                    return
                yield finished


def check_assistant(model: PreTrainedModel, assistant) -> Support:
    """The assistant's `Support`; TypeError for an assistant that is not a causal LM, ValueError for one of another
    vocabulary or device, NotImplementedError for one with recurrent layers or that hf_parallel cannot serve."""
    if not isinstance(assistant, PreTrainedModel):
        raise TypeError(f"assistant_model must be a transformers causal LM, got {type(assistant).__name__}")
    main, its = model.config.get_text_config().vocab_size, assistant.config.get_text_config().vocab_size
    if abs(main - its) > 1024:  # one tokenizer's vocabulary padded to two sizes is still one tokenizer
        raise ValueError(
            f"assistant_model has a vocabulary of {its} tokens and the model {main}: drafts need the same tokenizer"
        )
    if assistant.device != model.device:
        raise ValueError(f"assistant_model is on {assistant.device} and the model on {model.device}: put both on one")
    support = check_support(assistant)
    if support.recurrent:
        raise NotImplementedError(
            f"assistant_model: {type(assistant).__name__} has layers with a recurrent state, which a rejected "
            "draft token would leave advanced"
        )
    return support


def document_groups(layout: Layout) -> list[list[int]]:
    """The streams grouped by the root of their prefix tree (a document), groups by first appearance."""
    groups: dict[int, list[int]] = {}
    for p, end in enumerate(layout.prompt_ends):
        groups.setdefault(layout.ancestors(end)[0], []).append(p)
    return [groups[root] for root in sorted(groups)]


def _waves(streams, order: list[int], room: int, budget: RowBudget) -> Iterator[list[int]]:
    forest, wave = Forest(budget.capacity), []
    for index in order:
        if len(wave) == budget.streams or forest.admit(index, streams[index], room) is None:
            if wave:
                yield wave
            forest, wave = Forest(budget.capacity), []
            if forest.admit(index, streams[index], room) is None:
                raise too_large(index, len(streams[index]) + room, budget)
        wave.append(index)
    if wave:
        yield wave


def _show_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress
