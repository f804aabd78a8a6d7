"""Attention paths of hf_parallel: backend objects, registered with Transformers' AttentionInterface.

`BACKENDS` holds the built-in paths by name ("reference" always, "triton" where Triton is installed);
`resolve_backend` picks one and `use_attention` routes a model's attention through it.
No mask function is registered on purpose: for an implementation name absent from
the mask registry, `create_causal_mask` returns None at once
(`hf_parallel.compat.transformers_internals.register_attention`), so the model never
builds a dense causal mask of its own; the stream mask is evaluated from the plan instead.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel

from ..compat.transformers_internals import attention_implementation, attention_implementations, register_attention
from .backend import AttentionBackend, AttentionCall, StaticPlan
from .reference import ReferenceBackend

BACKENDS: dict[str, AttentionBackend] = {"reference": ReferenceBackend()}

try:  # the Triton path is optional: without triton the package serves the reference path alone
    from .triton import TritonBackend
except ImportError:
    pass
else:
    BACKENDS["triton"] = TritonBackend()

__all__ = ["BACKENDS", "AttentionBackend", "AttentionCall", "StaticPlan", "resolve_backend", "use_attention"]


def resolve_backend(attn: str | AttentionBackend, device: torch.device) -> AttentionBackend:
    """The backend `attn` names on `device` ("auto": triton on CUDA when installed, else reference); ValueError for
    an unknown name."""
    if isinstance(attn, AttentionBackend):
        return attn
    if attn == "auto":
        attn = "triton" if device.type == "cuda" and "triton" in BACKENDS else "reference"
    if attn not in BACKENDS:
        raise ValueError(
            f"unknown attention path {attn!r}; choose 'auto', one of {sorted(BACKENDS)}, or pass an AttentionBackend"
        )
    return BACKENDS[attn]


@contextlib.contextmanager
def use_attention(model: PreTrainedModel, backend: AttentionBackend):
    """Route `model`'s attention through `backend` for the duration of the block (restored after, whatever it
    raises).  ValueError for a backend without a name; NotImplementedError where the model refuses the
    implementation."""
    if not backend.name:
        raise ValueError(f"{type(backend).__name__} has no name to register with transformers' AttentionInterface")
    register_attention(backend.name, backend.attention)
    previous = attention_implementations(model.config)
    model.set_attn_implementation(backend.name)
    if attention_implementation(model.config) != backend.name:
        raise NotImplementedError(
            f"{type(model).__name__} does not let its attention implementation be set (set_attn_implementation "
            "refused it), so hf_parallel cannot apply its stream mask"
        )
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
