"""Every decoder-only causal LM of the installed transformers as a tiny random-weight model, from its config class.

`causal_lm_types()` discovers the types from transformers' auto mapping and keeps the decoder-only ones;
`tiny_config(model_type)` shrinks the default config by field name (sub-configs too), keeping one layer of each kind,
then applies `OVERRIDES` where the generic shrink cannot build a working model; `build(model_type)` makes the model.
No hub downloads: only config classes and random weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .models import ARCHITECTURES, FAMILIES

VOCAB = 128  # prompts draw from [3, 96); ids a config reserves (image, audio, ...) get 96 and up
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
MAX_LAYERS = 4
# (tiny value, fields that get it where the default config has an int larger than it)
_SIZE_GROUPS = [
    (64, "hidden_size n_embd d_model emb_dim embedding_dim embedding_size word_embed_proj_dim lru_width"),
    (64, "input_embedding_size output_embedding_size"),
    (4, "num_attention_heads n_head n_heads num_heads attention_heads decoder_attention_heads swa_num_attention_heads"),
    (4, "encoder_attention_heads index_n_heads mamba_n_heads n_mamba_heads mamba_num_heads linear_num_heads"),
    (4, "linear_num_value_heads"),
    (2, "num_key_value_heads num_kv_heads swa_num_key_value_heads linear_num_key_heads num_query_groups"),
    (16, "head_dim swa_head_dim attention_head_dim attention_head_size d_head dim_head kv_channels v_head_dim"),
    (16, "qk_head_dim index_head_dim linear_key_head_dim linear_value_head_dim linear_head_dim mamba_d_head"),
    (16, "mamba_head_dim mamba_headdim"),
    (128, "intermediate_size ffn_dim n_inner dff ffn_hidden_size d_inner decoder_ffn_dim encoder_ffn_dim dim_ff"),
    (128, "feed_forward_size intermediate_size_mlp dense_intermediate_size mamba_d_ssm"),
    # mixtures of experts: few, small experts, two per token
    (32, "moe_intermediate_size shared_expert_intermediate_size shared_intermediate_size expert_ffn_hidden_size"),
    (32, "moe_shared_expert_intermediate_size shared_experts_intermediate_size"),
    (4, "num_experts num_local_experts n_routed_experts moe_num_experts"),
    (2, "num_experts_per_tok num_experts_per_token moe_topk moe_k top_k"),
    (1, "n_shared_experts num_shared_experts moe_num_shared_experts n_group topk_group num_expert_group"),
    (1, "zero_expert_num"),
    # multi-head latent attention
    (16, "kv_lora_rank o_lora_rank"),
    (32, "q_lora_rank"),
    (8, "qk_rope_head_dim qk_nope_head_dim rotary_dim index_topk"),
    # Mamba-like state
    (16, "mamba_d_state ssm_state_size state_size mamba_chunk_size chunk_size"),
    (4, "mamba_d_conv conv_kernel"),
    (2, "mamba_expand expand"),
    (1, "mamba_n_groups n_groups mamba_ngroups"),
    (8, "time_step_rank mamba_dt_rank"),
    (256, "max_position_embeddings n_positions n_ctx max_seq_len context_length max_target_positions"),
    (256, "model_max_length original_max_position_embeddings"),
    # sliding windows shorter than the prompts, so the window is exercised
    (12, "sliding_window sliding_window_size window_size attention_window_size local_attention"),
    (12, "local_attention_window_len"),
    (VOCAB, "vocab_size vocab_size_per_layer_input unpadded_vocab_size decoder_vocab_size"),
]
SIZES = {name: value for value, names in _SIZE_GROUPS for name in names.split()}
LAYER_COUNTS = "num_hidden_layers n_layer num_layers n_layers decoder_layers num_decoder_layers num_blocks".split()

# Where the generic shrink cannot build a working model: config fields set after it (sub-configs as nested dicts).
_QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
_ASSISTANT_TEXT = dict(
    model_type="gemma4_text", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=VOCAB, layer_types=["sliding_attention", "full_attention"],
    sliding_window=12, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False,
    use_double_wide_mlp=False, num_kv_shared_layers=2)  # fmt: skip
_ASSISTANT = dict(backbone_hidden_size=64, num_centroids=8, centroid_intermediate_top_k=2)
OVERRIDES: dict[str, dict] = {
    # defaults that leave a size undefined (None) or inconsistent with the shrunk ones
    "deepseek_v2": dict(num_experts_per_tok=2, n_group=1, topk_group=1),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "qwen4_exp_text": _QSA,
    "qwen4_exp": dict(text_config=_QSA),
    "mamba2": dict(num_heads=8, head_dim=16),  # heads * head_dim = expand * hidden_size
    "granitemoehybrid": dict(mamba_d_head=32, layer_types=["linear_attention", "full_attention"]),  # default: all Mamba
    "dots3_note": dict(vision_config=dict(adapter_in_dim=64, adapter_out_dim=64),
                       audio_config=dict(adapter_input_size=64, adapter_out_dim=64)),
    "rwkv": dict(attention_hidden_size=64),
    "xlstm": dict(qk_dim_factor=1.0),
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16]),  # sum: hidden_size, product: positions
    "xmod": dict(default_language="en_XX"),
    # layer structure given by counts, periods or stacks rather than per-layer lists
    "dory": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=2, L_cycles=1, L_bp_cycles=[1], num_hidden_layers=4),
    "kolibri1_1": dict(num_hidden_layers=3, layer_types=["sliding_attention"] + ["indexed_attention"] * 2,
                       index_layers=[1], kv_source_layers=[0, 1, 1], head_dim=16, index_num_heads=1,
                       index_pool_size=16, index_compression=4, index_topk=8),  # the last layer reads the indexer's K/V
    "recurrent_gemma": dict(num_hidden_layers=3),  # block_types is a pattern of three: two recurrent, one attention
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, attention_hidden_size=128,
                  attention_head_dim=32, layers_block_type=["linear_attention", "hybrid"] * 2),  # two share a block
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4,
                         layer_types=["sliding_attention", "full_attention"] * 2, intermediate_size=[128] * 4),
    # assistants (multi-token prediction): every layer reads the backbone's K/V
    "gemma4_assistant": dict(_ASSISTANT, text_config=_ASSISTANT_TEXT),
    "gemma4_unified_assistant": dict(_ASSISTANT, text_config=dict(_ASSISTANT_TEXT, model_type="gemma4_unified_text")),
}  # fmt: skip

# Types with nothing to compare against: their tiny model cannot run plain `model.generate` at all.
SKIPS: dict[str, str] = {
    "blt": "plain generate fails in transformers: BltModel.forward builds DynamicCache(config=self.config) from the "
    "composite BltConfig, which has no num_hidden_layers (AttributeError), whatever the sizes",
}
if importlib.util.find_spec("timm") is None:
    SKIPS["gemma3n"] = (
        "the multimodal Gemma3nForConditionalGeneration builds its vision tower with timm (TimmWrapperModel), which "
        "is not installed; gemma3n_text covers its language model"
    )


@dataclasses.dataclass(frozen=True)
class CausalLM:
    model_type: str
    config_class: type
    model_class_name: str

    @property
    def model_class(self) -> type:
        return getattr(transformers, self.model_class_name)


def causal_lm_types() -> tuple[list[CausalLM], list[str]]:
    """The decoder-only causal LMs of transformers' auto mapping, and the encoder-decoder types left out (their
    ForCausalLM is the decoder of an encoder-decoder model: the config's `is_encoder_decoder` defaults to True)."""
    kept, encoder_decoder = [], []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config_class = CONFIG_MAPPING[model_type]
        if _is_encoder_decoder(config_class):
            encoder_decoder.append(model_type)
        else:
            kept.append(CausalLM(model_type, config_class, class_name))
    return kept, encoder_decoder


def _is_encoder_decoder(config_class: type) -> bool:
    try:
        return bool(config_class().is_encoder_decoder)
    except Exception:  # noqa: BLE001 - a default config that does not validate: the field's declared default, or
        # an encoder and a decoder among its sub-configs (5.17's MusicgenConfig needs them given to validate)
        field = getattr(config_class, "__dataclass_fields__", {}).get("is_encoder_decoder")
        subs = getattr(config_class, "sub_configs", {}) or {}
        return bool(field is not None and field.default) or ("decoder" in subs and any("encoder" in k for k in subs))


def tiny_config(lm: CausalLM):
    """The conftest's hand-written config where it has one, else the default config shrunk, then `OVERRIDES`."""
    hand_written = {**ARCHITECTURES, **FAMILIES}.get(lm.model_type)
    if hand_written is not None:
        return hand_written()
    base = _default_dict(lm)
    shrunk = _merge(shrink(base, lm.config_class), OVERRIDES.get(lm.model_type, {}))
    return lm.config_class(**shrunk)


def _default_dict(lm: CausalLM) -> dict:
    try:
        return lm.config_class().to_dict()
    except Exception:  # noqa: BLE001 - a default that does not validate: start from the overrides alone
        return {}


# keys no shrunk config is built with (5.17's Dbrx sub-configs refuse `output_attentions`, which to_dict writes)
DROPPED = ("transformers_version", "architectures", "_name_or_path", "dtype", "output_attentions")


def shrink(d: dict, config_class: type) -> dict:
    """A tiny version of a config dict: sizes by field name, layers cut to one of each kind, sub-configs alike."""
    out = {k: v for k, v in d.items() if k not in DROPPED}
    subs = getattr(config_class, "sub_configs", {}) or {}
    for key, value in out.items():
        if isinstance(value, dict) and key in subs:
            out[key] = shrink(value, _sub_class(subs[key], value))
    out.update(_sizes(out))
    if out.get("head_dim", 0) is None:  # None is hidden_size / heads, which some models fail to derive
        out["head_dim"] = SIZES["head_dim"]
    if _is_int(d.get("head_dim")) and d.get("head_dim") == d.get("qk_rope_head_dim"):  # MLA: rotary part's width
        out["head_dim"] = out["qk_rope_head_dim"]
    out.update(_cut_layers(out))
    out.update(_token_ids(out))
    # Varied greedy answers test more than a repeated token: untied, so a head over scaled embeddings (Gemma) does
    # not echo the last token; larger random weights than a trained model's, except in an encoder's post-norm layers.
    if "tie_word_embeddings" in out:
        out["tie_word_embeddings"] = False
    if "is_decoder" in getattr(config_class, "__dataclass_fields__", {}):
        out["is_decoder"] = True  # an encoder's ForCausalLM: causal only as a decoder
    elif "initializer_range" in out:
        out["initializer_range"] = 0.2
    return out


def _sizes(d: dict) -> dict:
    """SIZES applied to a flat dict (per-layer lists of sizes too); MLA's latent expands to every query head."""
    out = {k: [_size(k, x) for x in v] if isinstance(v, list) else _size(k, v) for k, v in d.items()}
    if "kv_lora_rank" in out and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out.get("num_attention_heads")
    return out


def _size(key: str, value):
    return SIZES[key] if key in SIZES and _is_int(value) and value > SIZES[key] else value


def _sub_class(declared: type, value: dict) -> type:
    if declared is transformers.AutoConfig and value.get("model_type") in CONFIG_MAPPING:
        return CONFIG_MAPPING[value["model_type"]]
    return declared


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cut_layers(d: dict) -> dict:
    """Keep the first layer of each kind (by every per-layer list, per-layer map and layer-index list), at least two,
    at most MAX_LAYERS; per-layer lists keep those entries, maps and index lists are renumbered."""
    counts = [k for k in LAYER_COUNTS if _is_int(d.get(k))]
    if not counts or d[counts[0]] < 2:
        return {}
    n = d[counts[0]]
    lists = [k for k, v in d.items() if isinstance(v, list) and len(v) == n]
    maps = [k for k, v in d.items() if _is_layer_map(v, n)]
    indices = [k for k, v in d.items() if k not in lists and _is_index_list(k, v, n)]
    by_index = {k: {_layer_key(i, n): v for i, v in d[k].items()} for k in maps}
    kinds = [tuple(str(d[k][i]) for k in lists) + tuple(str(by_index[k].get(i)) for k in maps)
             + tuple(i in d[k] for k in indices) for i in range(n)]  # fmt: skip
    first = sorted({kinds.index(kind) for kind in kinds})[:MAX_LAYERS]
    keep = first if len(first) >= 2 else sorted(set(first) | {0, 1})
    out = {k: len(keep) for k in counts}
    out.update({k: [d[k][i] for i in keep] for k in lists})
    out.update({k: {keep.index(i): _sizes(v) for i, v in by_index[k].items() if i in keep} for k in maps})
    out.update({k: [keep.index(i) for i in d[k] if i in keep] for k in indices})
    return out


def _is_layer_map(value, n: int) -> bool:
    """Per-layer overrides keyed by layer index, as Gemma 4's per_layer_config."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(_layer_key(i, n) is not None and isinstance(o, dict) for i, o in value.items())
    )


def _is_index_list(key: str, value, n: int) -> bool:
    """Indices of the layers of one kind, as LFM2's full_attn_idxs."""
    return (isinstance(value, list) and bool(value) and all(_is_int(i) and 0 <= i < n for i in value)
            and key.endswith(("idxs", "indices", "ids", "layers")))  # fmt: skip


def _layer_key(key, n: int) -> int | None:
    """A per-layer map's key as a layer index ("05" in Gemma 4's per_layer_config), None if it is not one."""
    index = key if _is_int(key) else int(key) if isinstance(key, str) and key.isdigit() else None
    return index if index is not None and 0 <= index < n else None


def _token_ids(d: dict) -> dict:
    out = {k: v for k, v in SPECIAL_IDS.items() if k in d}
    if isinstance(d.get("eos_token_id"), list):
        out["eos_token_id"] = [SPECIAL_IDS["eos_token_id"]]
    reserved = [k for k, v in d.items() if k.endswith(("token_id", "token_index")) and k not in SPECIAL_IDS
                and _is_int(v) and v >= 96]  # fmt: skip
    out.update({k: 96 + i for i, k in enumerate(reserved)})
    return out


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build(lm: CausalLM, dtype=torch.float32):
    """The tiny random-weight model of `lm` (seeded), in eval mode; eager attention where logits are soft-capped."""
    torch.manual_seed(0)
    config = tiny_config(lm)
    text = config.get_text_config()
    eager = {"attn_implementation": "eager"} if getattr(text, "attn_logit_softcapping", None) else {}
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **eager).eval()
