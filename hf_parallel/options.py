"""Generation options: one dataclass, names as in `transformers.GenerationConfig`."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers import GenerationConfig, PreTrainedModel

from .attention import IMPLEMENTATIONS

LAYOUTS = ("stream", "interleaved")
DEFAULT_MAX_NEW_TOKENS = 256
# GenerationConfig fields whose non-default values change the output and that the
# parallel loop does not implement: refused when asked for, warned about when inherited.
UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "num_return_sequences": 1,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "constraints": None, "guidance_scale": None, "assistant_model": None,
}  # fmt: skip


PREFILL_CHUNK = {"reference": 2048, "triton": 8192}  # default prompt tokens per prefill forward, per path


@dataclass
class GenerationOptions:
    """What `generate_tokens` honours.  Unset fields default to the model's `generation_config`.

    attn:             attention path: "reference" (dense stream mask + SDPA, the specification),
                      "triton" (in-kernel stream mask, CUDA), or "auto" (triton on CUDA, else reference).
    layout:           "stream" (stream-major regions, default) or "interleaved" (the paper's ablation).
    prefill_chunk:    most prompt tokens per prefill forward; None = the attention path's own
                      (PREFILL_CHUNK: the dense mask's memory bounds the reference's; the Triton
                      path builds no mask, and fewer forwards cost less host time).
    cuda_graphs:      capture the decode step once per shape bucket and replay it (CUDA only).
    streams_per_tile: streams packed into one row tile of the Triton kernel (None = as many as fit;
                      1 = every stream reads the document on its own, as a prefix-caching server does).
    own_tiles:        Triton path: attend the streams' own segments (questions and answers) in 16-row
                      tiles and only the shared ones (the document) in packed tiles, merging the two
                      by log-sum-exp, so packed tiles spend no work on keys that one row alone sees.
                      Stream-major layout only.  Off by default: on an H200 5% faster with 1024-token
                      answers, 2-7% slower with 128 (README, Speed).
    compile:          run decode steps through `torch.compile` of the model (the attention kernel an
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
    attn: str = "auto"
    layout: str = "stream"
    prefill_chunk: int | None = None
    cuda_graphs: bool = True
    streams_per_tile: int | None = None
    own_tiles: bool = False
    compile: bool = False

    def __post_init__(self):
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
        if self.streams_per_tile is not None and self.streams_per_tile < 1:
            raise ValueError(f"streams_per_tile must be >= 1, got {self.streams_per_tile}")
        if self.attn != "auto" and self.attn not in IMPLEMENTATIONS:
            raise ValueError(f"unknown attention path {self.attn!r}; choose one of {sorted(IMPLEMENTATIONS)}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.own_tiles and self.layout == "interleaved":
            raise ValueError("own_tiles needs layout='stream': interleaved answers are strided, so every "
                             "stream's own tile would scan all streams' answer slots")  # fmt: skip
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

    def prefill_chunk_for(self, attn: str) -> int:
        """Prompt tokens per prefill forward on the attention path `attn`."""
        return self.prefill_chunk or PREFILL_CHUNK[attn]

    def attention_for(self, device: torch.device) -> str:
        """The attention path to run on `device` ("auto": triton on CUDA when registered, else reference)."""
        if self.attn != "auto":
            return self.attn
        return "triton" if device.type == "cuda" and "triton" in IMPLEMENTATIONS else "reference"


def _as_tuple(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def _warn_inherited(config: GenerationConfig, user: dict) -> None:
    import warnings

    for name, default in UNSUPPORTED.items():
        if name not in user and getattr(config, name, default) not in (default, None):
            warnings.warn(f"the model's generation_config sets {name}={getattr(config, name)!r}, "
                          "which parallel generation ignores", stacklevel=3)  # fmt: skip
