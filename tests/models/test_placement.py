"""Models placed by accelerate (a device map, offload, several GPUs): answers equal `model.generate` under the same
placement, the plan reaches each device once per forward, and what cannot be served is refused before any work."""

from __future__ import annotations

import accelerate
import pytest
import torch
import transformers

from hf_parallel import AttentionBackend, generate_tokens
from hf_parallel.attention.reference import ReferenceBackend
from hf_parallel.models.placement import eager_only, execution_devices, loop_device
from hf_parallel.row.layout import build_layout
from hf_parallel.row.plan import AttentionPlan, Row, SlotIds
from tests.helpers.models import random_tokens, tiny_model

NEW = 6
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
BACKENDS = ["reference", pytest.param("triton", marks=CUDA)]


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    doc = random_tokens(24, gen)
    return [doc + random_tokens(n, gen) for n in (1, 4, 7)] + [random_tokens(9, gen)]


def _alone(model, prompt: list[int]) -> list[int]:
    """`model.generate` on `prompt` alone, its inputs where accelerate's root hook runs the model."""
    ids = torch.tensor([prompt], device=loop_device(model))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _check(model, attn: str = "reference", **options) -> None:
    prompts = _prompts()
    want = [_alone(model, p) for p in prompts]
    assert generate_tokens(model, prompts, max_new_tokens=NEW, eos_token_id=[], attn=attn, **options) == want


def _blocks(devices: list) -> dict:
    """A device map of a tiny Llama: embeddings and layer 0 on devices[0], layer 1 and the head on devices[1]."""
    first, last = devices
    return {"model.embed_tokens": first, "model.rotary_emb": first, "model.layers.0": first, "model.layers.1": last,
            "model.norm": last, "lm_head": last}  # fmt: skip


def _saved(tmp_path) -> str:
    path = str(tmp_path / "tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


# -- the plan's copies --


def _plan(backend: AttentionBackend | None = None) -> AttentionPlan:
    backend = backend or ReferenceBackend()
    layout = build_layout(_prompts(), NEW)
    row = Row(layout, SlotIds.from_layout(layout, torch.device("cpu")), layout.num_slots, 2)
    return backend.plan(row, layout.prompt_slots()[0][:8])


def test_plan_is_copied_once_per_device():
    plan = _plan()
    there = [plan.to("meta", non_blocking=True) for _ in range(5)]  # five layers on one other device
    assert all(p is there[0] for p in there) and plan.copies == {torch.device("meta"): there[0]}
    assert there[0].q_slot.is_meta and there[0].ids.slot_seg.is_meta and there[0].kv_len == plan.kv_len
    assert there[0].to("cpu") is plan and there[0].to("meta") is there[0] and plan.to("cpu") is plan
    assert plan.to(None) is plan  # as Tensor.to(None)
    assert plan.copies == {torch.device("meta"): there[0]} and there[0].copies == {}  # a copy keeps none of its own
    assert _plan().to("meta") is not there[0]  # the next forward's plan: its own copy


def test_copy_keeps_its_own_masks_and_tiles():
    plan = _plan()
    plan.mask(None)
    copy = plan.to("meta")
    assert type(copy) is type(plan) and copy.masks == {}  # built on its device when a layer there asks
    pytest.importorskip("triton")
    from hf_parallel.attention.triton import TritonBackend

    triton_plan = _plan(TritonBackend())
    moved = triton_plan.to("meta")
    assert moved.tiles.tile_query.is_meta and moved.tiles.block_m == triton_plan.tiles.block_m
    assert moved.tiles is not triton_plan.tiles and triton_plan.to("meta") is moved


# -- accelerate's hooks on the CPU --


class _Counting(ReferenceBackend):
    """The reference path, recording the plan object every layer of every forward is handed."""

    name = "test_counting_reference"

    def __init__(self):
        self.seen: list[AttentionPlan] = []

    def attention(self, module, query, key, value, attention_mask, pp_plan=None, **kwargs):
        self.seen.append(pp_plan)
        return ReferenceBackend.attention(module, query, key, value, attention_mask, pp_plan=pp_plan, **kwargs)


def test_hooks_on_the_cpu_answer_as_generate(monkeypatch):
    model = accelerate.dispatch_model(tiny_model("llama"), _blocks(["cpu", "cpu"]), force_hooks=True)
    calls = []
    original = AttentionPlan.to
    monkeypatch.setattr(AttentionPlan, "to", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    backend = _Counting()
    _check(model, backend)
    assert calls  # accelerate's hooks did hand the plan through `.to` ...
    layers = model.config.num_hidden_layers
    forwards = [backend.seen[i : i + layers] for i in range(0, len(backend.seen), layers)]
    assert all(plan is f[0] for f in forwards for plan in f)  # ... and every layer of a forward got its one plan
    assert all(a[0] is not b[0] for a, b in zip(forwards, forwards[1:]))


def test_offloaded_layer_answers_as_generate():
    model = tiny_model("llama")
    accelerate.cpu_offload(model.model.layers[1], execution_device="cpu", offload_buffers=True)
    assert model.model.layers[1].self_attn.q_proj.weight.is_meta and eager_only(model)
    _check(model)


def test_disk_offload_answers_as_generate(tmp_path):
    devices = _blocks(["cpu", "disk"])
    model = accelerate.dispatch_model(tiny_model("llama"), devices, offload_dir=str(tmp_path / "offload"))
    assert execution_devices(model) == {torch.device("cpu")}
    _check(model)


# -- refusals, before any work --


@pytest.fixture
def no_probe(monkeypatch):
    """A refusal of the placement must come before the support probe's forwards."""

    def probe(model):
        raise AssertionError("the probe ran")

    monkeypatch.setattr("hf_parallel.frontends.probe.probe_model", probe)


def test_meta_parameters_no_hook_loads_are_refused(no_probe):
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(tiny_model("llama").config).eval()
    with pytest.raises(NotImplementedError, match="meta device"):
        generate_tokens(model, _prompts(), max_new_tokens=NEW)


@pytest.mark.parametrize("split", [
    {"model.layers.0.self_attn.q_proj": "cuda:0", "model.layers.0.self_attn.k_proj": "cpu"},  # the parts alone
    {"model.layers.0": "cuda:0", "model.layers.0.self_attn.k_proj": "cpu"},  # a part apart from its layer
])  # fmt: skip
def test_attention_split_over_devices_is_refused(no_probe, split):
    """As a device map reads (not dispatched: the CPU has one device), so the check alone is tested here."""
    model = tiny_model("llama")
    model.hf_device_map = {k: v for k, v in _blocks(["cpu", "cpu"]).items() if k != "model.layers.0"} | split
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.self_attn runs on cpu, cuda:0"):
        generate_tokens(model, _prompts(), max_new_tokens=NEW)


# -- on a GPU --


@pytest.mark.usefixtures("no_tf32")
@CUDA
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_explicit_map_over_gpu_and_cpu(cuda_graphs):
    """Layer 0 computes on the GPU, layer 1 on the CPU (the main device): the reference path runs on both."""
    model = accelerate.dispatch_model(tiny_model("llama"), _blocks([0, "cpu"]), main_device="cpu")
    assert execution_devices(model) == {torch.device("cuda", 0), torch.device("cpu")}
    _check(model, cuda_graphs=cuda_graphs)


@pytest.mark.usefixtures("no_tf32")
@CUDA
@pytest.mark.parametrize("attn", BACKENDS)
def test_auto_map_with_cpu_offload(tmp_path, attn):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        _saved(tmp_path), device_map="auto", max_memory={0: "250KB", "cpu": "1GiB"}, dtype=torch.float32
    ).eval()
    assert {0, "cpu"} <= set(model.hf_device_map.values()) and eager_only(model)
    _check(model, attn)


@pytest.mark.usefixtures("no_tf32")
@CUDA
@pytest.mark.parametrize("attn", BACKENDS)
def test_offloaded_buffers(attn):
    model = accelerate.dispatch_model(tiny_model("llama"), _blocks([0, "cpu"]), offload_buffers=True)
    assert model.model.layers[1].self_attn.q_proj.weight.is_meta
    _check(model, attn)


@CUDA
def test_attention_split_over_gpu_and_cpu_is_refused():
    devices = {**_blocks([0, "cpu"]), "model.layers.0.self_attn.k_proj": "cpu"}
    model = accelerate.dispatch_model(tiny_model("llama"), devices, main_device="cpu")
    with pytest.raises(NotImplementedError, match="self_attn runs on"):
        generate_tokens(model, _prompts(), max_new_tokens=NEW)


@pytest.mark.usefixtures("no_tf32")
@TWO_GPUS
@pytest.mark.parametrize("attn", ["reference", "triton"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_two_gpus(attn, cuda_graphs):
    model = accelerate.dispatch_model(tiny_model("llama"), _blocks([0, 1]))
    assert eager_only(model)  # graphs asked for: eager steps, no crash
    _check(model, attn, cuda_graphs=cuda_graphs)


@pytest.mark.usefixtures("no_tf32")
@TWO_GPUS
def test_two_gpus_auto_map(tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        _saved(tmp_path), device_map="auto", max_memory={0: "250KB", 1: "1GiB"}, dtype=torch.float32
    ).eval()
    assert {torch.device("cuda", 0), torch.device("cuda", 1)} <= execution_devices(model)
    for attn in ("reference", "triton"):
        _check(model, attn)
