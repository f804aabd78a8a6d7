"""`compile="layers"` (and "auto" where decode steps are captured): the decoder layers' norms and rotary
embedding compiled, one graph per norm class and one for the rotary function that every layer reuses, give
`model.generate`'s tokens and leave the model and its modeling module as they were.

`compile=True`: decode steps through `torch.compile` of the model (the Triton kernel an opaque custom op) give
plain `model.generate`'s tokens, steps of one live-stream count reuse one compiled graph (no per-step
recompilation: the compiled plan spans the whole row), and a call compiles at most three graphs however many
live counts it has (the token count is a dynamic dimension after the first recompilation)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch._dynamo.utils
import transformers
from transformers.models.llama import modeling_llama

from hf_parallel import generate_tokens
from hf_parallel.frontends.probe import check_support
from hf_parallel.models.projections import MOST_ROWS
from tests.helpers.models import ARCHITECTURES, COMMON, generate_alone, random_tokens, tiny_model
from tests.helpers.project import ROOT

ATTNS = ["reference", "triton"]
# a decode step or a layer part that silently fell back to running uncompiled would pass the token checks: make
# it fail
pytestmark = pytest.mark.filterwarnings("error:torch.compile of")


def _compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def llama():
    torch._dynamo.reset()
    # on CUDA where there is one: the Triton kernel runs on the CPU only under TRITON_INTERPRET=1 (the CPU runs')
    yield tiny_model("llama").to("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.reset()


@pytest.mark.parametrize("attn", ATTNS)
def test_compiled_steps_match_generate_and_compile_at_most_three_graphs(llama, attn):
    gen = torch.Generator().manual_seed(3)
    doc = random_tokens(30, gen)
    prompts = [doc + random_tokens(1 + (3 * i) % 5, gen) for i in range(5)]
    free = [generate_alone(llama, p, 9, None) for p in prompts]
    eos = sorted({free[0][2], free[3][5]})  # streams stop at different steps: the live count changes
    before = _compiled_graphs()
    got = generate_tokens(llama, prompts, max_new_tokens=9, eos_token_id=eos, compile=True, attn=attn)
    assert got == [generate_alone(llama, p, 9, eos) for p in prompts]
    live_counts = len({sum(len(g) > step for g in got) for step in range(1, 9)} - {0})
    assert 0 < _compiled_graphs() - before <= min(3, live_counts)  # not one per step, nor one per live count
    before = _compiled_graphs()
    assert generate_tokens(llama, prompts, max_new_tokens=9, eos_token_id=eos, compile=True, attn=attn) == got
    assert _compiled_graphs() == before  # a second call of the same shapes reuses the compiled graphs


def test_compiled_steps_run_the_own_plan(llama):
    """compile=True with `TritonBackend(own_tiles=...)`: the kernel's two plans inside the compiled step (one opaque
    op), `model.generate`'s tokens."""
    from hf_parallel.attention.triton import TritonBackend

    gen = torch.Generator().manual_seed(5)
    doc = random_tokens(30, gen)
    prompts = [doc + random_tokens(1 + (2 * i) % 5, gen) for i in range(4)]
    attn = TritonBackend(own_tiles="overlap")  # on the CPU the two launches run one after the other
    got = generate_tokens(llama, prompts, max_new_tokens=7, eos_token_id=[], compile=True, attn=attn)
    assert got == [generate_alone(llama, p, 7) for p in prompts]


def test_compiled_steps_pass_dynamo_recompile_limit(llama):
    """Every live count runs compiled, past dynamo's recompile limit (default 8, set to 1 here), and five live
    counts compile three graphs: the first count static, one with the token count dynamic, and count 1."""
    gen = torch.Generator().manual_seed(7)  # live counts 6, 4, 3, 2 (streams stop at steps 2 to 6)
    doc = random_tokens(20, gen)
    prompts = [doc + random_tokens(1 + i % 3, gen) for i in range(6)]
    free = [generate_alone(llama, p, 6, None) for p in prompts]
    eos = sorted({free[0][1], free[1][2], free[2][3], free[3][4]})
    before = _compiled_graphs()
    with torch._dynamo.config.patch(recompile_limit=1):
        got = generate_tokens(llama, prompts, max_new_tokens=6, eos_token_id=eos, compile=True)
    assert got == [generate_alone(llama, p, 6, eos) for p in prompts]
    live_counts = len({sum(len(g) > step for g in got) for step in range(1, 6)} - {0})
    assert live_counts >= 4 and _compiled_graphs() - before <= 3


@pytest.mark.slow
def test_compiled_gemma2_softcap_and_window_match_generate():
    model = tiny_model("gemma2")
    gen = torch.Generator().manual_seed(4)
    doc = random_tokens(40, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(3)]
    before = _compiled_graphs()
    got = generate_tokens(model, prompts, max_new_tokens=6, eos_token_id=[], compile=True)
    assert got == [generate_alone(model, p, 6, None) for p in prompts]
    assert _compiled_graphs() > before  # the steps did run compiled


def test_a_failing_compilation_falls_back_with_a_warning(llama, monkeypatch):
    def broken(model):
        def call(**kwargs):
            raise RuntimeError("backend unavailable")

        return call

    monkeypatch.setattr("hf_parallel.runner.model_runner.compiled_call", broken)
    gen = torch.Generator().manual_seed(5)
    prompts = [random_tokens(12, gen) for _ in range(3)]
    with pytest.warns(UserWarning, match="torch.compile of the decode step failed"):
        got = generate_tokens(llama, prompts, max_new_tokens=5, eos_token_id=[], compile=True)
    assert got == [generate_alone(llama, p, 5, None) for p in prompts]


def _own_forwards(model) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


def test_layer_parts_match_generate_and_compile_once_for_every_layer():
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 4}, intermediate_size=128,
                                      num_key_value_heads=2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    parts = check_support(model).fusable
    norms = [p for p in parts if not p.startswith("fn:")]
    assert len(norms) == 8 and {type(model.get_submodule(p)).__name__ for p in norms} == {"LlamaRMSNorm"}
    assert parts[8:] == ["fn:transformers.models.llama.modeling_llama.apply_rotary_pos_emb"]
    rotary = modeling_llama.apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(2)
    doc = random_tokens(24, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(4)]
    before = _compiled_graphs()
    got = generate_tokens(model, prompts, max_new_tokens=6, eos_token_id=[], compile="layers")
    assert got == [generate_alone(model, p, 6, None) for p in prompts]
    assert _compiled_graphs() - before == 2  # one for the norm class and one for the rotary function, not per layer
    assert _own_forwards(model) == []  # the compiled forwards were the call's only
    assert modeling_llama.apply_rotary_pos_emb is rotary  # and the function is the module's own again
    before = _compiled_graphs()
    generate_tokens(model, prompts, max_new_tokens=6, eos_token_id=[], compile="layers")
    assert _compiled_graphs() == before


def test_a_wide_prefill_chunk_and_the_steps_share_the_rotary_graph():
    """A prefill chunk wider than `projections.MOST_ROWS` and the decode steps hand the rotary function q and k of
    one stride pattern (where a GPU groups the projections, column slices of one output), so a call compiles one
    graph for the norm class and one for the rotary function, not a second for other strides."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**COMMON, "max_position_embeddings": 512}, intermediate_size=128,
                                      num_key_value_heads=2)  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(device)  # q, k and v with biases
    gen = torch.Generator().manual_seed(8)
    doc = random_tokens(MOST_ROWS + 40, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(3)]
    before = _compiled_graphs()
    got = generate_tokens(model, prompts, max_new_tokens=4, eos_token_id=[], compile="layers")
    assert got == [generate_alone(model, p, 4, None) for p in prompts]
    assert _compiled_graphs() - before == 2


def test_a_compiling_call_imports_the_compiler_beside_its_support_probe():
    """In a process that has not imported Inductor's compiler (about a second of Python), a call that will compile
    starts importing it on a thread before its support probe, whose first forward on a GPU runs mostly without
    Python's lock, and waits for it before compiling."""
    code = textwrap.dedent("""
        import sys
        from hf_parallel import generate_tokens
        from hf_parallel.frontends import probe
        from hf_parallel.models import compiled_parts
        from tests.helpers.models import tiny_model
        assert compiled_parts.COMPILER not in sys.modules
        seen, probe_model = [], probe.probe_model
        probe.probe_model = lambda model: seen.append([t.name for t in compiled_parts.importing]) or probe_model(model)
        got = generate_tokens(tiny_model("llama"), [[5, 6, 7], [5, 6, 8]], max_new_tokens=2, compile="layers")
        assert seen == [["hf_parallel-import"]], seen
        assert compiled_parts.COMPILER in sys.modules and not compiled_parts.importing[0].is_alive()
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize(("compile", "cuda_graphs", "device", "eager_only", "recurrent", "want"), [
    ("auto", True, "cuda", False, False, True),  # captured steps: the layers' parts compiled
    ("auto", False, "cuda", False, False, False),  # eager steps: nothing compiled
    ("auto", True, "cuda", True, False, False),  # over several devices, offloaded or sharded: eager steps
    ("auto", True, "cuda", False, True, False),  # recurrent layers: eager steps
    ("auto", True, "cpu", False, False, False),
    ("layers", False, "cpu", False, False, True),
    ("layers", True, "cuda", False, True, False),
    (True, False, "cpu", False, False, True),
    (True, True, "cuda", False, True, False),  # compile=True is not applied to recurrent layers
    (False, True, "cuda", False, False, False),
])  # fmt: skip
def test_a_call_imports_the_compiler_only_where_its_runner_compiles(compile, cuda_graphs, device, eager_only,
                                                                    recurrent, want):  # fmt: skip
    """`Generation.prepare` starts the compiler's import by the rule the model runner compiles by
    (`model_runner.compiles`): not for a call whose rounds run eagerly with compile="auto" (cuda_graphs off, a
    model over several devices)."""
    from hf_parallel.decoding.options import GenerationOptions
    from hf_parallel.runner.model_runner import compiles

    opts = GenerationOptions.resolve(tiny_model("llama"), compile=compile, cuda_graphs=cuda_graphs)
    assert compiles(opts, torch.device(device), eager_only, recurrent) == want


def test_layer_parts_keep_the_model_widths_static_and_the_token_count_dynamic():
    """Only the token count is a dynamic dimension of the compiled parts' graphs (`compiled_parts.token_dims`): calls
    with other counts reuse them, and a model of the same hidden size with other head counts and head size gets
    graphs of its own (widths static: Inductor's kernels index with constants, 1.5-4x faster on the H200)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = dict(COMMON, intermediate_size=128)
    wide = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, num_key_value_heads=2)).eval()
    narrow = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, "num_attention_heads": 8},
                                                                    num_key_value_heads=8)).eval()  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    doc = random_tokens(20, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(6)]
    generate_tokens(wide, prompts[:3], max_new_tokens=4, eos_token_id=[], compile="layers")
    before = _compiled_graphs()
    generate_tokens(wide, prompts, max_new_tokens=5, eos_token_id=[], compile="layers")  # other token counts
    assert _compiled_graphs() == before
    got = generate_tokens(narrow, prompts, max_new_tokens=5, eos_token_id=[], compile="layers")
    assert got == [generate_alone(narrow, p, 5, None) for p in prompts]
    assert _compiled_graphs() > before  # the rotary function again, for 8 heads of 8


def test_the_token_dims_follow_transformers_layouts():
    """`compiled_parts.token_dims`: the token count's dim of a norm's input [B, N, ...] and of the rotary function's q
    and k ([B, H, N, D], or [B, N, H, D] where it unsqueezes cos and sin at 2) and cos and sin [B, N, D]; nothing for
    inputs it cannot place."""
    from hf_parallel.models.compiled_parts import token_dims

    hidden, heads = torch.zeros(1, 7, 16), torch.zeros(1, 7, 4, 8)
    q, k, cos = torch.zeros(1, 4, 7, 8), torch.zeros(1, 2, 7, 8), torch.zeros(1, 7, 8)
    dims = lambda found: [(t.shape, d) for t, d in found]  # noqa: E731
    assert dims(token_dims(False, (hidden,), {})) == [(hidden.shape, 1)]
    assert dims(token_dims(False, (heads,), {})) == [(heads.shape, 1)]  # a per-head norm (Qwen3's q_norm)
    assert dims(token_dims(True, (q, k, cos, cos), {})) == [(q.shape, 2), (k.shape, 2), (cos.shape, 1), (cos.shape, 1)]
    assert [d for _, d in token_dims(True, (heads, heads, cos, cos), {"unsqueeze_dim": 2})] == [1, 1, 1, 1]
    assert token_dims(False, (torch.tensor(1.0),), {}) == [] and token_dims(True, (q, k), {}) == []


def test_a_rotary_function_given_a_hub_kernel_is_left_alone(monkeypatch):
    """Where `kernels` is installed the rotary function is its module: fused while it runs as written, left alone
    once `kernelize` gives it (or an attention module's copy) a forward of its own."""
    rotary = modeling_llama.apply_rotary_pos_emb
    if not isinstance(rotary, torch.nn.Module):
        pytest.skip("kernels is not installed: the rotary function is a plain function (the other tests' case)")
    config = transformers.LlamaConfig(**COMMON, intermediate_size=128, num_key_value_heads=2)
    fused_rotary = lambda model: [p for p in check_support(model).fusable if p.startswith("fn:")]  # noqa: E731
    assert fused_rotary(transformers.AutoModelForCausalLM.from_config(config).eval()) != []
    kernel = lambda module: types.MethodType(type(module).forward, module)  # noqa: E731
    monkeypatch.setattr(rotary, "forward", kernel(rotary), raising=False)  # a forward of its own, as kernelize sets
    assert fused_rotary(transformers.AutoModelForCausalLM.from_config(config).eval()) == []
    monkeypatch.delattr(rotary, "forward")
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    (copy,) = model.model.layers[0].self_attn._kernel_funcs.values()  # the layer's own copy, for kernelize
    monkeypatch.setattr(copy, "forward", kernel(copy), raising=False)
    assert fused_rotary(model) == []


def test_auto_fuses_only_where_steps_are_captured(llama):
    """The default, compile="auto": on the CPU (eager steps) nothing compiles; on CUDA the layer parts do."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(6)
    prompts = [random_tokens(10, gen) for _ in range(3)]
    before = _compiled_graphs()
    got = generate_tokens(llama, prompts, max_new_tokens=4, eos_token_id=[])
    assert got == [generate_alone(llama, p, 4, None) for p in prompts]
    assert (_compiled_graphs() > before) == (llama.device.type == "cuda")
    before = _compiled_graphs()
    generate_tokens(llama, prompts, max_new_tokens=4, eos_token_id=[], compile=False)
    assert _compiled_graphs() == before and _own_forwards(llama) == []


def test_a_mixture_of_experts_is_left_uncompiled():
    """gpt-oss: its norms and rotary embedding fuse; its experts (tokens routed by value) and its sinks' attention
    run as they are."""
    model = tiny_model("gpt_oss")
    parts = check_support(model).fusable
    assert parts and all(p.endswith(("layernorm", "apply_rotary_pos_emb")) for p in parts)
    gen = torch.Generator().manual_seed(8)
    doc = random_tokens(20, gen)
    prompts = [doc + random_tokens(3, gen) for _ in range(3)]
    got = generate_tokens(model, prompts, max_new_tokens=5, eos_token_id=[], compile="layers")
    assert got == [generate_alone(model, p, 5, None) for p in prompts]


def test_a_compile_value_not_known_is_refused(llama):
    with pytest.raises(TypeError, match="compile must be True, False, 'auto' or 'layers'"):
        generate_tokens(llama, [[5, 6, 7]], max_new_tokens=2, compile="fast")


def test_a_layer_part_whose_compilation_fails_runs_as_it_is(llama, monkeypatch):
    from hf_parallel.models import compiled_parts

    def broken(module, *args, **kwargs):
        raise RuntimeError("backend unavailable")

    parts = check_support(llama).fusable
    classes = {type(llama.get_submodule(p)) for p in parts if not p.startswith("fn:")}
    classes.add(modeling_llama.apply_rotary_pos_emb)  # the rotary function: keyed by itself
    monkeypatch.setattr(compiled_parts.CompiledPart, "compiled", dict.fromkeys([(c, False) for c in classes], broken))
    monkeypatch.setattr(compiled_parts.CompiledPart, "failed", set())
    gen = torch.Generator().manual_seed(9)
    prompts = [random_tokens(12, gen) for _ in range(3)]
    with pytest.warns(UserWarning, match="torch.compile of .* failed") as record:
        got = generate_tokens(llama, prompts, max_new_tokens=5, eos_token_id=[], compile="layers")
    warned = sorted(str(w.message).split()[2] for w in record)
    assert warned == ["LlamaRMSNorm", "apply_rotary_pos_emb"]  # once each
    assert got == [generate_alone(llama, p, 5, None) for p in prompts]
    assert compiled_parts.CompiledPart.failed == classes and _own_forwards(llama) == []


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_family_with_its_layer_parts_compiled_matches_generate(arch):
    """What the default does on CUDA, on each architecture's tiny model: its own norm classes compiled (Gemma's
    1 + weight, GPT-2's LayerNorm), the answers unchanged."""
    model = tiny_model(arch)
    support = check_support(model)
    if support.recurrent:
        pytest.skip("layers with a recurrent state run uncompiled")
    gen = torch.Generator().manual_seed(1)
    doc = random_tokens(24, gen)
    prompts = [doc + random_tokens(2 + i, gen) for i in range(3)]
    got = generate_tokens(model, prompts, max_new_tokens=5, eos_token_id=[], compile="layers")
    assert got == [generate_alone(model, p, 5, None) for p in prompts]
    assert support.fusable and _own_forwards(model) == []
