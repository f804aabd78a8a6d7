"""`hf_parallel.compat`: each contact with transformers' or lm-eval's internals holds as it assumes (on tiny
random-weight models, nothing downloaded), and the compiled rotary embedding of one model reaches no other model
of its family, on another thread.  That no other module of hf_parallel touches those internals is
tests/library/test_architecture.py's check."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import transformers
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc
from transformers.models.llama import modeling_llama

from hf_parallel import generate_tokens
from hf_parallel.compat import transformers_internals as ti
from hf_parallel.compat import transformers_names as tn
from tests.helpers.models import ARCHITECTURES, COMMON, generate_alone, random_tokens, tiny_model
from tests.helpers.project import ROOT

pytestmark = pytest.mark.compat  # .ci/run runs these on the oldest supported transformers too

PACKAGE = ROOT / "hf_parallel"
HYBRIDS = ["qwen3_5_text", "qwen3_next", "falcon_h1", "bamba", "jamba", "zamba2", "lfm2", "nemotron_h", "minimax"]


def llama_model(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**COMMON, intermediate_size=128, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval()


# --------------------------------------------------------------------------- (a) each contact, as assumed


def test_the_attention_implementation_is_read_as_set():
    model = llama_model()
    for name in ("eager", "sdpa"):
        model.set_attn_implementation(name)
        assert ti.attention_implementation(model.config) == name, (
            "transformers no longer keeps the implementation set_attn_implementation sets in "
            "config._attn_implementation"
        )
    previous = ti.attention_implementations(model.config)
    model.set_attn_implementation("eager")
    model.set_attn_implementation(previous)
    assert ti.attention_implementation(model.config) == "sdpa"


def test_a_composite_configs_implementations_are_read_per_sub_config():
    """`sub_configs` names the sub-configs, each with its own `_attn_implementation`, which
    `set_attn_implementation` takes back as a dict."""
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**COMMON, intermediate_size=128, num_key_value_heads=2),
        vision_config=transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=32, patch_size=16),
    )  # fmt: skip
    assert set(config.sub_configs) >= {"text_config", "vision_config"}, "PretrainedConfig.sub_configs changed"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "sdpa"
    got = ti.attention_implementations(config)
    assert isinstance(got, dict) and got["text_config"] == "eager" and got["vision_config"] == "sdpa", got


def test_an_attention_name_without_a_mask_function_gets_no_mask():
    """A name registered with AttentionInterface alone: `create_causal_mask` builds no mask and every layer's
    attention function is handed attention_mask=None (an "eager" model gets a mask: the check can fail)."""
    from transformers import masking_utils

    masks = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return transformers.integrations.sdpa_attention.sdpa_attention_forward(
            module, query, key, value, None, is_causal=True, **kwargs
        )

    ti.register_attention("hf_parallel_compat_test", recording)
    model = llama_model()
    ids = torch.tensor([[5, 6, 7, 8]])
    model.set_attn_implementation("hf_parallel_compat_test")
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids))
    assert len(masks) == COMMON["num_hidden_layers"] and all(m is None for m in masks), (
        "a model routed through an attention name with no mask function was handed a mask of its own"
    )
    embeds = torch.zeros(1, 4, COMMON["hidden_size"])
    mask = torch.ones(1, 4, dtype=torch.long)
    position_ids = torch.arange(4)[None]
    assert masking_utils.create_causal_mask(model.config, embeds, mask, None, position_ids) is None
    model.set_attn_implementation("eager")
    assert masking_utils.create_causal_mask(model.config, embeds, mask, None, position_ids) is not None


@pytest.mark.parametrize(("arch", "want"), [("llama", set()), ("mistral", {0, 1}), ("gpt_oss", {0}), ("gemma2", {0})])
def test_sliding_window_layers_are_found_in_transformers_own_cache(arch, want):
    """Mistral windows every layer, gpt-oss and Gemma 2 their "sliding_attention" layers (the first here)."""
    config = tiny_model(arch).config.get_text_config()
    got = ti.sliding_window_layers(config)
    assert got == want, (
        f"DynamicCache(config=...) for {arch} no longer names its sliding-window layers' class *Sliding*: "
        f"{[type(layer).__name__ for layer in DynamicCache(config=config).layers]}"
    )


def _layers_holding_a_state(model) -> set[int]:
    """Layers whose recurrent state the model's own forward kept in its own cache: linear-attention cache layers
    with a state set, or (MiniMax's cache) a linear cache tensor."""
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 7, 8]]), use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
    held = set()
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            flags = (layer.is_conv_states_initialized, layer.is_recurrent_states_initialized, layer.has_previous_state)
            if any(v for flag in flags for v in flag.values()):
                held.add(i)
        try:
            linear = cache.get_linear_cache(i) if hasattr(cache, "get_linear_cache") else None
        except IndexError:  # MiniMax's cache lists linear states up to the last layer that has one
            linear = None
        if isinstance(linear, torch.Tensor):
            held.add(i)
    return held


@pytest.mark.parametrize("arch", HYBRIDS)
def test_recurrent_mixers_are_the_layers_whose_state_the_model_caches(arch):
    """The layers found by class name are exactly those whose forward keeps a recurrent state in the cache."""
    model = tiny_model(arch)
    found = {m.layer_idx for m in model.modules() if tn.is_recurrent_mixer(m)}
    held = _layers_holding_a_state(model)
    names = sorted({type(m).__name__ for m in model.modules()})
    assert found and found == held, f"{arch}: mixers by class name {found}, states in the cache {held} ({names})"


@pytest.mark.parametrize("arch", ["llama", "stablelm", "nemotron"])
def test_attention_modules_are_found_by_class_name(arch):
    model = tiny_model(arch)
    found = [m for m in model.modules() if tn.is_attention_layer(m)]
    want = [layer.self_attn for layer in model.model.layers]
    assert found == want, f"{arch}: attention modules by class name {[type(m).__name__ for m in found]}"
    assert not any(tn.is_recurrent_mixer(m) for m in model.modules())


def test_a_models_own_cache_class_is_found_in_its_modeling_module():
    from transformers.models.minimax import modeling_minimax

    own = ti.own_cache_class(tiny_model("minimax"))
    assert own is modeling_minimax.MiniMaxCache and issubclass(own, Cache), own
    assert ti.own_cache_class(llama_model()) is None


def test_the_recurrent_state_layer_is_read_as_transformers_reads_it():
    """`RecurrentStateLayer.set_states` sets what transformers' own `update_conv_state` and
    `update_recurrent_state` read: a state set is continued, none set starts a fresh sequence."""
    assert issubclass(ti.RecurrentStateLayer, LinearAttentionLayer)
    layer = ti.RecurrentStateLayer(2)
    assert layer.state_count == 2
    conv, rec = torch.randn(1, 8, 4), torch.randn(1, 2, 4, 4)
    layer.set_states({0: conv}, {0: rec})
    new, before = torch.randn(1, 8, 1), conv.clone()  # the layer keeps the last 4 in place
    full = layer.update_conv_state(new, 0)
    assert torch.equal(full, torch.cat([before, new], dim=-1)), "update_conv_state did not continue the state set"
    assert torch.equal(layer.states()[0][0], full[..., 1:])
    assert torch.equal(layer.states()[1][0], rec) and layer.states()[1][1] is None
    layer.set_states(None, None)
    fresh = torch.randn(1, 8, 2)
    got = layer.update_conv_state(fresh, 0, conv_kernel_size=4)
    assert torch.equal(got[..., -2:], fresh) and not got[..., :-2].any(), "a fresh sequence did not start afresh"
    state = torch.randn(1, 2, 4, 4)
    assert layer.linear_state(1) is None
    layer.set_linear_state(1, state)
    assert layer.linear_state(1) is state and layer.has_previous_state[1]


def test_the_rotary_function_is_the_modeling_modules_global():
    assert ti.rotary_function(modeling_llama.LlamaAttention) is modeling_llama.apply_rotary_pos_emb, (
        "LlamaAttention.forward no longer calls its modeling module's apply_rotary_pos_emb"
    )
    assert ti.rotary_function(modeling_llama.LlamaMLP) is None
    assert ti.runs_as_written(modeling_llama.apply_rotary_pos_emb, [])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_familys_attention_forward_can_be_rebuilt_over_its_rotary(arch):
    """Where a family's attention calls its modeling module's rotary function, its forward (under whatever
    decorators that version puts on it) can be rebuilt to call another: the compiled rotary is never skipped."""
    model = tiny_model(arch)
    classes = {type(m) for m in model.modules() if ti.rotary_function(type(m)) is not None}
    if arch == "gpt2":
        assert not classes  # learned positions: no rotary function
    else:
        assert classes, f"{arch}: no module calls {ti.ROTARY}"
    for cls in classes:
        assert ti.forward_with_global(cls, ti.ROTARY, None) is not None, f"{cls.__name__}.forward cannot be rebuilt"


def _layer_outputs(model, ids):
    outputs = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return outputs[0]


def test_a_forward_with_another_global_runs_it_on_one_instance_alone():
    """`forward_with_global` rebuilds the attention forward (under its decorators) to read another rotary
    function; `set_forward` gives it to one module alone and takes it back exactly."""
    model, other = llama_model(0), llama_model(1)
    attention = model.model.layers[0].self_attn
    cls = type(attention)
    rotary = modeling_llama.apply_rotary_pos_emb
    calls = []

    def recording(*args, **kwargs):
        calls.append(args[0].shape)
        return rotary(*args, **kwargs)

    ids = torch.tensor([[5, 6, 7, 8]])
    want = _layer_outputs(model, ids)
    forward = ti.forward_with_global(cls, ti.ROTARY, recording)
    assert forward is not None, "LlamaAttention.forward (or a decorator around it) could not be rebuilt"
    undo = ti.set_forward(attention, forward)
    assert undo is not None
    assert torch.equal(_layer_outputs(model, ids), want) and len(calls) == 1, "the rebuilt forward was not run"
    _layer_outputs(other, ids)
    assert len(calls) == 1, "another instance of the class ran the rebuilt forward"
    assert modeling_llama.apply_rotary_pos_emb is rotary
    assert cls.forward is type(other.model.layers[0].self_attn).forward
    assert ti.set_forward(attention, forward) is None  # a forward of its own already: left alone
    undo()
    assert "forward" not in vars(attention)
    _layer_outputs(model, ids)
    assert len(calls) == 1


def test_a_forward_with_another_global_goes_under_an_accelerate_hook():
    """A module whose forward is accelerate's hook: the hook's `_old_forward` is swapped, and put back."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = llama_model()
    attention = model.model.layers[0].self_attn
    add_hook_to_module(attention, ModelHook())
    hooked, held = vars(attention)["forward"], vars(attention)["_old_forward"]
    calls = []
    rotary = modeling_llama.apply_rotary_pos_emb
    forward = ti.forward_with_global(type(attention), ti.ROTARY, lambda *a, **k: calls.append(1) or rotary(*a, **k))
    undo = ti.set_forward(attention, forward)
    assert undo is not None
    _layer_outputs(model, torch.tensor([[5, 6, 7]]))
    assert calls == [1], "accelerate's hook no longer calls the module's _old_forward"
    undo()
    assert vars(attention)["forward"] is hooked and vars(attention)["_old_forward"] is held


@pytest.mark.parametrize(
    ("processor", "limit"),
    [
        (lambda: lp.MinLengthLogitsProcessor(min_length=7, eos_token_id=2), 7),
        (lambda: lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=3, eos_token_id=2), 5),
        (lambda: lp.SuppressTokensAtBeginLogitsProcessor(begin_suppress_tokens=[1], begin_index=4), 4),
        (lambda: lp.ExponentialDecayLengthPenalty((3, 1.5), eos_token_id=2, input_ids_seq_length=5), 8),
        (lambda: lp.ForcedEOSTokenLogitsProcessor(max_length=9, eos_token_id=2), 9),
        (lambda: sc.MaxLengthCriteria(max_length=9), 9),
    ],
)
def test_length_limits_are_read_where_each_class_keeps_them(processor, limit):
    """Each class in LENGTH_LIMIT keeps its absolute length limit under the attribute named there."""
    made = processor()
    assert type(made) in ti.LENGTH_LIMIT
    assert ti.length_limit(made) == limit, f"{type(made).__name__} keeps its length limit elsewhere"


def test_a_length_limit_is_where_the_behaviour_changes():
    """MinLength: EOS banned below its limit, free from it; SuppressTokensAtBegin: suppressed at its index only."""
    scores = torch.zeros(1, 8)
    processor = lp.MinLengthLogitsProcessor(min_length=4, eos_token_id=2)
    n = ti.length_limit(processor)
    assert processor(torch.ones(1, n - 1, dtype=torch.long), scores.clone())[0, 2] == float("-inf")
    assert processor(torch.ones(1, n, dtype=torch.long), scores.clone())[0, 2] == 0
    begin = lp.SuppressTokensAtBeginLogitsProcessor(begin_suppress_tokens=[1], begin_index=3)
    n = ti.length_limit(begin)
    assert begin(torch.ones(1, n, dtype=torch.long), scores.clone())[0, 1] == float("-inf")
    assert begin(torch.ones(1, n + 1, dtype=torch.long), scores.clone())[0, 1] == 0


def test_ngram_size_and_eos_ids_are_read_as_kept():
    assert ti.banned_ngram_size(lp.NoRepeatNGramLogitsProcessor(3)) == 3
    assert ti.eos_token_ids(sc.EosTokenCriteria(eos_token_id=[2, 5])) == [2, 5]
    assert ti.eos_token_ids(sc.EosTokenCriteria(eos_token_id=7)) == [7]


def test_lm_evals_pair_encoding_splits_as_assumed():
    """`TemplateLM._encode_pair`: the context's trailing spaces moved to the continuation, the whole encoded at
    once and split where the context's own encoding ends."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.model import TemplateLM

    from hf_parallel.compat.lm_eval_internals import encode_pair

    vocab: dict[str, int] = {}

    class Words(TemplateLM):
        eot_token_id = 0

        def tok_encode(self, string, **kwargs):  # words with their leading space, as BPE tokenizers split them
            return [vocab.setdefault(w, len(vocab) + 1) for w in re.findall(r" ?\S+| +$", string)]

    Words.__abstractmethods__ = frozenset()
    lm = Words()
    context, continuation = encode_pair(lm, "Question: yes ", "no")
    assert context == lm.tok_encode("Question: yes") and continuation == lm.tok_encode(" no"), (context, continuation)


def test_the_method_is_added_where_transformers_defines_pretrained_model():
    """`method_on_import`: `transformers.modeling_utils` defines `PreTrainedModel`; a process that imports
    hf_parallel before transformers finds `generate_parallel` on every model class."""
    from hf_parallel.compat.method_on_import import MODELING

    assert sys.modules[MODELING].PreTrainedModel is transformers.PreTrainedModel
    code = textwrap.dedent("""
        import sys
        import hf_parallel
        assert "transformers" not in sys.modules
        import transformers
        assert transformers.LlamaForCausalLM.generate_parallel.__name__ == "_generate_parallel_method"
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# --------------------------------------------------------------------------- (c) the compiled rotary, one model only


def _own_forwards(model) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


def test_two_models_of_one_family_on_two_threads_each_run_their_own_rotary(monkeypatch):
    """One model runs with its layers' parts compiled (the compiled functions stood in for by recording eager ones,
    so nothing compiles), another model of its family generates on another thread meanwhile: only the first model's
    thread calls the swapped rotary function, and each model answers as `model.generate` does."""
    from hf_parallel.frontends.probe import check_support
    from hf_parallel.models.compiled_parts import CompiledPart, fused

    first, second = llama_model(0), llama_model(1)
    gen = torch.Generator().manual_seed(3)
    doc = random_tokens(16, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(3)]
    want = {m: [generate_alone(m, p, 5, None) for p in prompts] for m in (first, second)}
    parts = check_support(first).fusable
    check_support(second)
    rotary = modeling_llama.apply_rotary_pos_emb
    assert f"fn:{modeling_llama.__name__}.{ti.ROTARY}" in parts
    callers = []

    def swapped_rotary(*args, **kwargs):
        callers.append(threading.get_ident())
        return rotary(*args, **kwargs)

    def eager_norm(module, *args, **kwargs):
        return type(module).forward(module, *args, **kwargs)

    norm = type(first.model.norm)
    monkeypatch.setattr(CompiledPart, "compiled", {(rotary, False): swapped_rotary, (norm, False): eager_norm})
    monkeypatch.setattr(CompiledPart, "failed", set())
    swapped, second_done, got, errors = threading.Event(), threading.Event(), {}, []

    def run_first():
        try:
            with fused(first, parts):
                swapped.set()
                second_done.wait(timeout=300)
                got["first"] = generate_tokens(first, prompts, max_new_tokens=5, eos_token_id=[], compile="layers")
                got["first thread"] = threading.get_ident()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            swapped.set()

    def run_second():
        try:
            swapped.wait(timeout=300)
            got["second"] = generate_tokens(second, prompts, max_new_tokens=5, eos_token_id=[])
            got["second alone"] = [generate_alone(second, p, 5, None) for p in prompts]
            got["second thread"] = threading.get_ident()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            second_done.set()

    threads = [threading.Thread(target=run_first), threading.Thread(target=run_second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert got["second thread"] not in callers, (
        "the second model, generating on its own thread, ran the first model's swapped rotary function"
    )
    assert callers and set(callers) == {got["first thread"]}, "the first model did not run its swapped rotary"
    assert got["first"] == want[first]
    assert got["second"] == got["second alone"] == want[second]
    assert _own_forwards(first) == [] and _own_forwards(second) == []
    assert modeling_llama.apply_rotary_pos_emb is rotary
