"""What a call sets on a model, and takes back when it ends: `ModelProfile` says what, `use_model` does it.

For the block of a call, the model's attention runs through an attention backend, attention modules
that miss the plan get it from the cache, recurrent mixers are stood in for by segmented ones, and,
where the runner decides so, the layers' small parts run compiled and sibling projections as one GEMM.
Nothing of it outlives the block, whatever the block raises.

A model is set up for one call at a time: calls on one model from several threads take turns
(`model_lock`), so none sees another's set-up.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..attention import AttentionBackend, AttentionCall, use_attention
from ..decoding.options import Tuning
from ..models.compiled_parts import FUNCTION, fused
from ..models.projections import grouped
from ..models.recurrent import SegmentedMixer
from ..row.cache import PackedCache

DEFAULT_TUNING = Tuning()


@dataclass
class ModelProfile:
    """What the support probe found of one model, and so how the packed row serves it (`frontends.probe.check_support`).

    kinds:       per layer, "attention" or "hybrid" (K/V and a recurrent state).
    plan_hooks:  names of attention modules that do not receive the attention kwargs.
    mixers:      names of the modules with a recurrent state.
    cache_class: the PackedCache to build (mixed with the model's own Cache subclass, if it defines one).
    slot_bytes:  cache bytes of one slot (K and V of every attention layer).
    stream_bytes: recurrent-state bytes of one stream (0 without recurrent layers).
    token_by_token: the mixers' multi-token path ignores a start state: a segment continuing from a state runs a
                 token at a time.
    fusable:     names of the decoder layers' norms and (`fn:module.name`) of the rotary embedding function their
                 attention calls, which may run compiled (`hf_parallel.models.compiled_parts`).
    attention_calls: each kind of attention call the layers make (`AttentionCall`).
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
        """An empty cache of `num_slots` slots for every layer of the model."""
        return self.cache_class(self.kinds, num_slots)


class ModelLock:
    """Calls on one model take turns: one thread holds the model at a time, as often as it likes (a call inside a
    call of its own), and the model is free once the holder's outermost block has ended.

    Unlike `threading.RLock`, the block may end on another thread than the one that entered it: a stream of
    answers dropped half read is closed by whichever thread collects it.
    """

    def __init__(self):
        self._turn = threading.Condition()
        self._holder: int | None = None
        self._depth = 0

    @contextlib.contextmanager
    def held(self):
        """For the block: the model is this thread's; another thread's call waits for its end."""
        me = threading.get_ident()
        with self._turn:
            self._turn.wait_for(lambda: self._holder in (None, me))
            self._holder, self._depth = me, self._depth + 1
        try:
            yield
        finally:
            with self._turn:
                self._depth -= 1
                if self._depth == 0:
                    self._holder = None
                    self._turn.notify_all()


_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAKING = threading.Lock()  # one ModelLock per model, however many threads ask first


def model_lock(model: PreTrainedModel) -> ModelLock:
    """The `ModelLock` of `model`: every hf_parallel call on it holds it for the call's duration."""
    with _MAKING:
        if model not in _LOCKS:
            _LOCKS[model] = ModelLock()
        return _LOCKS[model]


@contextlib.contextmanager
def use_model(
    model: PreTrainedModel,
    backend: AttentionBackend,
    profile: ModelProfile,
    fuse: bool = False,
    group: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
):
    """For the block: attention through `backend`, the plan hooked into modules that miss it, mixers segmented;
    with `fuse`, the layers' norms and rotary embedding compiled; with `group`, sibling projections as one GEMM;
    each as `tuning` says (its rotary, widths, projections and prefill columns).  The block holds the model
    (`model_lock`): another thread's call on it waits."""
    with model_lock(model).held():
        yield from _set_up(model, backend, profile, fuse, group, tuning)


def _set_up(
    model: PreTrainedModel, backend: AttentionBackend, profile: ModelProfile, fuse: bool, group: bool, tuning: Tuning
):
    """`use_model`'s set-up, yielded inside, taken back after."""
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(inject_plan, with_kwargs=True)
        for name in profile.plan_hooks
    ]
    swapped = []
    for name in profile.mixers:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        swapped.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, SegmentedMixer(getattr(parent, attr), profile.token_by_token))
    parts = [p for p in profile.fusable if tuning.fuse_rotary or not p.startswith(FUNCTION)] if fuse else []
    group = group and tuning.group_projections
    try:
        with (
            use_attention(model, backend),
            fused(model, parts, every_dim_dynamic=not tuning.static_widths),
            grouped(model, group, columns=tuning.prefill_columns),
        ):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        for parent, attr, mixer in swapped:
            setattr(parent, attr, mixer)


def inject_plan(module, args, kwargs):
    """A forward pre-hook: the cache's plan as `pp_plan=` for an attention module its decoder layer did not pass
    it to, on the device of the module's inputs (a model placed over devices)."""
    if kwargs.get("pp_plan") is None:
        cache = next((v for v in (*kwargs.values(), *args) if isinstance(v, PackedCache)), None)
        hidden = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if cache is not None and cache.plan is not None:
            kwargs["pp_plan"] = cache.plan.to(hidden.device) if hidden is not None else cache.plan
    return args, kwargs
