"""Dense stream-mask attention: the specification every fast path must match.

A query may see a key iff the key's segment is an ancestor of the query's segment (wherever
its slots lie), or is the query's own segment and the key's slot is not after the query's;
and, for sliding-window layers, the key is less than `sliding_window` positions behind
(HF's rule: kv > q - window).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..row.plan import AttentionPlan, Row
from .backend import AttentionBackend


def stream_mask(plan: AttentionPlan, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean mask [N, kv_len]: True where query n may attend to slot k."""
    ids, kv = plan.ids, plan.kv_len
    k_seg = ids.slot_seg[:kv].long()
    k_end = ids.seg_end[k_seg.clamp(min=0)]
    q_seg = plan.q_seg[:, None]
    mask = (k_seg[None] <= q_seg) & (q_seg < k_end[None]) & (k_seg[None] >= 0)
    mask &= (k_seg[None] != q_seg) | (torch.arange(kv, device=q_seg.device)[None] <= plan.q_slot[:, None])
    if sliding_window is not None:
        mask &= (plan.q_pos[:, None] - ids.slot_pos[None, :kv]) < sliding_window
    return mask


def sdpa_attention(query, key, value, mask, scaling=None, softcap=None, sinks=None) -> torch.Tensor:
    """Masked attention, query [1, H, N, D], key/value [1, H_kv, S, D], mask [N, S] -> [1, N, H, D].

    softcap: Gemma 2's logit soft-capping.  sinks: [H] gpt-oss's per-head sink logit, a virtual key
    with no value that every query's softmax includes.
    """
    if softcap is None and sinks is None:
        gqa = key.shape[1] != query.shape[1]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask[None, None], scale=scaling, enable_gqa=gqa
        )
    else:  # SDPA has neither: spell them out
        out = _spelled_out_attention(query, key, value, mask, scaling, softcap, sinks)
    return out.transpose(1, 2).contiguous()


def _spelled_out_attention(query, key, value, mask, scaling, softcap, sinks):
    """`sdpa_attention`'s softcap and sinks in plain ops, scores in float32; [1, H, N, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[None, None], float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return (torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]).to(value.dtype) @ value
    return torch.softmax(scores, dim=-1).to(value.dtype) @ value


def plan_on(plan: AttentionPlan | None, device: torch.device) -> AttentionPlan | None:
    """The plan on the device of a layer's queries: accelerate's hooks move it, this catches a layer they did not."""
    return plan.to(device) if plan is not None and plan.device != device else plan


def check_attention_call(module, query, attention_mask, dropout, plan, kwargs) -> None:
    """Refuse what the stream mask cannot honour, by name, before any work: RuntimeError without a plan (outside
    hf_parallel's generation); ValueError for a batch of more than one row, a mask of the model's own, or dropout
    in training mode."""
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


@dataclass
class ReferencePlan(AttentionPlan):
    """A plan that keeps each sliding window's dense mask, built by the first layer that needs it."""

    masks: dict[int | None, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """`stream_mask` [N, kv_len] for `sliding_window`, built once per plan."""
        if sliding_window not in self.masks:
            self.masks[sliding_window] = stream_mask(self, sliding_window)
        return self.masks[sliding_window]


def reference_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    pp_plan: AttentionPlan | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function.  query [1, H, N, D]; key, value [1, H_kv, S, D] -> [1, N, H, D].

    kwargs may carry `s_aux`, gpt-oss's attention sinks ([H] logits)."""
    check_attention_call(module, query, attention_mask, dropout, pp_plan, kwargs)
    pp_plan = plan_on(pp_plan, query.device)
    mask = pp_plan.mask(sliding_window) if isinstance(pp_plan, ReferencePlan) else stream_mask(pp_plan, sliding_window)
    return sdpa_attention(query, key, value, mask, scaling, softcap, kwargs.get("s_aux")), None


class ReferenceBackend(AttentionBackend):
    """The dense mask from the slot ids, then SDPA: a dozen plain lines, the specification."""

    name = "hf_parallel_reference"
    attention = staticmethod(reference_attention)

    def plan(self, row: Row, q_slot: torch.Tensor, kv_len: int | None = None) -> ReferencePlan:
        return ReferencePlan.for_slots(q_slot, row.ids, kv_len)
