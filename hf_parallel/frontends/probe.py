"""The probe: whether the packed row can serve a model, decided by what the model does, not by a class flag.

Every forward runs on the engine core (`engine.core`), as score requests.  A forward of two tokens runs through
a recording attention backend: every layer that writes K/V to the
cache must route its attention through transformers' AttentionInterface (so the stream mask applies),
without an attention mask of its own and with the sliding window transformers' own cache would apply.
An attention module whose decoder layer drops the attention kwargs (Nemotron, StableLM) gets the plan
from the cache by a forward pre-hook instead.  Then a prompt's logits alone must equal its logits packed
after another prompt and beside a prompt sharing its start (no state kept outside the cache).  Layers
with a recurrent state are found by class and run per segment (`hf_parallel.models.recurrent`).

The verdict, a `ModelProfile`, is kept per model; a refusal is a NotImplementedError naming one of
`hf_parallel.models.checks.REASONS`.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers import PreTrainedModel

from ..attention import AttentionBackend, AttentionCall
from ..attention.reference import ReferenceBackend
from ..compat.transformers_internals import own_cache_class, sliding_window_layers
from ..decoding.options import GenerationOptions
from ..engine.core import EngineCore
from ..engine.policies import AllAtOnce
from ..engine.streams import ScoreRequest
from ..models.checks import check_model, refuse
from ..models.compiled_parts import fusable_parts
from ..models.recurrent import segmented
from ..row.cache import PackedCache, PackedLayer
from ..row.contents import FixedRow
from ..row.layout import build_layout, layout_prompts
from ..runner.model_runner import ModelRunner
from ..runner.patching import ModelProfile, model_lock, use_model

_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_support(model: PreTrainedModel) -> ModelProfile:
    """The model's `ModelProfile`, probed once per model; NotImplementedError naming the reason when refused,
    ValueError for a model in training mode."""
    if model.training:
        raise ValueError("put the model in eval mode (model.eval()) before generating")
    with model_lock(model).held():  # probed once, whichever thread asks first
        if model not in _VERDICTS:
            _VERDICTS[model] = probe_model(model)
        return _VERDICTS[model]


def probe_model(model: PreTrainedModel) -> ModelProfile:
    """Probe `model` (the module docstring); its `ModelProfile`, or NotImplementedError naming the reason."""
    check_model(model)
    names = {module: name for name, module in model.named_modules()}
    mixers = [names[mixer] for _, _, mixer in segmented(model)]
    recurrent = {model.get_submodule(name).layer_idx for name in mixers}
    layers = model.config.get_text_config().num_hidden_layers
    support = ModelProfile(
        ["hybrid" if i in recurrent else "attention" for i in range(layers)], [], mixers, _cache_class(model)
    )
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
    return sliding_window_layers(model.config.get_text_config())


def _check_isolation(model: PreTrainedModel, support: ModelProfile) -> None:
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
    if not (
        _close(packed[0], alone, tolerance)
        and _close(packed[1], _prompt_logits(model, support, [branch], 6)[0], tolerance)
    ):
        raise refuse(model, "leak")


def _prompt_logits(model: PreTrainedModel, support: ModelProfile, prompts: list[list[int]], chunk: int) -> torch.Tensor:
    """Log-probabilities [P, V] at each prompt's last token, the prompts prefilled `chunk` tokens a forward."""
    layout = build_layout(prompts, 1)
    return _prefill(_runner(model, support, ReferenceBackend(), layout), layout, chunk)


def _runner(model, support: ModelProfile, backend, layout) -> ModelRunner:
    opts = GenerationOptions(max_new_tokens=1, cuda_graphs=False)
    runner = ModelRunner(model, support, opts, backend, layout.num_slots)
    runner.relayout(layout)
    return runner


def _prefill(runner: ModelRunner, layout, chunk: int) -> torch.Tensor:
    """Each prompt's log-probabilities at its last token [P, V] (float32), the prompts prefilled `chunk` tokens a
    round on the engine core, as score requests of the whole row."""
    core = EngineCore(runner.model, runner, AllAtOnce(), FixedRow(layout), chunk)
    requests = [ScoreRequest(prompt, None, targets=[0], full=True) for prompt in layout_prompts(layout)]
    for request in requests:
        core.add(request)
    with torch.inference_mode(), use_model(runner.model, runner.backend, runner.profile):
        for _ in core.run():
            pass
    return torch.stack([torch.from_numpy(r.scores.rows[0]) for r in requests])


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
        call = AttentionCall(
            query.shape[1],
            key.shape[1],
            query.shape[-1],
            query.dtype,
            kwargs.get("sliding_window"),
            kwargs.get("softcap"),
            kwargs.get("s_aux") is not None,
        )
        self.calls[call] = None
        if pp_plan is None:  # keep the forward going: the verdict comes from the record
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
        return ReferenceBackend.attention(module, query, key, value, None, *args, pp_plan=pp_plan, **kwargs)


def _probe_forward(model: PreTrainedModel, support: ModelProfile, recorder: _Recorder) -> None:
    vocab = model.config.get_text_config().vocab_size
    layout = build_layout([[1 % vocab, 2 % vocab]], 1)
    runner = _runner(model, support, recorder, layout)
    _record_writes(runner.cache, recorder.events)
    try:
        _prefill(runner, layout, 2)
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
    own = own_cache_class(model)
    return type(f"Packed{own.__name__}", (PackedCache, own), {}) if own is not None else PackedCache
