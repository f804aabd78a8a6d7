"""The decoder layers' norms fused by `torch.compile`, one module class at a time.

A decode step over 64 streams is mostly weight reads, yet eagerly each layer also runs some thirty small
kernels (an RMSNorm alone is seven: cast, square, mean, add, rsqrt, multiply, cast and scale), each a few
microseconds even inside a CUDA graph.  Compiling the whole model fuses them but traces every layer
(tens of seconds on a 7B model).  Here only a layer's norms are compiled: they hold no attention and no cache,
and they are the same code in every layer, with other weights, so Dynamo compiles one graph per norm class (the
token count dynamic) and every layer reuses it.

A part is fusable when it is a norm: no children, only 1-D parameters.  Dense MLPs were measured compiled too
(their activation and product fused) and left out: no step got faster past the benchmark's noise, and their
graph added about 5 s to the first call.  Inductor emulates eager's rounding after each 16-bit operation
(`emulate_precision_casts`), so a 16-bit answer moves only by the fused reductions' order.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

OPTIONS = {"emulate_precision_casts": True}
RECOMPILE_LIMIT = 64  # graphs per compiled function (a whole-model step compiles at most three, a part one per
# shape of its weights: a process that runs models of many shapes recompiles)


def recompile_limit(limit: int):
    """Dynamo's per-function recompile limit raised to at least `limit` (its default, 8, would leave the
    buckets past the eighth, e.g. the ninth of 256 streams, running uncompiled)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), limit)})


def fusable_parts(model: nn.Module, attention: list[nn.Module]) -> list[str]:
    """Names of the norms of the decoder layers that hold the modules in `attention`."""
    names = {module: name for name, module in model.named_modules()}
    layers = {names[m].rpartition(".")[0] for m in attention if m in names and "." in names[m]}
    parts = []
    for layer in sorted(layers, key=_natural):
        for child_name, child in model.get_submodule(layer).named_children():
            if child not in attention and _is_norm(child):
                parts.append(f"{layer}.{child_name}")
    return parts


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _is_norm(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.dim() == 1 for p in params)


class _Fused:
    """A part's forward through its class's compiled function; eager again (with one warning) if compiling fails."""

    failed: set[type] = set()  # classes whose compilation failed in this process
    compiled: dict[type, object] = {}

    def __init__(self, module: nn.Module):
        self.module, self.eager, self.cls = module, module.forward, type(module)
        if self.cls not in _Fused.compiled:  # one function per class: Dynamo caches on its code, guards on shapes
            _Fused.compiled[self.cls] = torch.compile(self.cls.forward, dynamic=True, options=OPTIONS)
        self.fn = _Fused.compiled[self.cls]

    def __call__(self, *args, **kwargs):
        cls = self.cls
        if cls not in _Fused.failed:
            try:
                return self.fn(self.module, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - a real input error recurs below, eagerly
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(f"torch.compile of {cls.__name__} failed ({type(err).__name__}: {err}); "
                              "running it as it is", stacklevel=2)  # fmt: skip
                _Fused.failed.add(cls)
        return self.eager(*args, **kwargs)


@contextlib.contextmanager
def fused(model: nn.Module, parts: list[str]):
    """For the block: each part in `parts` runs its forward compiled (an instance attribute, removed after)."""
    modules = [model.get_submodule(name) for name in parts]
    modules = [m for m in modules if "forward" not in vars(m)]  # a forward of its own (a hook's): left alone
    for module in modules:
        module.forward = _Fused(module)
    try:
        with recompile_limit(RECOMPILE_LIMIT) if modules else contextlib.nullcontext():
            yield
    finally:
        for module in modules:
            del module.forward
