"""Generation options: one dataclass, names as in `transformers.GenerationConfig`."""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, fields

from transformers import GenerationConfig, PreTrainedModel

from .attention import BACKENDS, AttentionBackend

DEFAULT_MAX_NEW_TOKENS = 256
# GenerationConfig fields whose non-default values change the output and that the
# parallel loop does not implement: refused when asked for, warned about when inherited.
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "num_return_sequences": 1,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "constraints": None, "guidance_scale": None, "assistant_model": None,
}  # fmt: skip


@dataclass
class GenerationOptions:
    """What `generate_tokens` honours.  Unset fields default to the model's `generation_config`.

    attn:          attention path: "reference" (dense stream mask + SDPA, the specification),
                   "triton" (in-kernel stream mask, CUDA), "auto" (triton on CUDA, else reference),
                   or an `AttentionBackend` object.
    prefill_chunk: most prompt tokens per forward; None = the attention path's own (the dense
                   mask's memory bounds the reference's; the Triton path builds no mask).
    cuda_graphs:   capture the decode step once per bucket of live streams and replay it (CUDA only).
    compile:       run decode steps through `torch.compile` of the model (the attention kernel an
                   opaque op), so the model's own small operations fuse; each new bucket of live
                   streams compiles once per model (tens of seconds for a 7B model).  Off by default.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    eos_token_id: tuple[int, ...] = ()
    seed: int | None = None
    attn: str | AttentionBackend = "auto"
    prefill_chunk: int | None = None
    cuda_graphs: bool = True
    compile: bool = False

    def __post_init__(self):
        _check_types(self)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if isinstance(self.attn, str) and self.attn != "auto" and self.attn not in BACKENDS:
            raise ValueError(f"unknown attention path {self.attn!r}; choose 'auto', one of {sorted(BACKENDS)}, "
                             "or pass an AttentionBackend")  # fmt: skip
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")

    @classmethod
    def resolve(cls, model: PreTrainedModel, **user) -> GenerationOptions:
        """Merge `user` options over the model's generation config, refusing what is not supported."""
        own = {f.name for f in fields(cls)}
        for name, value in user.items():
            if name in UNSUPPORTED and value != UNSUPPORTED[name]:
                raise NotImplementedError(f"{name}={value!r} is not supported by parallel generation")
            if name not in own and name not in UNSUPPORTED:
                raise TypeError(f"unknown generation option {name!r}; supported: {sorted(own)}")
        config = getattr(model, "generation_config", None) or GenerationConfig()
        _warn_inherited(config, user)
        merged = {name: getattr(config, name) for name in own if getattr(config, name, None) is not None}
        if config.max_new_tokens is None:
            merged.pop("max_new_tokens", None)
        merged.update({k: v for k, v in user.items() if k in own and v is not None})
        merged["eos_token_id"] = _as_tuple(merged.get("eos_token_id"))
        return cls(**merged)

    def prefill_chunk_for(self, backend: AttentionBackend) -> int:
        """Prompt tokens per prefill forward on `backend`."""
        return self.prefill_chunk or backend.prefill_chunk


_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "seed", "prefill_chunk")
_FLOATS = ("temperature", "top_p")
_BOOLS = ("do_sample", "cuda_graphs", "compile")


def _check_types(opts: GenerationOptions) -> None:
    """A TypeError naming the option for a value of the wrong type (None where a field allows it)."""
    for name in _INTS + _FLOATS + _BOOLS:
        value = getattr(opts, name)
        if value is None and name in ("top_k", "seed", "prefill_chunk"):
            continue
        if name in _BOOLS:
            ok = isinstance(value, bool)
        elif name in _INTS:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        else:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok:
            kind = "a bool" if name in _BOOLS else "an int" if name in _INTS else "a number"
            raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if not isinstance(opts.attn, (str, AttentionBackend)):
        raise TypeError(f"attn must be a string or an AttentionBackend, got {type(opts.attn).__name__}")


def _as_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, numbers.Integral) and not isinstance(eos, bool):
        return (int(eos),)
    try:
        values = tuple(eos)
    except TypeError:
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {type(eos).__name__}") from None
    if not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in values):
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    return tuple(int(e) for e in values)


def _warn_inherited(config: GenerationConfig, user: dict) -> None:
    for name, default in UNSUPPORTED.items():
        if name not in user and getattr(config, name, default) not in (default, None):
            warnings.warn(f"the model's generation_config sets {name}={getattr(config, name)!r}, "
                          "which parallel generation ignores", stacklevel=3)  # fmt: skip
