"""Where a model computes: one device, several (accelerate's big-model placement), or one shard per rank (TP).

A model dispatched by accelerate (`device_map="auto"`, an explicit map, CPU or disk offload)
runs each block on its hook's execution device; offloaded weights wait on the meta device and
the hook loads them for each forward.  hf_parallel follows without a hook of its own: each
layer's cache is allocated on its keys' device, and the plan reaches each device as one copy
per forward (`AttentionPlan.to`, which accelerate's `send_to_device` calls on every kwarg).
Under tensor parallelism (`tp_plan="auto"`) every rank runs the whole loop on its local heads;
the plan is built from the layout alone, so it is the same on every rank with no communication.

What it cannot follow it refuses before any work (`placement_problem`): parameters on the meta
device that no hook loads, and an attention layer split over devices (its keys and queries would
meet on different devices, and one layer's cache lives on one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..compat.transformers_names import is_attention_layer


def normal_device(device) -> torch.device:
    """`device` as `torch.device` with an index where the type has one ("cuda" -> "cuda:<current>")."""
    if isinstance(device, int):  # accelerate's maps may name a GPU by its index alone
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _align_hooks(module: nn.Module) -> list:
    """accelerate's AlignDevicesHooks on `module` (a SequentialHook holds several)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", (hook,)) if hook is not None else ()
    return [h for h in hooks if hasattr(h, "execution_device")]


def _execution_device(module: nn.Module, hooks: list | None = None) -> torch.device | None:
    """The first of `module`'s hooks' execution devices (`hooks`: its `_align_hooks`, where already found)."""
    devices = [
        h.execution_device for h in (_align_hooks(module) if hooks is None else hooks) if h.execution_device is not None
    ]
    return normal_device(devices[0]) if devices else None


def _offloads(hooks: list) -> bool:
    """Whether one of a module's hooks (its `_align_hooks`) loads offloaded weights inside each forward."""
    return any(getattr(h, "offload", False) and h.weights_map is not None for h in hooks)


@dataclass(frozen=True)
class Placement:
    """Where a model computes, from one walk over its modules and one over its parameters."""

    devices: frozenset  # every device a forward computes on: its hooks' execution devices, its resident weights'
    offloaded: bool  # a hook loads offloaded weights inside every forward
    tensor_parallel: bool  # DTensor weights (loaded with `tp_plan=...`)
    meta: bool  # some parameter waits on the meta device

    @property
    def spans(self) -> bool:
        return len(self.devices) > 1

    @property
    def eager_only(self) -> bool:
        """Decode steps cannot be captured as CUDA graphs: the model computes on several devices (a graph records
        one), a hook loads offloaded weights inside every forward, or it is sharded by tensor parallelism (a
        capture that failed on one rank only would leave the ranks waiting in different collectives)."""
        return self.spans or self.offloaded or self.tensor_parallel


def placement(model: nn.Module) -> Placement:
    """`model`'s `Placement`, now (a model may be dispatched or moved between calls)."""
    devices, offloaded = set(), False
    for module in model.modules():
        if getattr(module, "_hf_hook", None) is not None:
            hooks = _align_hooks(module)
            device = _execution_device(module, hooks)
            devices |= {device} if device is not None else set()
            offloaded |= _offloads(hooks)
    params = list(model.parameters())
    devices |= {p.device for p in params if p.device.type != "meta"}
    return Placement(
        frozenset(devices),
        offloaded,
        any(isinstance(p, DTensor) for p in params),
        any(p.device.type == "meta" for p in params),
    )


def execution_devices(model: nn.Module) -> set[torch.device]:
    """Every device a forward of `model` computes on: its hooks' execution devices and its resident weights'."""
    return set(placement(model).devices)


def loop_device(model: nn.Module) -> torch.device:
    """Where the generation loop keeps its tensors: the root hook's execution device (accelerate moves the
    inputs there and the outputs back), else the device of the model's first parameter."""
    return _execution_device(model) or model.device


def eager_only(model: nn.Module) -> bool:
    """`Placement.eager_only` of `model`."""
    return placement(model).eager_only


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether `model` holds DTensor weights (loaded with `tp_plan=...`)."""
    return placement(model).tensor_parallel


def placement_problem(model: nn.Module, where: Placement | None = None) -> tuple[str, str] | None:
    """(reason, detail) of a placement hf_parallel cannot serve (reasons: `checks.REASONS`), or None (`where`:
    the model's `Placement`, if known)."""
    where = where if where is not None else placement(model)
    unloaded = _unloaded_meta_parameters(model) if where.meta else []
    if unloaded:
        return "meta", f" ({', '.join(unloaded[:4])}{', ...' if len(unloaded) > 4 else ''})"
    split = _split_attention(model)
    if split:
        name, devices = split
        return "split", f" ({name} runs on {', '.join(sorted(map(str, devices)))})"
    return None


def _unloaded_meta_parameters(model: nn.Module) -> list[str]:
    """Meta-device parameters that no offloading hook on their module or above it loads before use."""
    names, loaded = [], set()
    for name, module in model.named_modules():  # parents come before their children
        parent = name.rpartition(".")[0] if "." in name else ("" if name else None)
        if _offloads(_align_hooks(module)) or parent in loaded:
            loaded.add(name)
        if name in loaded:
            continue
        names += [f"{name}.{p}" if name else p for p, t in module.named_parameters(recurse=False) if t.is_meta]
    return names


def _split_attention(model: nn.Module) -> tuple[str, set[torch.device]] | None:
    """The first attention module whose parts compute on different devices, with those devices: the entries of
    `hf_device_map` inside it, and the entry holding it (where its parts the map does not name run)."""
    device_map = getattr(model, "hf_device_map", None) or {}
    if not device_map:  # no map: each part runs where its weights are (`Placement.devices` alone)
        return None
    for name, module in model.named_modules():
        if not is_attention_layer(module):
            continue
        parts = [k for k in device_map if k.startswith(f"{name}.")]
        holder = max((k for k in device_map if k in ("", name) or name.startswith(f"{k}.")), key=len, default=None)
        parts += [holder] if holder is not None else []
        devices = {_part_device(model, k, device_map[k]) for k in parts}
        if len(devices) > 1:
            return name, devices
    return None


def _part_device(model: nn.Module, name: str, placed) -> torch.device:
    """Where the part `name` of a device map computes: its hook's execution device (an offloaded part runs on the
    main device), else where the map put it."""
    return _execution_device(model.get_submodule(name)) or normal_device("cpu" if placed == "disk" else placed)
