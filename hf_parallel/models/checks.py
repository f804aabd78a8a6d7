"""What no forward can fix, refused by name before any work: the model's type, its config and its placement.

Every refusal is a NotImplementedError whose message names one of `REASONS` (a model that is not a
`PreTrainedModel` is a TypeError).  The engine's probe forward refuses what only running the model shows,
with the same reasons.
"""

from __future__ import annotations

import inspect

from torch import nn
from transformers import PreTrainedModel

from .placement import placement, placement_problem
from .recurrent import segmented

REASONS = {
    "encoder-decoder": "is an encoder-decoder model; hf_parallel serves decoder-only causal LMs",
    "position_ids": "forward takes no position_ids; per-stream positions need them",
    "chunked": "uses chunked attention (attention_chunk_size), which hf_parallel lacks",
    "interface": "does not route the attention of every layer through transformers' AttentionInterface",
    "probe": "failed hf_parallel's probe forward",
    "mask": "passes an attention mask of its own to its attention function, where the stream mask must rule",
    "window": "keeps a sliding window its attention function is not told of",
    "leak": "lets one prompt change another's logits in a packed row (a state kept outside the cache)",
    "state": "gives a prompt prefilled in chunks other logits than prefilled whole (a recurrent state hf_parallel "
    "cannot carry)",
    "meta": "has parameters on the meta device that no accelerate offload hook loads (load the weights, or dispatch "
    "the model with accelerate)",
    "split": "is placed so that one attention layer computes on several devices; one layer's cache lives on one: "
    "keep each attention module whole in the device map (no_split_module_classes)",
    "recurrent-placement": "has layers with a recurrent state and computes on several devices; hf_parallel runs "
    "segmented states on one device",
}


def refuse(model: nn.Module, reason: str, detail: str = "") -> NotImplementedError:
    """The error refusing `model` for `reason` (a key of `REASONS`), with `detail` appended."""
    return NotImplementedError(f"{type(model).__name__} {REASONS[reason]}{detail}")


def check_model(model: PreTrainedModel) -> None:
    """Refuse, by name, what no forward can fix: the wrong type (TypeError), an encoder-decoder, no `position_ids`,
    chunked attention, a placement over devices hf_parallel cannot follow (NotImplementedError)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    check_placement(model)
    config = model.config.get_text_config()
    if getattr(config, "is_encoder_decoder", False):
        raise refuse(model, "encoder-decoder")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise refuse(model, "position_ids")
    if getattr(config, "attention_chunk_size", None):
        raise refuse(model, "chunked")


def check_placement(model: PreTrainedModel) -> None:
    """Refuse, by name, a placement hf_parallel cannot follow (`hf_parallel.models.placement`); on every call (a
    model may be dispatched again after its probe)."""
    where = placement(model)
    problem = placement_problem(model, where)
    if problem:
        raise refuse(model, *problem)
    if where.spans and segmented(model):
        raise refuse(model, "recurrent-placement")


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword the model's forward and generate take a KV cache by: `cache` from transformers 5.24, which
    deprecated `past_key_values` (its removal announced for 5.40 in forward, 6.0 in generate)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
