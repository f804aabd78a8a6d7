"""The attention-backend seam: a third backend plugs in without touching the loop, and switching is undone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

from hf_parallel import AttentionBackend, generate_tokens, score_continuations
from hf_parallel.attention import BACKENDS, use_attention
from tests.helpers.models import generate_alone, random_tokens, tiny_model


class DenseSDPA(AttentionBackend):
    """SDPA with the dense visibility mask written out here from the plan's ids, rebuilt by every layer."""

    name = "test_dense_sdpa"

    def __init__(self):
        self.calls = 0

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  softcap=None, pp_plan=None, **kwargs):  # fmt: skip
        self.calls += 1
        ids, kv = pp_plan.ids, pp_plan.kv_len
        k_seg = ids.slot_seg[:kv].long()
        ancestor = (k_seg[None] >= 0) & (k_seg[None] <= pp_plan.q_seg[:, None])
        ancestor &= pp_plan.q_seg[:, None] < ids.seg_end[k_seg.clamp(min=0)][None]
        causal = torch.arange(kv)[None] <= pp_plan.q_slot[:, None]
        mask = ancestor & causal
        if sliding_window is not None:
            mask &= pp_plan.q_pos[:, None] - ids.slot_pos[None, :kv] < sliding_window
        gqa = key.shape[1] != query.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None


def _prompts(seed: int, n: int = 5):
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(25, gen)
    return [doc + random_tokens(1 + 2 * i, gen) for i in range(n)]


def test_a_third_backend_plugs_in(llama):
    backend = DenseSDPA()
    prompts = _prompts(0)
    got = generate_tokens(llama, prompts, max_new_tokens=6, eos_token_id=[], attn=backend)
    assert got == [generate_alone(llama, p, 6) for p in prompts]
    forwards = 1 + 5  # one prefill chunk, then the decode steps after the first token
    assert backend.calls == forwards * llama.config.num_hidden_layers


def test_a_third_backend_sees_the_sliding_window_and_scores():
    model = tiny_model("mistral")  # window 12, shorter than the prompts
    prompts = _prompts(1)
    got = generate_tokens(model, prompts, max_new_tokens=5, eos_token_id=[], attn=DenseSDPA(), prefill_chunk=9)
    assert got == [generate_alone(model, p, 5) for p in prompts]
    cands = [[[5, 6, 7], [8]] for _ in prompts]
    want = score_continuations(model, prompts, cands, attn="reference")
    got = score_continuations(model, prompts, cands, attn=DenseSDPA())
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)


def test_use_attention_restores_every_sub_config():
    text = dict(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128)  # fmt: skip
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14)  # fmt: skip
    model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision)
    )
    model.set_attn_implementation({"": "eager", "text_config": "eager", "vision_config": "sdpa"})
    with use_attention(model, BACKENDS["reference"]):
        assert model.config.text_config._attn_implementation == BACKENDS["reference"].name
    assert model.config.text_config._attn_implementation == "eager"
    assert model.config.vision_config._attn_implementation == "sdpa"
