"""Static KV storage for the packed row, as a `transformers.Cache`.

The model's own attention layers call `cache.update(k, v, layer_idx, ...)` unchanged;
the new keys and values are written at the slots of the current plan and the
leading `plan.kv_len` slots are returned.  Each shared prefix is stored once.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .plan import AttentionPlan


class PackedLayer(CacheLayerMixin):
    """One layer's K/V: [1, H_kv, S, D] each, allocated on first write."""

    def __init__(self, num_slots: int):
        super().__init__()
        self.num_slots = num_slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, _ = key_states.shape
        self.keys = key_states.new_zeros(1, heads, self.num_slots, key_states.shape[-1])
        self.values = value_states.new_zeros(1, heads, self.num_slots, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: AttentionPlan):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, plan.q_slot, key_states)
        self.values.index_copy_(2, plan.q_slot, value_states)
        return self.keys[:, :, : plan.kv_len], self.values[:, :, : plan.kv_len]

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("PackedLayer is written through PackedCache.update, which knows the plan")

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.num_slots, 0

    def get_seq_length(self, *args) -> int:
        return 0  # positions come from the plan, never from the cache length

    def get_max_length(self) -> int:
        return self.num_slots


class PackedCache(Cache):
    """KV cache of one packed row of `num_slots` slots for every layer of a model.

    Set `cache.plan` to the current forward's `AttentionPlan` before each forward.
    """

    def __init__(self, num_layers: int, num_slots: int):
        super().__init__(layers=[PackedLayer(num_slots) for _ in range(num_layers)])
        self.num_slots = num_slots
        self.plan: AttentionPlan | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.plan is None:
            raise RuntimeError("PackedCache.update called without a plan: use hf_parallel's generation functions")
        return self.layers[layer_idx].write(key_states, value_states, self.plan)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def stored_bytes(self) -> int:
        """Bytes of K/V held, all layers (for memory tests and reports)."""
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.is_initialized)
