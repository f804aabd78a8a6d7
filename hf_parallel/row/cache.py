"""Static KV storage for the packed row, as a `transformers.Cache`.

The model's own attention layers call `cache.update(k, v, layer_idx, ...)` unchanged;
the new keys and values are written at the slots of the current plan and the
leading `plan.kv_len` slots are returned.  Each shared prefix is stored once.  Layers
with a recurrent state get a `StateLayer` instead (`hf_parallel.models.recurrent`), and layers
with both (Falcon-H1's and Zamba2's hybrid layers) a `HybridLayer`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..models.recurrent import SegmentRuns, StateLayer
from .plan import AttentionPlan

try:  # the Triton write is optional: without triton every write is `index_copy_`
    import triton

    from ..kernels import cache_write, prebuild
except ImportError:
    cache_write = None


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

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: AttentionPlan, triton: bool = True):
        """key_states, value_states [1, H_kv, N, D] written at `plan.q_slot` [N] (`triton`: as `write_slots`'); the
        keys and values of the leading `plan.kv_len` slots, [1, H_kv, kv_len, D] views of the cache."""
        if not self.is_initialized:
            PackedLayer.lazy_initialization(self, key_states, value_states)
        write_slots(self.keys, self.values, plan.q_slot, key_states, value_states, triton)
        return self.keys[:, :, : plan.kv_len], self.values[:, :, : plan.kv_len]

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("PackedLayer is written through PackedCache.update, which knows the plan")

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.num_slots, 0

    def get_seq_length(self, *args) -> int:
        return 0  # positions come from the plan, never from the cache length

    def get_max_length(self) -> int:
        return self.num_slots

    def stored_bytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2 if self.is_initialized else 0


def write_slots(
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    triton: bool = True,
) -> None:
    """keys, values [1, H, S, D] at `slots` [N] <- key_states, value_states [1, H, N, D]: on CUDA one Triton launch
    for both (`kernels.cache_write`), elsewhere (and inside torch.compile, which fuses its own, or without `triton`)
    `index_copy_`."""
    tensors = (keys, values, key_states, value_states)
    plain = any(t.dtype != keys.dtype or t.stride(-1) != 1 for t in tensors) or key_states.shape[2] == 0
    if not triton or cache_write is None or not key_states.is_cuda or torch.compiler.is_compiling() or plain:
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)
        return
    with torch.cuda.device(key_states.device):  # Triton launches on the current device: a layer's may be another
        launch_write_slots(keys, values, slots, key_states, value_states)


def launch_write_slots(keys, values, slots, key_states, value_states) -> None:
    """`write_slots`' Triton launch (on the CPU: under TRITON_INTERPRET=1)."""
    _, heads, n, dim = key_states.shape
    block_d = triton.next_power_of_2(dim)
    block_h = max(1, min(triton.next_power_of_2(heads), 1024 // block_d))  # 1,024 elements: 8 a thread of 4 warps
    prebuild.run_kernel(
        cache_write.write_slots, (n, triton.cdiv(heads, block_h)), keys, values, key_states, value_states, slots, heads,
        keys.stride(1), keys.stride(2), values.stride(1), values.stride(2),
        key_states.stride(1), key_states.stride(2), value_states.stride(1), value_states.stride(2),
        HEAD_DIM=dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip


def prebuild_writes(calls: list, device: torch.device) -> list:
    """`write_slots`' launch for the K/V of each of `calls` (`AttentionCall`s) built on a thread (`prebuild.start`),
    from stand-in tensors: a build depends on the dtype, the head count and size, and the strides' alignment, the
    same for every write of a model whose head size is a multiple of 16 (the new K/V a strided view or not)."""
    if cache_write is None or device.type != "cuda":
        return []
    with prebuild.collecting() as launches:
        for call in calls:
            cache = torch.empty(1, call.kv_heads, 16, call.head_dim, dtype=call.dtype, device=device)
            new = torch.empty(1, 16, call.kv_heads, call.head_dim, dtype=call.dtype, device=device).transpose(1, 2)
            write_slots(cache, cache, torch.arange(16, device=device), new, new)
    return prebuild.start(device, launches)


class HybridLayer(StateLayer, PackedLayer):
    """K/V and a recurrent state under one layer index: the layer of a recurrent mixer, which may also run
    attention beside it (Falcon-H1, Zamba2); its K/V is allocated only if written."""

    def __init__(self, num_slots: int):  # `lazy_initialization` is the state's: `write` names PackedLayer's
        PackedLayer.__init__(self, num_slots)
        StateLayer.__init__(self)

    def stored_bytes(self) -> int:
        return PackedLayer.stored_bytes(self) + StateLayer.stored_bytes(self)


class PackedCache(Cache):
    """KV cache of one packed row of `num_slots` slots (and recurrent states) for every layer of a model.

    kinds: per layer, "attention" or "hybrid" (K/V and a recurrent state).  Set `cache.plan` to the current
    forward's `AttentionPlan` before each forward, and `cache.segment_runs` where layers are recurrent;
    `update` without a plan raises RuntimeError.  `triton_writes` (default True): new K/V through `write_slots`'
    Triton launch where it applies; False: `index_copy_`.  Each layer's K/V lives on the device of its keys, so a model
    placed over several devices keeps each layer's cache beside that layer.
    """

    def __init__(self, kinds: list[str], num_slots: int):
        layers = {"attention": PackedLayer, "hybrid": HybridLayer}
        # Cache's own __init__, not the next class's in the MRO (a model's own cache class, mixed in, takes none)
        Cache.__init__(self, layers=[layers[kind](num_slots) for kind in kinds])
        self.num_slots = num_slots
        self.plan: AttentionPlan | None = None
        self.segment_runs: SegmentRuns | None = None
        self.triton_writes = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Layer `layer_idx`'s `PackedLayer.write` under the current plan (on the keys' device); RuntimeError
        without a plan."""
        if self.plan is None:
            raise RuntimeError("PackedCache.update called without a plan: use hf_parallel's generation functions")
        plan = self.plan
        if plan.device != key_states.device:  # a model placed over devices: this layer's (copied once per forward)
            plan = plan.to(key_states.device)
        return self.layers[layer_idx].write(key_states, value_states, plan, self.triton_writes)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.layers)

    # MiniMax's lightning attention keeps its state through these two (its own cache type's API)
    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self.layers[layer_idx].linear_state(0)

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        self.layers[layer_idx].set_linear_state(0, state)

    def stored_bytes(self) -> int:
        """Bytes of K/V and recurrent states held, all layers (for memory tests and reports)."""
        return sum(layer.stored_bytes() for layer in self.layers)
