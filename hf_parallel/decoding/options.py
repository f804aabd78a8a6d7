"""Generation options: one dataclass; `model.generate`'s options (but beam search) plus hf_parallel's own.

`GenerationOptions.resolve` merges a call's options as generate merges them and refuses, by name, what
parallel generation does not do: a TypeError for an unknown option or a value of the wrong type, a ValueError
for an out-of-range one, NotImplementedError for what it does not support (a decoding method other than greedy
decoding or sampling, an assistant model, a streamer, extra outputs).  Prompt-lookup decoding
(`prompt_lookup_num_tokens`) is taken out of generate's options into `speculation`: it changes how many
tokens a forward decides, never which.
"""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass, field, replace

from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.stopping_criteria import StopStringCriteria

from ..attention import BACKENDS, AttentionBackend
from .drafting import NAMES as SPECULATION_NAMES
from .drafting import Speculation
from .generate_args import GenerateArgs
from .sizes import parse_memory

DEFAULT_MAX_NEW_TOKENS = 256  # when neither max_new_tokens nor max_length is set anywhere (generate: 20)
OWN = (
    "seed",
    "attn",
    "prefill_chunk",
    "cuda_graphs",
    "compile",
    "tokenizer",
    "max_memory",
    "refill",
    "progress",
    "adaptive_drafts",
    "assistant_model",
    "tuning",
)
GENERATE_ARGUMENTS = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn")
CONFIG_FIELDS = frozenset(k for k in vars(GenerationConfig()) if not k.startswith("_")) - {"transformers_version"}
# options that choose a decoding method other than greedy decoding or sampling: name -> the value that does not
OTHER_METHODS = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "constraints": None,
    "force_words_ids": None,
    "guidance_scale": 1,
    "dola_layers": None,
    "assistant_early_exit": None,
    "use_mtp": False,
    "token_healing": False,
    "penalty_alpha": 0,
}
REFUSED_ARGUMENTS = (
    "assistant_tokenizer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "streamer",
    "synced_gpus",
    "custom_generate",
    "trust_remote_code",
)
OUTPUTS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass(frozen=True)
class Tuning:
    """How fast the packed row runs, not what it computes: each choice is on by default, and turning one off
    measures what it gains (the ablations of `eval/bench.py`; docs/benchmarks/gpu.md, "Ablations on the grid").
    An answer stays what `model.generate` writes either way, up to the rounding of other 16-bit kernels.

    group_projections: on a GPU running the whole model, an attention module's q, k and v projections as one GEMM
                       (`hf_parallel.models.projections`); False: each its own.
    prefill_columns:   a grouped prefill chunk's q, k and v written as columns of one output, strided as a decode
                       step's, so the compiled rotary embedding compiles one graph for both; False: each a tensor
                       of its own (a second graph).
    fuse_rotary:       where the layers' parts are compiled (`compile`), the rotary embedding among them; False: the
                       norms only.
    static_widths:     the compiled parts' widths static and only the token count dynamic; False: torch.compile's
                       `dynamic=True`, every dimension dynamic (graphs of their own).
    triton_writes:     on a GPU, the cache's new K/V written by one Triton launch a layer; False: `index_copy_`.
    read_late:         a round's chosen tokens read on the host a round late, while the next round runs; False:
                       each read at once, the host waiting for the GPU before it queues the next round.
    """

    group_projections: bool = True
    prefill_columns: bool = True
    fuse_rotary: bool = True
    static_widths: bool = True
    triton_writes: bool = True
    read_late: bool = True

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, bool):
                raise TypeError(f"Tuning.{name} must be a bool, got {type(value).__name__} {value!r}")


@dataclass
class GenerationOptions:
    """What `generate_tokens` honours.  Generate's options default as in `model.generate`.

    generate:          generate's options as given (GenerationConfig names, generation_config=,
                       logits_processor=, stopping_criteria=, prefix_allowed_tokens_fn=); each prompt's
                       processors and criteria are what generate builds from them for that prompt alone.
    generation_config: the merged config generate decodes with (kwargs > generation_config= > the model's);
                       set by `resolve`.
    max_new_tokens:    new tokens per stream (256 when no length is set anywhere); None when `max_length`
                       bounds prompt plus answer instead (per prompt, as in generate).
    tokenizer:         needed for stop_strings (`generate_parallel` passes its own).
    seed:              sampling draws from a generator seeded with it; None = torch's global generator.
    attn:              attention path: "reference" (dense stream mask + SDPA, the specification),
                       "triton" (in-kernel stream mask, CUDA), "auto" (triton on CUDA, else reference),
                       or an `AttentionBackend` object.
    prefill_chunk:     most prompt tokens per forward; None = the attention path's own (the dense
                       mask's memory bounds the reference's; the Triton path builds no mask).
    cuda_graphs:       capture the decode step once per bucket of live streams and replay it (CUDA only).
    compile:           "auto" (default): where decode steps are captured (CUDA), the decoder layers' norms
                       and rotary embedding through `torch.compile`, one graph per norm class and one for
                       the rotary function, reused by every layer (compiled once per process);
                       elsewhere nothing compiled.
                       "layers": the same on any device.  True: the whole model's decode step compiled
                       (the attention kernel an opaque op; a call compiles at most three graphs, each
                       tracing every layer: a long first call).  False: nothing compiled.
    max_memory:        the memory the call's row may take (bytes or a string such as "40GiB"); None = what
                       the device has free.  Work that does not fit is admitted as room frees up.
    refill:            admit waiting prompts into the room finished streams free while the others decode
                       (continuous refill); False = only into an empty row (static waves).
    progress:          a progress bar over finished prompts; None = on when stderr is a terminal.
    speculation:       prompt-lookup decoding, from generate's `prompt_lookup_num_tokens` and
                       `max_matching_ngram_size` (None: one token per stream per forward); set by `resolve`.
    adaptive_drafts:   each stream's draft length follows its acceptance (`Speculation.adaptive`); False:
                       always the most drafts allow.
    assistant_model:   a smaller causal LM of the same tokenizer whose greedy tokens are every stream's
                       drafts (generate's `assistant_model`), up to `num_assistant_tokens` (generate's
                       default 20) a forward; it decodes a packed row of its own, the shared prefixes
                       computed once.
    tuning:            the row's speed choices (`Tuning`), each on by default; turning one off is an ablation.
    """

    generate: GenerateArgs = field(default_factory=GenerateArgs)
    generation_config: GenerationConfig | None = None
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    tokenizer: object = None
    seed: int | None = None
    attn: str | AttentionBackend = "auto"
    prefill_chunk: int | None = None
    cuda_graphs: bool = True
    compile: bool | str = "auto"
    max_memory: int | str | None = None
    refill: bool = True
    progress: bool | None = None
    speculation: Speculation | None = None
    adaptive_drafts: bool = True
    assistant_model: object = None
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self):
        if self.compile is None:  # unset, as generate's None: the default
            self.compile = "auto"
        _check_types(self)
        _refuse_other_methods(self.generate)
        requested = self.generate.kwargs.get("max_new_tokens", self.max_new_tokens)
        if requested is not None and requested < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {requested}")
        if isinstance(self.attn, str) and self.attn != "auto" and self.attn not in BACKENDS:
            raise ValueError(
                f"unknown attention path {self.attn!r}; choose 'auto', one of {sorted(BACKENDS)}, "
                "or pass an AttentionBackend"
            )
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @classmethod
    def resolve(cls, model: PreTrainedModel, **user) -> GenerationOptions:
        """`user`'s options over `model`'s generation config, merged and validated by generate itself; refuses as the
        module docstring says (stop_strings without a tokenizer: ValueError)."""
        opts = cls(generate=_generate_args(user), **{k: v for k, v in user.items() if k in OWN})
        speculation = _take_speculation(opts.generate, opts.adaptive_drafts)
        if opts.assistant_model is not None:
            speculation = _assisted(opts.generate, speculation, opts.adaptive_drafts)
        _default_length(model, opts.generate)
        opts.generate.stop_criterion = _stop_criterion(model, opts.generate, opts.tokenizer)
        config = opts.generate.config(model)
        mode = config.get_generation_mode()
        if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
            raise NotImplementedError(
                f"{mode.value} is not supported by parallel generation (only greedy "
                f"decoding and sampling); the merged config sets {_methods(config)}"
            )
        return replace(opts, generation_config=config, max_new_tokens=config.max_new_tokens, speculation=speculation)

    @property
    def do_sample(self) -> bool:
        return bool(self.generation_config is not None and self.generation_config.do_sample)

    @property
    def eos_ids(self) -> list[int]:
        """The merged config's EOS ids (none: an empty list)."""
        return (_as_eos(self.generation_config.eos_token_id) or []) if self.generation_config is not None else []

    @property
    def num_return_sequences(self) -> int:
        return (self.generation_config.num_return_sequences or 1) if self.generation_config is not None else 1

    def prefill_chunk_for(self, backend: AttentionBackend) -> int:
        """Prompt tokens per prefill forward on `backend`."""
        return self.prefill_chunk or backend.prefill_chunk


def _generate_args(user: dict) -> GenerateArgs:
    """generate's options out of `user`, checking every name first (generate would misreport unknown ones)."""
    known = set(OWN) | set(GENERATE_ARGUMENTS) | CONFIG_FIELDS
    refused = [k for k in REFUSED_ARGUMENTS if k in user] + [k for k in OUTPUTS if user.get(k)]
    if refused:
        raise NotImplementedError(f"{refused[0]} is not supported by parallel generation")
    unknown = sorted(k for k in user if k not in known)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise TypeError(
            f"unknown generation option{'s' if len(unknown) > 1 else ''} {names}; options are "
            f"GenerationConfig fields, {', '.join(GENERATE_ARGUMENTS + OWN)}"
        )
    kwargs = {k: v for k, v in user.items() if k in CONFIG_FIELDS}
    if "eos_token_id" in kwargs:
        kwargs["eos_token_id"] = _as_eos(kwargs["eos_token_id"])
    args = {k: user[k] for k in GENERATE_ARGUMENTS if user.get(k) is not None}
    for name in ("logits_processor", "stopping_criteria"):
        if name in args:
            args[name] = list(args[name])
    return GenerateArgs(kwargs=kwargs, **args)


def _take_speculation(args: GenerateArgs, adaptive: bool) -> Speculation | None:
    """Prompt lookup's options out of generate's arguments (kwargs > generation_config=), which then decodes as greedy
    decoding or sampling would; None where prompt_lookup_num_tokens is not set."""
    values = {}
    config = args.generation_config
    for name in SPECULATION_NAMES:
        if name in args.kwargs:
            values[name] = args.kwargs.pop(name)
        elif config is not None and getattr(config, name, None) is not None:
            values[name] = getattr(config, name)
    if config is not None and any(getattr(config, name, None) is not None for name in SPECULATION_NAMES):
        args.generation_config = config = copy.deepcopy(config)
        for name in SPECULATION_NAMES:
            setattr(config, name, None)
    if values.get("prompt_lookup_num_tokens") is None:
        return None
    return Speculation(values["prompt_lookup_num_tokens"], values.get("max_matching_ngram_size") or 2, adaptive)


def _assisted(args: GenerateArgs, lookup: Speculation | None, adaptive: bool) -> Speculation:
    """An assistant model's drafts: `num_assistant_tokens` (kwargs > generation_config=, else generate's 20) a
    forward; prompt lookup and an assistant at once are refused, as generate refuses them."""
    if lookup is not None:
        raise ValueError("prompt_lookup_num_tokens and assistant_model choose two ways to draft: give one")
    tokens = args.kwargs.pop("num_assistant_tokens", None)
    if tokens is None and args.generation_config is not None:
        tokens = args.generation_config.num_assistant_tokens
    return Speculation(tokens if tokens is not None else 20, adaptive=adaptive, assistant=True)


def _refuse_other_methods(args: GenerateArgs) -> None:
    sources = [args.kwargs] + ([vars(args.generation_config)] if args.generation_config else [])
    for source in sources:
        for name, neutral in OTHER_METHODS.items():
            if source.get(name) not in (None, neutral):
                raise NotImplementedError(
                    f"{name}={source[name]!r} is not supported by parallel generation (beam "
                    "search, contrastive, assisted and guided decoding are not)"
                )


def _methods(config: GenerationConfig) -> str:
    names = [k for k, neutral in OTHER_METHODS.items() if getattr(config, k, None) not in (None, neutral)]
    return ", ".join(f"{k}={getattr(config, k)!r}" for k in names) or "nothing else"


def _default_length(model: PreTrainedModel, args: GenerateArgs) -> None:
    """DEFAULT_MAX_NEW_TOKENS where no length is set anywhere (where generate would give 20 new tokens)."""
    configs = [args.generation_config, getattr(model, "generation_config", None)]
    sources = [args.kwargs] + [vars(c) for c in configs if c is not None]
    if any(s.get(k) is not None for s in sources for k in ("max_new_tokens", "max_length")):
        return
    if args.generation_config is None:
        args.kwargs["max_new_tokens"] = DEFAULT_MAX_NEW_TOKENS
    else:  # on a copy of the user's config: a kwarg beside it would draw generate's deprecation warning
        args.generation_config = copy.deepcopy(args.generation_config)
        args.generation_config.max_new_tokens = DEFAULT_MAX_NEW_TOKENS


def _stop_strings(model: PreTrainedModel, args: GenerateArgs):
    """stop_strings as generate merges them: kwargs > generation_config= > the model's."""
    if "stop_strings" in args.kwargs:
        return args.kwargs["stop_strings"]
    for config in (args.generation_config, getattr(model, "generation_config", None)):
        if config is not None and getattr(config, "stop_strings", None) is not None:
            return config.stop_strings
    return None


def _stop_criterion(model: PreTrainedModel, args: GenerateArgs, tokenizer):
    """The StopStringCriteria generate would build (once per call: it tokenizes the whole vocabulary)."""
    stop_strings = _stop_strings(model, args)
    if stop_strings is None:
        return None
    args.kwargs["stop_strings"] = None  # generate cannot build it through custom_generate (`generate_args`)
    if any(type(c) is StopStringCriteria for c in args.stopping_criteria):
        return None  # generate keeps the user's own in place of its default
    if tokenizer is None:
        raise ValueError(
            "stop_strings need the model's tokenizer: pass tokenizer=... to generate_tokens "
            "(generate_parallel passes its own)"
        )
    return StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)


_INTS = (
    "max_new_tokens",
    "min_new_tokens",
    "max_length",
    "min_length",
    "top_k",
    "no_repeat_ngram_size",
    "num_return_sequences",
    "seed",
    "prefill_chunk",
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "num_assistant_tokens",
)
_FLOATS = ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty")
_BOOLS = ("do_sample", "cuda_graphs", "refill", "progress", "adaptive_drafts")


def _check_types(opts: GenerationOptions) -> None:
    """A TypeError naming the option for a value of the wrong type (None is generate's "unset")."""
    values = {**opts.generate.kwargs, **{name: getattr(opts, name) for name in OWN if name != "tokenizer"}}
    for name, value in values.items():
        if value is None or name not in _INTS + _FLOATS + _BOOLS:
            continue
        if name in _BOOLS:
            ok, kind = isinstance(value, bool), "a bool"
        elif name in _INTS:
            ok, kind = _is_int(value), "an int"
        else:
            ok, kind = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
        if not ok:
            raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if not (isinstance(opts.compile, bool) or (isinstance(opts.compile, str) and opts.compile in ("auto", "layers"))):
        raise TypeError(f"compile must be True, False, 'auto' or 'layers', got {opts.compile!r}")
    if opts.max_memory is not None:
        parse_memory(opts.max_memory)  # a TypeError or ValueError naming max_memory
    if not isinstance(opts.tuning, Tuning):
        raise TypeError(f"tuning must be an hf_parallel.Tuning, got {type(opts.tuning).__name__}")
    if not isinstance(opts.attn, (str, AttentionBackend)):
        raise TypeError(f"attn must be a string or an AttentionBackend, got {type(opts.attn).__name__}")
    config = opts.generate.generation_config
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")


def _as_eos(eos) -> list[int] | None:
    """eos_token_id as a list of ints; an empty list means no EOS (generate's None: it fails on [])."""
    if eos is None:
        return None
    if _is_int(eos):
        return [int(eos)]
    try:
        values = list(eos)
    except TypeError:
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {type(eos).__name__}") from None
    if isinstance(eos, (str, bytes)) or not all(_is_int(e) for e in values):
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    return [int(e) for e in values] or None


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
