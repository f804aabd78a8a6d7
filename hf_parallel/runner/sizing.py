"""How large one packed row may be: its slots and most live streams, from a memory budget.

The budget is the user's `max_memory`, or what the device has free (CUDA: `mem_get_info` plus
the blocks PyTorch's caching allocator holds unused, plus a `RowKeeper`'s kept row, which the call
reuses or frees; CPU: the available physical memory).  From it come the forward's working memory (hidden
states and MLP activations of the largest forward, and the float32 logits and processed
scores of every live stream) and the recurrent state of every live stream (twice: its lane's, and its
prompt's end, kept until it starts); the rest holds
K/V slots at the bytes per slot the probe found (`ModelProfile.slot_bytes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..decoding.sizes import parse_memory
from .patching import ModelProfile

FREE_FRACTION = 0.9  # of the device's free memory: the allocator's fragmentation and other users' share
MAX_STREAMS = 4096  # live streams of one row: beyond this, a step's logits outgrow what a step gains


@dataclass(frozen=True)
class RowSize:
    """capacity: K/V slots of the row; streams: most live streams; bytes: the memory it was sized from."""

    capacity: int
    streams: int
    bytes: int


def free_memory(device: torch.device) -> int:
    """Bytes the device has free now for this process: on CUDA what the driver has free and what PyTorch's caching
    allocator holds unused (a finished call's blocks stay reserved until `torch.cuda.empty_cache()`)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def size_row(
    model: PreTrainedModel,
    profile: ModelProfile,
    chunk: int,
    max_memory=None,
    streams: int = MAX_STREAMS,
    kept: int = 0,
) -> RowSize:
    """The row that fits `max_memory` (bytes or "40GiB"; None: the device's free memory and the `kept` bytes of a
    session's row, which the call reuses or frees), for at most `streams` live streams (fewer when their working
    memory would take more than a quarter of the budget).

    Raises ValueError when not even one stream of one token fits, naming the memory needed.
    """
    if max_memory is not None:
        total = parse_memory(max_memory)
    else:
        total = int((free_memory(model.device) + kept) * FREE_FRACTION)
    config = model.config.get_text_config()
    # a stream's recurrent state, logits and scores (float32), and its token's share of a forward
    per_stream = 2 * profile.stream_bytes + 2 * 4 * config.vocab_size + _forward_bytes(model, 1)
    streams = max(1, min(streams, MAX_STREAMS))
    while streams > 1 and streams * per_stream > total // 4:
        streams //= 2
    work = _forward_bytes(model, chunk) + streams * per_stream
    capacity = (total - work) // max(profile.slot_bytes, 1)
    if capacity < 2:
        raise ValueError(
            f"max_memory of {size(total)} holds not even one short prompt: a forward of {chunk} tokens "
            f"needs about {size(work)} besides the cache"
        )
    return RowSize(int(capacity), streams, total)


def too_large(index: int, slots: int, row: RowSize) -> ValueError:
    """The error for prompt `index`: it needs `slots` (its tokens plus max_new_tokens), more than `row` holds."""
    return ValueError(
        f"prompt {index} needs {slots} slots (its tokens plus max_new_tokens) but the memory budget "
        f"holds {row.capacity} tokens of K/V ({size(row.bytes)}); raise max_memory or lower "
        "max_new_tokens"
    )


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _forward_bytes(model: PreTrainedModel, tokens: int) -> int:
    """Working memory of a forward over `tokens` tokens: hidden states, attention projections and the MLP's
    intermediate activations, live at once, in the model's dtype (a generous bound, not a measurement)."""
    config = model.config.get_text_config()
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    inner = inner if isinstance(inner, int) else max(inner)
    return tokens * (8 * hidden + 3 * inner) * model.dtype.itemsize
