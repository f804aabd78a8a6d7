"""What hf_parallel relies on in transformers beyond its public API, one named function (or class) each.

Each docstring says what it relies on and the versions it was checked on (5.17, the oldest hf_parallel runs on a
GPU, and 5.25); tests/test_compat.py checks each on a tiny random-weight model, so that a transformers release
that changes one fails there, by name, before anything downstream does.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

# --------------------------------------------------------------------------- attention implementation


def attention_implementation(config) -> str | None:
    """The attention implementation `set_attn_implementation` set on `config`.

    Relies on: `PretrainedConfig._attn_implementation`, the private attribute every modeling file reads to pick
    its attention function from `AttentionInterface` (5.17, 5.25)."""
    return config._attn_implementation


def attention_implementations(config) -> str | dict:
    """The attention implementation of `config` and of each sub-config, as `set_attn_implementation` takes them
    back (a composite model's sub-models may use different ones).

    Relies on: `config.sub_configs` naming the sub-config attributes, and each config's `_attn_implementation`
    (5.17, 5.25)."""
    subs = {key: getattr(config, key) for key in getattr(config, "sub_configs", {})}
    own = {key: sub._attn_implementation for key, sub in subs.items() if sub is not None and sub._attn_implementation}
    return {"": config._attn_implementation, **own} if own else config._attn_implementation


def register_attention(name: str, function: Callable) -> None:
    """Register `function` with `AttentionInterface` under `name` (where the name holds another function, or none),
    and no mask function under that name.

    Relies on: `create_causal_mask` (and the sliding-window one) returning None at once for an implementation name
    absent from the mask registry (`AttentionMaskInterface`), so a model routed through `name` never builds a dense
    mask of its own and its attention function is handed `attention_mask=None` (5.17, 5.25)."""
    if AttentionInterface().get(name) != function:
        AttentionInterface.register(name, function)


# --------------------------------------------------------------------------- layers found by their class


def sliding_window_layers(config) -> set[int]:
    """Layers to which transformers' own cache gives a sliding window for `config` (a text config); empty where it
    builds none, or cannot read the config.

    Relies on: `DynamicCache(config=...)` building one layer per decoder layer, a sliding window's layer a class
    whose name holds "Sliding" (`DynamicSlidingWindowLayer`, and the hybrid layers that derive from it; 5.17, 5.25)."""
    try:
        cache = DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a config the generic cache cannot read: nothing to compare against
        return set()
    return {i for i, layer in enumerate(cache.layers) if "Sliding" in type(layer).__name__}


def own_cache_class(model: nn.Module) -> type | None:
    """The `Cache` subclass the model's modeling module defines for itself, where it defines exactly one (MiniMax
    checks its cache's type); else None.

    Relies on: a model's own cache class being defined in the module that defines the model's class (5.17, 5.25)."""
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return None
    own = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, Cache) and c.__module__ == module.__name__
    ]
    return own[0] if len(own) == 1 else None


# --------------------------------------------------------------------------- the recurrent state in the cache


class RecurrentStateLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer, whose states are set and read whole, one dict by state index each.

    Relies on: `LinearAttentionLayer` (`cache_utils`) keeping each state index's conv and recurrent states in
    `conv_states` and `recurrent_states`, and its `is_conv_states_initialized`, `is_recurrent_states_initialized`,
    `has_previous_state` and `conv_kernel_size` flags, which the mixers read through `cache.layers[layer_idx]`
    (5.17, 5.25)."""

    def __init__(self, number_of_states: int):
        super().__init__(number_of_states=number_of_states)

    @property
    def state_count(self) -> int:
        return self.number_of_states

    def set_states(self, conv: dict | None, rec: dict | None) -> None:
        """Put the conv and recurrent states (by state index; absent or None: not there) where the mixer looks
        for them; both None: a fresh sequence (the mixer allocates its states)."""
        fresh = conv is None and rec is None
        for i in range(self.number_of_states):
            c = None if conv is None else conv.get(i)
            r = None if rec is None else rec.get(i)
            self.conv_states[i], self.recurrent_states[i] = c, r
            self.is_conv_states_initialized[i] = c is not None
            self.is_recurrent_states_initialized[i] = r is not None
            self.has_previous_state[i] = not fresh
            if c is not None:
                self.conv_kernel_size[i] = c.shape[-1]

    def states(self) -> tuple[dict, dict]:
        """Copies of the dicts of conv and recurrent states by state index (the tensors themselves)."""
        return dict(self.conv_states), dict(self.recurrent_states)

    def linear_state(self, index: int = 0) -> torch.Tensor | None:
        """State `index`'s recurrent state, None before the sequence has one (MiniMax's `get_linear_cache`)."""
        return self.recurrent_states[index] if self.has_previous_state[index] else None

    def set_linear_state(self, index: int, state: torch.Tensor) -> None:
        """Set state `index`'s recurrent state (MiniMax's `set_linear_cache`)."""
        self.recurrent_states[index], self.has_previous_state[index] = state, True


# --------------------------------------------------------------------------- the rotary embedding function

ROTARY = "apply_rotary_pos_emb"  # the name every modeling file that copies Llama's attention gives it


def rotary_function(cls: type):
    """The rotary embedding function `cls.forward` calls, as its modeling module defines it (a function, or the
    `kernels` module transformers makes of it where `kernels` is installed); None where the forward calls none.

    Relies on: the attention class's forward calling `apply_rotary_pos_emb` by that name, a global of the module
    that defines the class, under transformers' kwarg decorators and `kernels`' wrapper, which keep it as
    `__wrapped__` (5.17, 5.25)."""
    forward = inspect.unwrap(cls.forward)
    code = getattr(forward, "__code__", None)
    if code is None or ROTARY not in code.co_names:
        return None
    return getattr(sys.modules.get(cls.__module__), ROTARY, None)


def runs_as_written(function, modules: list[nn.Module]) -> bool:
    """Whether the rotary `function` runs as written: a function, or `kernels`' module of one that `kernelize` gave
    no forward of its own, neither on itself nor on any of `modules`' copies of it.

    Relies on: transformers' `use_kernel_forward_from_hub` making the function a module with `kernel_layer_name`
    where `kernels` is installed, and `use_kernelized_func` giving each attention module its copy in
    `_kernel_funcs` (5.25 with kernels 0.19)."""
    if isinstance(function, types.FunctionType):
        return True
    if not isinstance(function, nn.Module) or not hasattr(type(function), "kernel_layer_name"):
        return False
    copies = [function] + [c for m in modules for c in vars(m).get("_kernel_funcs", {}).values()]
    return not any("forward" in vars(c) for c in copies)


def forward_with_global(cls: type, name: str, value) -> types.FunctionType | None:
    """`cls.forward` rebuilt so that, where its code reads the global `name` of the module that defines it, it reads
    `value` instead; None where it cannot be (its code reads no such global, or a decorator keeps the function
    it wraps elsewhere than in a closure cell).  Nothing is changed: neither the class nor the module.

    Relies on: the forward reading `name` as a global of its modeling module (`rotary_function`), and the
    decorators around it (transformers' `deprecate_kwarg`, `kernels`' `use_kernelized_func`) holding the function
    they wrap in `__wrapped__` and in a closure cell: each wrapper is rebuilt around the rebuilt function it wraps
    (5.17: no decorator on Llama's; 5.25: `deprecate_kwarg`, and `kernels`' where installed)."""
    chain = [cls.forward]
    while hasattr(chain[-1], "__wrapped__"):
        chain.append(chain[-1].__wrapped__)
    innermost = chain[-1]
    if not isinstance(innermost, types.FunctionType) or name not in innermost.__code__.co_names:
        return None
    rebuilt = _rebuilt(innermost, {**innermost.__globals__, name: value}, innermost.__closure__)
    for wrapper, inner in zip(reversed(chain[:-1]), reversed(chain[1:])):
        if not isinstance(wrapper, types.FunctionType):
            return None
        cells, found = [], False
        for cell in wrapper.__closure__ or ():
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                held = None
            found |= held is inner
            cells.append(types.CellType(rebuilt) if held is inner else cell)
        if not found:
            return None
        rebuilt = _rebuilt(wrapper, wrapper.__globals__, tuple(cells), wrapped=rebuilt)
    return rebuilt


def _rebuilt(function: types.FunctionType, globals_: dict, closure, wrapped=None) -> types.FunctionType:
    new = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__, closure)
    new.__kwdefaults__ = function.__kwdefaults__
    new.__qualname__, new.__doc__, new.__module__ = function.__qualname__, function.__doc__, function.__module__
    new.__dict__.update(function.__dict__)
    if wrapped is not None:
        new.__wrapped__ = wrapped
    return new


def set_forward(module: nn.Module, function: types.FunctionType) -> Callable[[], None] | None:
    """Make `function` (a `forward_with_global` of the module's class) the forward of `module` alone, this instance;
    the undo, which puts the module back exactly as it was; None, changing nothing, where the module's forward is
    already its own (a hook's, or another set-up's) and is not accelerate's hook around the class's forward.

    Relies on: nn.Module calling `self.forward` (an instance attribute first); accelerate's hooks keeping the
    class's forward bound in `_old_forward`, which their forward calls (accelerate 1.16)."""
    own = vars(module)
    bound = types.MethodType(function, module)
    if "forward" not in own:
        module.forward = bound

        def undo() -> None:
            del module.forward

        return undo
    held = own.get("_old_forward")
    if getattr(held, "__func__", None) is type(module).forward and getattr(held, "__self__", None) is module:
        module._old_forward = bound

        def undo_hooked() -> None:
            module._old_forward = held

        return undo_hooked
    return None


# --------------------------------------------------------------------------- logits processors' attributes

# classes that read only the history's length: the attribute holding their (absolute) length limit (5.17, 5.25)
LENGTH_LIMIT = {
    lp.MinLengthLogitsProcessor: "min_length",
    lp.MinNewTokensLengthLogitsProcessor: "prompt_length_to_skip",
    lp.SuppressTokensAtBeginLogitsProcessor: "begin_index",
    lp.ExponentialDecayLengthPenalty: "regulation_start",
    lp.ForcedEOSTokenLogitsProcessor: "max_length",
    sc.MaxLengthCriteria: "max_length",
}


def length_limit(processor) -> int:
    """The history length at which a processor's or criterion's behaviour changes, as its
    constructor was given it for one prompt.

    Relies on: the attribute names in `LENGTH_LIMIT`, where each class keeps that number (5.17, 5.25)."""
    return getattr(processor, LENGTH_LIMIT[type(processor)])


def banned_ngram_size(processor: lp.NoRepeatNGramLogitsProcessor) -> int:
    """The n of a `NoRepeatNGramLogitsProcessor`.  Relies on: its `ngram_size` attribute (5.17, 5.25)."""
    return processor.ngram_size


def eos_token_ids(criterion: sc.EosTokenCriteria) -> list[int]:
    """The ids an `EosTokenCriteria` stops at.  Relies on: its `eos_token_id` attribute, a tensor (5.17, 5.25)."""
    return [int(t) for t in criterion.eos_token_id.flatten().tolist()]
