"""Which models the packed row serves, decided by what a model does, not by a class flag.

Static checks refuse what no forward can fix (encoder-decoders, no `position_ids`).  Then a
probe forward of two tokens runs through a recording attention backend: every layer that
writes K/V to the cache must route its attention through transformers' AttentionInterface
(so the stream mask applies), and each attention module must receive the plan.  A module
whose decoder layer drops the attention kwargs (Nemotron, StableLM) gets the plan from the
cache by a forward pre-hook instead.  Layers with a recurrent state are found by class and
run per segment (`hf_parallel.recurrent`).  The verdict is kept per model.

Refusals raise NotImplementedError with one of `REASONS` in the message.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from .attention import AttentionBackend, AttentionCall, use_attention
from .attention.reference import ReferenceBackend
from .cache import PackedCache, PackedLayer
from .fusion import fusable_parts, fused
from .placement import placement, placement_problem
from .projections import grouped
from .recurrent import SegmentedMixer, segmented

REASONS = {
    "encoder-decoder": "is an encoder-decoder model; hf_parallel serves decoder-only causal LMs",
    "position_ids": "forward takes no position_ids; per-stream positions need them",
    "chunked": "uses chunked attention (attention_chunk_size), which hf_parallel lacks",
    "interface": "does not route the attention of every layer through transformers' AttentionInterface",
    "probe": "failed hf_parallel's probe forward",
    "mask": "passes an attention mask of its own to its attention function, where the stream mask must rule",
    "window": "keeps a sliding window its attention function is not told of",
    "leak": "lets one prompt change another's logits in a packed row (a state kept outside the cache)",
    "state": "gives a prompt prefilled in chunks other logits than prefilled whole (a recurrent state hf_parallel "
    "cannot carry)",
    "meta": "has parameters on the meta device that no accelerate offload hook loads (load the weights, or dispatch "
    "the model with accelerate)",
    "split": "is placed so that one attention layer computes on several devices; one layer's cache lives on one: "
    "keep each attention module whole in the device map (no_split_module_classes)",
    "recurrent-placement": "has layers with a recurrent state and computes on several devices; hf_parallel runs "
    "segmented states on one device",
}


@dataclass
class Support:
    """What a call must set up on a model: the kind of each cache layer, plan hooks and segmented mixers.

    kinds:       per layer, "attention" or "hybrid" (K/V and a recurrent state).
    plan_hooks:  names of attention modules that do not receive the attention kwargs.
    mixers:      names of the modules with a recurrent state.
    cache_class: the PackedCache to build (mixed with the model's own Cache subclass, if it defines one).
    slot_bytes:  cache bytes of one slot (K and V of every attention layer), measured by the probe.
    stream_bytes: recurrent-state bytes of one stream (0 without recurrent layers), measured by the probe.
    token_by_token: the mixers' multi-token path ignores a start state (Jamba's, Zamba's scan starts from
                 zeros): a segment continuing from a state runs a token at a time.
    fusable:     names of the decoder layers' norms and (`fn:module.name`) of the rotary embedding function
                 their attention calls, which `compile="layers"` fuses (`hf_parallel.fusion`).
    attention_calls: each kind of attention call the layers make (`AttentionCall`), as the probe saw them.
    """

    kinds: list[str]
    plan_hooks: list[str] = field(default_factory=list)
    mixers: list[str] = field(default_factory=list)
    cache_class: type = PackedCache
    slot_bytes: int = 0
    stream_bytes: int = 0
    token_by_token: bool = False
    fusable: list[str] = field(default_factory=list)
    attention_calls: list[AttentionCall] = field(default_factory=list)

    @property
    def recurrent(self) -> bool:
        return bool(self.mixers)

    def cache(self, num_slots: int) -> PackedCache:
        return self.cache_class(self.kinds, num_slots)


_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_support(model: PreTrainedModel) -> Support:
    """The model's `Support`, probed once per model; NotImplementedError naming the reason when refused."""
    if model.training:
        raise ValueError("put the model in eval mode (model.eval()) before generating")
    if model not in _VERDICTS:
        _VERDICTS[model] = _probe(model)
    return _VERDICTS[model]


def check_placement(model: PreTrainedModel) -> None:
    """Refuse, by name, a placement hf_parallel cannot follow (`hf_parallel.placement`); on every call (a model may
    be dispatched again after its verdict)."""
    where = placement(model)
    problem = placement_problem(model, where)
    if problem:
        raise refuse(model, *problem)
    if where.spans and segmented(model):
        raise refuse(model, "recurrent-placement")


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword the model's forward and generate take a KV cache by: `cache` from transformers 5.24, which
    deprecated `past_key_values` (its removal announced for 5.40 in forward, 6.0 in generate)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def refuse(model: nn.Module, reason: str, detail: str = "") -> NotImplementedError:
    return NotImplementedError(f"{type(model).__name__} {REASONS[reason]}{detail}")


def check_model(model: PreTrainedModel) -> None:
    """Refuse, by name, what no forward can fix: the wrong type, an encoder-decoder, no `position_ids`, a placement
    over devices hf_parallel cannot follow."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    check_placement(model)
    config = model.config.get_text_config()
    if getattr(config, "is_encoder_decoder", False):
        raise refuse(model, "encoder-decoder")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise refuse(model, "position_ids")
    if getattr(config, "attention_chunk_size", None):
        raise refuse(model, "chunked")


def _probe(model: PreTrainedModel) -> Support:
    check_model(model)
    names = {module: name for name, module in model.named_modules()}
    mixers = [names[mixer] for _, _, mixer in segmented(model)]
    recurrent = {model.get_submodule(name).layer_idx for name in mixers}
    layers = model.config.get_text_config().num_hidden_layers
    support = Support(["hybrid" if i in recurrent else "attention" for i in range(layers)], [], mixers,
                      _cache_class(model))  # fmt: skip
    recorder = _Recorder()
    try:
        _probe_forward(model, support, recorder)
    except Exception as err:  # noqa: BLE001 - any failure of the model's own code is a reason to refuse
        raise refuse(model, "probe", f" ({type(err).__name__}: {err})") from err
    bypassed = recorder.bypassed()
    if not recorder.modules or bypassed:
        raise refuse(model, "interface", f" (layers {bypassed} wrote K/V without it)")
    if recorder.masked:
        raise refuse(model, "mask")
    unwindowed = sorted(_windowed_layers(model) - recorder.windowed)
    if unwindowed:
        raise refuse(model, "window", f" (layers {unwindowed})")
    support.plan_hooks = sorted({names[m] for m, has_plan in recorder.modules if not has_plan})
    support.fusable = fusable_parts(model, [m for m, _ in recorder.modules])
    support.attention_calls = list(recorder.calls)
    try:
        _check_isolation(model, support)
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - as above: the model's own code failed on the packed row
        raise refuse(model, "probe", f" ({type(err).__name__}: {err})") from err
    return support


def _windowed_layers(model: PreTrainedModel) -> set[int]:
    """Layers transformers' own cache gives a sliding window for this config (empty where it builds none)."""
    try:
        cache = DynamicCache(config=model.config.get_text_config())
    except Exception:  # noqa: BLE001 - a config the generic cache cannot read: nothing to compare against
        return set()
    return {i for i, layer in enumerate(cache.layers) if "Sliding" in type(layer).__name__}


def _check_isolation(model: PreTrainedModel, support: Support) -> None:
    """What the plan cannot show: a prompt's logits alone equal its logits packed after another prompt and beside
    a prompt sharing its start, and, with recurrent layers, prefilled in two chunks equal prefilled whole."""
    vocab = model.config.get_text_config().vocab_size
    one, other = [t % vocab for t in (5, 9, 7, 3, 8, 6)], [t % vocab for t in (4, 2, 9)]
    # a reordered sum's rounding: about 1e-6 of the logits in fp32, 1e-2 in 16 bits; a leak or a lost state moves
    # them by a tenth or more
    tolerance = 1e-3 if model.dtype == torch.float32 else 5e-2
    branch = one[:3] + other  # shares `one`'s first three tokens: a tree of two prompts
    alone = _prompt_logits(model, support, [one], 6)[0]
    if support.recurrent and not _close(_prompt_logits(model, support, [one], 3)[0], alone, tolerance):
        support.token_by_token = True
        if not _close(_prompt_logits(model, support, [one], 3)[0], alone, tolerance):
            raise refuse(model, "state")
    if not _close(_prompt_logits(model, support, [other, one], 9)[1], alone, tolerance):
        raise refuse(model, "leak")
    packed = _prompt_logits(model, support, [one, branch], 9)
    if not (_close(packed[0], alone, tolerance) and _close(packed[1], _prompt_logits(model, support, [branch], 6)[0],
                                                            tolerance)):  # fmt: skip
        raise refuse(model, "leak")


def _prompt_logits(model: PreTrainedModel, support: Support, prompts: list[list[int]], chunk: int) -> torch.Tensor:
    from .layout import build_layout
    from .options import GenerationOptions
    from .runner import Runner

    backend = ReferenceBackend()
    opts = GenerationOptions(max_new_tokens=1, cuda_graphs=False, prefill_chunk=chunk)
    runner = Runner(model, build_layout(prompts, 1), opts, backend, support)
    with torch.inference_mode(), use_model(model, backend, support):
        return runner.prefill().float()


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    return bool(((got - want).abs().max() <= tolerance * want.abs().max().clamp(min=1.0)).item())


class _Recorder(AttentionBackend):
    """A probe backend: records which modules call it, with or without the plan, and attends by the reference."""

    name = "hf_parallel_probe"

    def __init__(self):
        self.modules: list[tuple[nn.Module, bool]] = []  # (attention module, plan received), call by call
        self.events: list[int | None] = []  # the layer index of each K/V write, None for each attention call
        self.masked = False  # some call was handed an attention mask of the model's own
        self.windowed: set[int] = set()  # layer indices whose calls were told a sliding window
        self.calls: dict[AttentionCall, None] = {}  # each kind of call, in the order first seen

    def bypassed(self) -> list[int]:
        """Layers whose K/V write no attention call followed before the next write (a layer may write under
        another index than its module's, as Zamba2's shared block does)."""
        return [e for e, after in zip(self.events, self.events[1:] + [-1]) if e is not None and after is not None]

    def attention(self, module, query, key, value, attention_mask, *args, pp_plan=None, **kwargs):
        self.events.append(None)
        self.modules.append((module, pp_plan is not None))
        self.masked |= attention_mask is not None
        if kwargs.get("sliding_window") is not None:
            self.windowed.add(getattr(module, "layer_idx", -1))
        call = AttentionCall(query.shape[1], key.shape[1], query.shape[-1], query.dtype, kwargs.get("sliding_window"),
                             kwargs.get("softcap"), kwargs.get("s_aux") is not None)  # fmt: skip
        self.calls[call] = None
        if pp_plan is None:  # keep the forward going: the verdict comes from the record
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
        return ReferenceBackend.attention(module, query, key, value, None, *args, pp_plan=pp_plan, **kwargs)


def _probe_forward(model: PreTrainedModel, support: Support, recorder: _Recorder) -> None:
    from .layout import build_layout
    from .options import GenerationOptions
    from .runner import Runner

    vocab = model.config.get_text_config().vocab_size
    layout = build_layout([[1 % vocab, 2 % vocab]], 1)
    opts = GenerationOptions(max_new_tokens=1, cuda_graphs=False, prefill_chunk=2)
    runner = Runner(model, layout, opts, recorder, support)
    _record_writes(runner.cache, recorder.events)
    try:
        with torch.inference_mode(), use_model(model, recorder, support):
            runner.prefill()
    finally:
        del runner.cache.update  # the recording wrapper refers to the cache: no cycle may outlive the probe
    kv = [layer for layer in runner.cache.layers if isinstance(layer, PackedLayer)]
    support.slot_bytes = sum(PackedLayer.stored_bytes(layer) for layer in kv) // layout.num_slots
    support.stream_bytes = runner.cache.stored_bytes() - support.slot_bytes * layout.num_slots


def _record_writes(cache: PackedCache, events: list) -> None:
    update = cache.update

    def recording(key_states, value_states, layer_idx, *args, **kwargs):
        events.append(layer_idx)
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = recording


def _cache_class(model: PreTrainedModel) -> type:
    """PackedCache, mixed with a Cache subclass the model's module defines for itself (MiniMax checks its type)."""
    module = sys.modules.get(type(model).__module__)
    own = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Cache)
           and c.__module__ == module.__name__] if module else []  # fmt: skip
    return type(f"Packed{own[0].__name__}", (PackedCache, own[0]), {}) if len(own) == 1 else PackedCache


@contextlib.contextmanager
def use_model(model: PreTrainedModel, backend: AttentionBackend, support: Support, fuse: bool = False,
              group: bool = False):  # fmt: skip
    """For the block: attention through `backend`, the plan hooked into modules that miss it, mixers segmented;
    with `fuse`, the layers' norms and rotary embedding compiled (`hf_parallel.fusion`); with `group`, sibling
    projections run as one GEMM (`hf_parallel.projections`)."""
    hooks = [model.get_submodule(name).register_forward_pre_hook(_inject_plan, with_kwargs=True)
             for name in support.plan_hooks]  # fmt: skip
    swapped = []
    for name in support.mixers:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        swapped.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, SegmentedMixer(getattr(parent, attr), support.token_by_token))
    try:
        with use_attention(model, backend), fused(model, support.fusable if fuse else []), grouped(model, group):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        for parent, attr, mixer in swapped:
            setattr(parent, attr, mixer)


def _inject_plan(module, args, kwargs):
    if kwargs.get("pp_plan") is None:
        cache = next((v for v in (*kwargs.values(), *args) if isinstance(v, PackedCache)), None)
        hidden = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if cache is not None and cache.plan is not None:  # on the device of the module's inputs (placed models)
            kwargs["pp_plan"] = cache.plan.to(hidden.device) if hidden is not None else cache.plan
    return args, kwargs
