"""Per-forward attention metadata: built once per forward, read by every layer.

The plan travels to the attention function through the model's kwargs (`pp_plan=`)
and to the cache as `cache.plan`; it is never a module global.  An attention backend
builds it, and may extend it with fields of its own.  `Row` is what every plan of one
generation is built from.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import torch

from ..models.placement import normal_device
from .layout import Layout


@dataclass
class SlotIds:
    """Per-slot ids of the whole packed row, on the model's device (fixed for a generation).

    slot_seg: [S] int32 segment id of each slot (-1: a slot no query sees).
    slot_pos: [S] int32 position of each slot.
    seg_end:  [G] int32 pre-order interval end of each segment.
    seg_stop: [G] int32 one past each segment's last slot (`Layout.seg_stop`).
    """

    slot_seg: torch.Tensor
    slot_pos: torch.Tensor
    seg_end: torch.Tensor
    seg_stop: torch.Tensor

    @classmethod
    def from_layout(cls, layout: Layout, device: torch.device) -> SlotIds:
        return cls(*(t.to(device) for t in (layout.slot_seg, layout.slot_pos, layout.seg_end, layout.seg_stop)))

    def to(self, device, non_blocking: bool = False) -> SlotIds:
        tensors = (self.slot_seg, self.slot_pos, self.seg_end, self.seg_stop)
        return SlotIds(*(t.to(device, non_blocking=non_blocking) for t in tensors))


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

    A model placed over several devices gets the plan on each through `to` (see `hf_parallel.models.placement`):
    `copies` (device -> this plan there) holds each copy made, one per device however many layers ask, on the plan
    the loop built (a copy's own is empty).
    """

    q_slot: torch.Tensor
    q_seg: torch.Tensor
    q_pos: torch.Tensor
    kv_len: int
    ids: SlotIds
    # device -> this plan there, kept by the plan the loop built; a copy refers back to it weakly (no cycle)
    copies: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    origin: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.q_slot.device

    def to(self, device, non_blocking: bool = False) -> AttentionPlan:
        """This plan on `device`, copied once per device however many layers ask: accelerate's hooks call `.to`
        on every kwarg of every block they move (`send_to_device`), and the cache asks for its keys' device."""
        if device is None:  # as `Tensor.to(None)`: accelerate's hooks pass it where a module has no device
            return self
        device = normal_device(device)
        if device == self.device:
            return self
        origin = (self.origin() if self.origin is not None else None) or self
        if device == origin.device:
            return origin
        if device not in origin.copies:
            non_blocking = non_blocking and device.type == "cuda"  # a copy to the host must land before it is read
            fields = {
                f.name: _moved(getattr(origin, f.name), device, non_blocking)
                for f in dataclasses.fields(origin)
                if f.init
            }
            copy = type(origin)(**fields)
            copy.origin = weakref.ref(origin)
            origin.copies[device] = copy
        return origin.copies[device]

    @classmethod
    def for_slots(cls, q_slot: torch.Tensor, ids: SlotIds, kv_len: int | None = None, **fields) -> AttentionPlan:
        """Plan a forward over the tokens written at `q_slot` ([N] int64, on the host or the ids' device).

        `kv_len` defaults to the last slot any query may see (read on the host: pass host slots, or a host
        sync follows); a CUDA graph passes the row's capacity instead, so the plan is built from device ops
        alone.  `fields`: a subclass's own fields.
        """
        if kv_len is None:
            kv_len = int(q_slot.max()) + 1
        q_slot = upload(q_slot, ids.slot_seg.device).contiguous()  # kernels index it flat
        return cls(q_slot, ids.slot_seg[q_slot], ids.slot_pos[q_slot], kv_len, ids, **fields)


def upload(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`; a host tensor goes to a GPU through pinned memory, behind the work already queued
    there and without waiting for it (a plain copy from pageable memory waits for the GPU's queue to drain)."""
    device = normal_device(device)
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _moved(value, device: torch.device, non_blocking: bool):
    """A plan field on `device`: tensors and the tensor holders (`SlotIds`, a tile plan) moved, numbers kept."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    return value.to(device) if hasattr(value, "to") else value


def query_group(model_config) -> int:
    """Query heads per KV head of a model (1 without grouped-query attention)."""
    config = model_config.get_text_config()
    return config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
