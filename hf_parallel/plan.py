"""Per-forward attention metadata: built once per forward, read by every layer.

The plan travels to the attention function through the model's kwargs (`pp_plan=`)
and to the cache as `cache.plan`; it is never a module global.  An attention backend
(`hf_parallel.attention`) builds it, and may extend it with fields of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout


@dataclass
class SlotIds:
    """Per-slot ids of the whole packed row, on the model's device (fixed for a generation).

    slot_seg: [S] int32 segment id of each slot (-1: a slot no query sees).
    slot_pos: [S] int32 position of each slot.
    seg_end:  [G] int32 pre-order interval end of each segment.
    """

    slot_seg: torch.Tensor
    slot_pos: torch.Tensor
    seg_end: torch.Tensor

    @classmethod
    def from_layout(cls, layout: Layout, device: torch.device) -> SlotIds:
        return cls(layout.slot_seg.to(device), layout.slot_pos.to(device), layout.seg_end.to(device))


@dataclass
class Row:
    """What every plan of one generation is built from.

    layout:   where every token lives (host).
    ids:      the layout's `SlotIds` on the device, `capacity` slots long.
    capacity: slots of the row's cache (>= layout.num_slots; a captured step's kv_len).
    group:    query heads per KV head of the model (1 without grouped-query attention).
    """

    layout: Layout
    ids: SlotIds
    capacity: int
    group: int

    @property
    def device(self) -> torch.device:
        return self.ids.slot_seg.device


@dataclass
class AttentionPlan:
    """The N new tokens of one forward and the slots they may see.

    q_slot: [N] int64 slot each new token's K/V is written to (and its causal limit).
    q_seg:  [N] int32 segment of each new token.
    q_pos:  [N] int32 position of each new token.
    kv_len: number of leading slots any query of this forward may see.
    ids:    the row's `SlotIds`.
    """

    q_slot: torch.Tensor
    q_seg: torch.Tensor
    q_pos: torch.Tensor
    kv_len: int
    ids: SlotIds

    @classmethod
    def for_slots(cls, q_slot: torch.Tensor, ids: SlotIds, kv_len: int | None = None, **fields) -> AttentionPlan:
        """Plan a forward over the tokens written at `q_slot` ([N] int64, on the ids' device).

        `kv_len` defaults to the last slot any query may see (a host sync); a CUDA graph
        passes the row's capacity instead, so the plan is built from device ops alone.
        `fields`: a subclass's own fields.
        """
        q_slot = q_slot.contiguous()  # kernels index it flat
        if kv_len is None:
            kv_len = int(q_slot.max()) + 1
        return cls(q_slot, ids.slot_seg[q_slot], ids.slot_pos[q_slot], kv_len, ids, **fields)


def query_group(model_config) -> int:
    """Query heads per KV head of a model (1 without grouped-query attention)."""
    config = model_config.get_text_config()
    return config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
