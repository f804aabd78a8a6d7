"""Sibling projections (q|k|v) as one GEMM: the model's outputs, parameters and saved weights stay what
they were, each member called on its own gets its own output, weights replaced after grouping are grouped again,
and on a GPU a call's answers stay `model.generate`'s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.overrides import TorchFunctionMode

from hf_parallel import generate_tokens
from hf_parallel.models.projections import MOST_ROWS, grouped, sibling_groups
from tests.helpers.models import generate_alone, random_tokens, tiny_model

# fp32 on the CPU: a member's rows of the wider GEMM may be summed in another order than its own GEMM's
TOLERANCE = 1e-5


class _Linears(TorchFunctionMode):
    """Counts the block's GEMMs (`F.linear`, `torch.mm` and `torch.addmm` calls)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in (F.linear, torch.mm, torch.addmm)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q, k and v with biases
def test_grouped_forward_is_the_plain_forward_with_fewer_gemms(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, model.config.vocab_size, (1, 12))
    with torch.no_grad(), _Linears() as plain:
        want = model(ids).logits
    with torch.no_grad(), grouped(model), _Linears() as linears:
        got = model(ids).logits
    layers = model.config.num_hidden_layers
    assert plain.count == layers * 7 + 1  # q, k, v, o, gate, up, down a layer; lm_head
    assert linears.count == layers * 5 + 1  # q|k|v, o, gate, up, down
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_wide_input_runs_each_members_own_gemm_into_one_output(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, model.config.vocab_size, (1, MOST_ROWS + 1))
    with torch.no_grad(), _Linears() as plain:
        want = model(ids).logits
    with torch.no_grad(), grouped(model), _Linears() as linears:
        got = model(ids).logits
    assert linears.count == plain.count == model.config.num_hidden_layers * 7 + 1
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("rows", [5, MOST_ROWS + 1])
def test_members_outputs_are_strided_as_one_output_at_any_width(rows):
    """Wide or narrow, q, k and v are column slices of one output (so a compiled rotary embedding sees one stride
    pattern and compiles once), each equal to the member's own GEMM."""
    model = tiny_model("qwen2")
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, rows, model.config.hidden_size)
    members = attn.q_proj, attn.k_proj, attn.v_proj
    width = sum(m.out_features for m in members)
    with torch.no_grad(), grouped(model):
        got = [m(x) for m in members]
    for m, out in zip(members, got):
        assert out.stride() == (rows * width, width, 1)
        torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), atol=TOLERANCE, rtol=TOLERANCE)
    assert got[1].data_ptr() - got[0].data_ptr() == attn.q_proj.out_features * x.element_size()


def test_parameters_keep_their_objects_values_and_names():
    model = tiny_model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    params = dict(model.named_parameters())
    with grouped(model):
        attn = model.model.layers[0].self_attn
        assert "forward" in vars(attn.q_proj)
    assert dict(model.named_parameters()) == params  # the same objects
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], atol=0, rtol=0)
    assert not any("forward" in vars(m) for m in model.modules())
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.storage_offset() == q.numel() and v.storage_offset() == q.numel() + k.numel()


def test_save_pretrained_after_grouping_reloads_the_same_weights(tmp_path):
    model = tiny_model("qwen2")
    with grouped(model):
        pass
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, p), (_, r) in zip(model.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(r, p, atol=0, rtol=0, msg=name)


def test_a_member_gets_its_own_output_in_any_order():
    model = tiny_model("qwen2")
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(1, 5, model.config.hidden_size), torch.randn(1, 5, model.config.hidden_size)

    def own(m, t):
        return F.linear(t, m.weight, m.bias)

    with torch.no_grad(), grouped(model):
        got = [attn.k_proj(x), attn.q_proj(y), attn.q_proj(y), attn.v_proj(x), attn.k_proj(x), attn.v_proj(y)]
        want = [own(attn.k_proj, x), own(attn.q_proj, y), own(attn.q_proj, y), own(attn.v_proj, x),
                own(attn.k_proj, x), own(attn.v_proj, y)]  # fmt: skip
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=TOLERANCE, rtol=TOLERANCE)


def test_weights_replaced_after_grouping_are_grouped_again():
    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn
    with grouped(model):
        pass
    attn.k_proj.weight = nn.Parameter(torch.randn_like(attn.k_proj.weight))  # a new tensor, not a slice
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.no_grad(), grouped(model):
        got = attn.q_proj(x), attn.k_proj(x)
    torch.testing.assert_close(got[1], x @ attn.k_proj.weight.T, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(got[0], x @ attn.q_proj.weight.T, atol=TOLERANCE, rtol=TOLERANCE)


def test_only_plain_unshared_linears_are_grouped():
    model = tiny_model("llama")
    layers = model.model.layers
    layers[0].self_attn.k_proj.register_forward_hook(lambda *args: None)  # a hook's module runs as it is
    layers[1].self_attn.v_proj.weight = layers[1].self_attn.k_proj.weight  # a shared weight
    assert [(parent, names) for parent, names in sibling_groups(model)] == []
    fresh = tiny_model("llama")
    assert [parent for parent, _ in sibling_groups(fresh)] == [m.self_attn for m in fresh.model.layers]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sibling projections are grouped where a GPU runs the model")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])  # phi3: q|k|v already one module
def test_a_gpu_call_groups_its_projections_and_answers_as_generate(arch):
    model = tiny_model(arch).to("cuda")
    gen = torch.Generator().manual_seed(3)
    doc = random_tokens(40, gen)
    prompts = [doc + random_tokens(3 + i, gen) for i in range(5)]
    got = generate_tokens(model, prompts, max_new_tokens=8, eos_token_id=[])
    assert got == [generate_alone(model, p, 8) for p in prompts]
    attn = model.model.layers[0].self_attn
    if arch != "phi3":
        assert attn.k_proj.weight.storage_offset() == attn.q_proj.weight.numel()  # grouped by the call
