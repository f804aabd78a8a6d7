"""Attention paths of hf_parallel, registered with Transformers' AttentionInterface.

No mask function is registered on purpose: for an implementation name absent from
the mask registry, `create_causal_mask` returns None at once (transformers 5.17 and
5.24 alike), so the model never builds a dense causal mask of its own; the stream
mask is evaluated from the plan instead.
"""

from __future__ import annotations

import contextlib

from transformers import AttentionInterface, PreTrainedModel

from .reference import reference_attention

IMPLEMENTATIONS = {"reference": "hf_parallel_reference"}
# attention path -> factory(runner, bucket) of the static state a captured decode step needs
# (an object with `install(plan)` and `refill(slots, layout)`); paths with none are absent.
GRAPH_STATES: dict = {}

AttentionInterface.register(IMPLEMENTATIONS["reference"], reference_attention)

try:  # the Triton path is optional: without triton the package serves the reference path alone
    from .tiles import GraphTiles
    from .triton import triton_attention
except ImportError:
    pass
else:
    IMPLEMENTATIONS["triton"] = "hf_parallel_triton"
    AttentionInterface.register(IMPLEMENTATIONS["triton"], triton_attention)
    GRAPH_STATES["triton"] = GraphTiles


@contextlib.contextmanager
def use_attention(model: PreTrainedModel, attn: str):
    """Route `model`'s attention through hf_parallel's `attn` path for the duration of the block."""
    if attn not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention path {attn!r}; choose one of {sorted(IMPLEMENTATIONS)}")
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = IMPLEMENTATIONS[attn]
    try:
        yield
    finally:
        config._attn_implementation = previous
