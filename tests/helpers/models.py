"""The tiny random-weight models the tests compare against `model.generate`: one config per architecture family
(`ARCHITECTURES`), more families on fewer workloads (`FAMILIES`), random prompts over their vocabulary, and what plain
`model.generate` answers for a prompt alone.  No downloads: config classes and random weights only."""

from __future__ import annotations

import torch
import transformers

VOCAB = 96

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, initializer_range=0.2)  # fmt: skip
# One tiny config per architecture family; several use GQA, Mistral and Gemma 2 a
# sliding window shorter than the prompts (so the window is exercised), Gemma 2 softcapping.
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, intermediate_size=128, num_key_value_heads=2),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, intermediate_size=128, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(**COMMON, intermediate_size=128, num_key_value_heads=1,
                                                  sliding_window=12),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, intermediate_size=128, num_key_value_heads=1, head_dim=16),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, intermediate_size=128, num_key_value_heads=2,
                                                head_dim=16, sliding_window=12, attn_logit_softcapping=20.0,
                                                final_logit_softcapping=15.0),
    "phi3": lambda: transformers.Phi3Config(**COMMON, intermediate_size=128, num_key_value_heads=2,
                                            pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            initializer_range=0.2, bos_token_id=1, eos_token_id=2),
    # attention sinks, on a sliding-window layer and a full one; MoE
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                                 layer_types=["sliding_attention", "full_attention"], sliding_window=12,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # a hybrid: a gated delta net layer (recurrent state) and an attention layer
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(
        **COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"]),
}  # fmt: skip
# More families, tested on fewer workloads (tests/models/test_families.py): attention modules whose decoder layer
# drops the attention kwargs, and hybrids of attention with gated delta nets, Mamba, short convolutions or lightning
# attention.
_MAMBA = dict(mamba_d_state=16, mamba_d_conv=4)
FAMILIES = {
    "stablelm": lambda: transformers.StableLmConfig(**COMMON, intermediate_size=128, num_key_value_heads=2),
    "nemotron": lambda: transformers.NemotronConfig(**COMMON, intermediate_size=128, num_key_value_heads=2),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "falcon_h1": lambda: transformers.FalconH1Config(  # every layer attention and Mamba2 side by side
        **COMMON, intermediate_size=128, num_key_value_heads=2, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_state=16,
        mamba_d_conv=4, mamba_chunk_size=16),
    "bamba": lambda: transformers.BambaConfig(**COMMON, intermediate_size=128, num_key_value_heads=2,
                                              attn_layer_indices=[1], mamba_n_heads=4, mamba_expand=2,
                                              mamba_chunk_size=16, **_MAMBA),
    "jamba": lambda: transformers.JambaConfig(**COMMON, intermediate_size=128, num_key_value_heads=2,
                                              attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                              expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                                              use_mamba_kernels=False, mamba_expand=2, mamba_dt_rank=8, **_MAMBA),
    "zamba2": lambda: transformers.Zamba2Config(**COMMON, layers_block_type=["linear_attention", "hybrid"],
                                                mamba_d_state=16, n_mamba_heads=4, mamba_ngroups=1, chunk_size=16,
                                                use_mamba_kernels=False, num_mem_blocks=1, use_mem_rope=True),
    "lfm2": lambda: transformers.Lfm2Config(**COMMON, intermediate_size=128, num_key_value_heads=2,
                                            full_attn_idxs=[1], conv_L_cache=3,  # layer 0 a short convolution
                                            block_auto_adjust_ff_dim=False),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        **{**COMMON, "num_hidden_layers": 3}, intermediate_size=128,
        layers_block_type=["linear_attention", "full_attention", "mlp"], num_key_value_heads=2, head_dim=16,
        mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=16,
        use_mamba_kernels=False, n_routed_experts=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32),
    "minimax": lambda: transformers.MiniMaxConfig(**COMMON, intermediate_size=128, num_key_value_heads=2,
                                                  head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                                  block_size=16, layer_types=["linear_attention", "full_attention"]),
}  # fmt: skip


def tiny_model(arch: str, dtype=torch.float32):
    """The tiny model of `arch` (a key of `ARCHITECTURES` or `FAMILIES`), in eval mode: the same weights on every
    call, drawn after `torch.manual_seed(0)` (torch's global generator is left seeded as that draw leaves it)."""
    torch.manual_seed(0)
    config = {**ARCHITECTURES, **FAMILIES}[arch]()
    # Attention logit soft-capping (Gemma 2): the plain forward we compare against must apply it; transformers
    # 5.17's SDPA path silently drops it (5.24 refuses), so such models run eager attention there.
    eager = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **eager).eval()


def random_tokens(n: int, generator: torch.Generator, low: int = 3) -> list[int]:
    """`n` token ids drawn from [low, VOCAB) with `generator`."""
    return torch.randint(low, VOCAB, (n,), generator=generator).tolist()


def generate_alone(model, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """What plain `model.generate` answers for `prompt` asked alone (greedy)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()
