"""Dense stream-mask attention: the specification every fast path must match.

A query may see a key iff the key's segment is an ancestor of (or is) the query's
segment, the key's slot is not after the query's, and, for sliding-window layers,
the key is less than `sliding_window` positions behind (HF's rule: kv > q - window).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..plan import AttentionPlan, Row
from .backend import AttentionBackend


def stream_mask(plan: AttentionPlan, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean mask [N, kv_len]: True where query n may attend to slot k."""
    ids, kv = plan.ids, plan.kv_len
    k_seg = ids.slot_seg[:kv].long()
    k_end = ids.seg_end[k_seg.clamp(min=0)]
    q_seg = plan.q_seg[:, None]
    mask = (k_seg[None] <= q_seg) & (q_seg < k_end[None]) & (k_seg[None] >= 0)
    mask &= torch.arange(kv, device=q_seg.device)[None] <= plan.q_slot[:, None]
    if sliding_window is not None:
        mask &= (plan.q_pos[:, None] - ids.slot_pos[None, :kv]) < sliding_window
    return mask


def sdpa_attention(query, key, value, mask, scaling=None, softcap=None) -> torch.Tensor:
    """Masked attention, query [1, H, N, D], key/value [1, H_kv, S, D], mask [N, S] -> [1, N, H, D]."""
    if softcap is None:
        gqa = key.shape[1] != query.shape[1]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask[None, None], scale=scaling, enable_gqa=gqa
        )
    else:  # SDPA has no logit soft-capping (Gemma 2): spell it out
        out = _softcapped_attention(query, key, value, mask, scaling, softcap)
    return out.transpose(1, 2).contiguous()


def _softcapped_attention(query, key, value, mask, scaling, softcap):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.tanh(query @ key.transpose(-1, -2) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask[None, None], float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(value.dtype) @ value


def check_attention_call(module, query, attention_mask, dropout, plan, kwargs) -> None:
    """Refuse what the stream mask cannot honour, by name, before any work."""
    if plan is None:
        raise RuntimeError(
            "hf_parallel attention was called without a plan (pp_plan); it only runs inside hf_parallel's generation"
        )
    if query.shape[0] != 1:
        raise ValueError(f"hf_parallel packs every stream into one row; got batch size {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("hf_parallel builds its own stream mask; the model passed another attention mask")
    if dropout and module.training:
        raise ValueError("hf_parallel attention does not support dropout (put the model in eval mode)")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by hf_parallel's attention")


@dataclass
class ReferencePlan(AttentionPlan):
    """A plan that keeps each sliding window's dense mask, built by the first layer that needs it."""

    masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self.masks:
            self.masks[sliding_window] = stream_mask(self, sliding_window)
        return self.masks[sliding_window]


def reference_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None,
    pp_plan: AttentionPlan | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """HF attention-interface function.  query [1, H, N, D]; key, value [1, H_kv, S, D] -> [1, N, H, D]."""
    check_attention_call(module, query, attention_mask, dropout, pp_plan, kwargs)
    mask = pp_plan.mask(sliding_window) if isinstance(pp_plan, ReferencePlan) else stream_mask(pp_plan, sliding_window)
    return sdpa_attention(query, key, value, mask, scaling, softcap), None


class ReferenceBackend(AttentionBackend):
    """The dense mask from the slot ids, then SDPA: a dozen plain lines, the specification."""

    name = "hf_parallel_reference"
    attention = staticmethod(reference_attention)

    def plan(self, row: Row, q_slot: torch.Tensor, kv_len: int | None = None) -> ReferencePlan:
        return ReferencePlan.for_slots(q_slot, row.ids, kv_len)
