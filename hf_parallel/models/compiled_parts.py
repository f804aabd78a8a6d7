"""The decoder layers' norms and rotary embedding fused by `torch.compile`, one class or function at a time.

Eagerly a layer runs many small kernels (an RMSNorm alone is seven: cast, square, mean, add, rsqrt, multiply,
cast and scale; the rotary embedding ten).  Compiling the whole model fuses them but traces every layer
(`compile=True`).  Here only a layer's norms and the rotary embedding function are compiled: they hold no
attention and no cache, and they are the same code in every layer, so Dynamo compiles one graph per norm class
and one for the function, and every layer reuses it.  Only the token count is a dynamic dimension: each call
marks it (`token_dims`), and the model's widths (hidden size, heads, head size) stay static, so Inductor's
kernels index with constants rather than divide by runtime sizes (docs/benchmarks/gpu.md, "Ablations on the grid").
A graph compiles again where a call's strides differ from those it was compiled for: a prefill chunk's q and k
are given a decode step's strides (`hf_parallel.models.projections`), so the rotary function compiles once.

A part is fusable when it is a norm (no children, only 1-D parameters) or the rotary embedding function
(`apply_rotary_pos_emb`) that an attention module's forward looks up in its modeling module (a part named
`fn:module.function`).  For the block, each of this model's modules whose forward calls the function gets a
forward of its own that calls the compiled function instead (its class's forward, rebuilt over a copy of the
modeling module's globals: `compat.transformers_internals.forward_with_global`), so every layer's call goes
through one compiled graph, and neither the modeling module nor another model of the same family is touched.
Where the `kernels` package is installed, transformers makes the function a module whose forward calls it; that
module is compiled instead, unless `kernels.kernelize` gave it (or an attention module's copy of it) a hub
kernel's forward, which is then left alone.  Dense MLPs stay eager: compiled, they made no step faster and the
first call slower (docs/benchmarks/gpu.md, "Ablations on the grid").  Inductor emulates eager's rounding after each
16-bit operation (`emulate_precision_casts`), so a 16-bit answer moves only by the fused reductions' order.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import warnings

import torch
from torch import nn
from torch._inductor import config as inductor_config

from ..compat.transformers_internals import ROTARY, forward_with_global, rotary_function, runs_as_written, set_forward

OPTIONS = {"emulate_precision_casts": True}
RECOMPILE_LIMIT = 64  # graphs per compiled function (a whole-model step compiles at most three, a part one per
# shape of its weights: a process that runs models of many shapes recompiles)


def recompile_limit(limit: int):
    """Dynamo's per-function recompile limit raised to at least `limit` (its default, 8, would leave the
    buckets past the eighth, e.g. the ninth of 256 streams, running uncompiled)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), limit)})


COMPILER = "torch._inductor.compile_fx"  # what `torch.compile`'s first use imports, a slow import
importing: list[threading.Thread] = []  # the thread importing it, once per process


def compiler_unimported() -> bool:
    """Whether Inductor's compiler is neither imported nor being imported (`import_compiler` would start it)."""
    return not importing and COMPILER not in sys.modules


def import_compiler() -> None:
    """Start importing Inductor's compiler on a thread of its own, once per process, where it is not imported yet.

    A call that will compile starts it before its support probe, whose first forward on a GPU spends much of its
    time in CUDA calls that release Python's lock; `compiler_imported` waits for it before the first
    `torch.compile` (docs/benchmarks/gpu.md, "The first call")."""
    if compiler_unimported():
        importing.append(threading.Thread(target=_import, args=(COMPILER,), name="hf_parallel-import", daemon=True))
        importing[0].start()


def _import(name: str) -> None:
    with contextlib.suppress(Exception):  # an import that fails here fails again, and is reported, where it is used
        importlib.import_module(name)


def compiler_imported() -> None:
    """Wait for `import_compiler`'s thread, if any: the compiler's packages import one another, and two threads
    importing them at once could each wait for a module the other is importing."""
    if importing:
        importing[0].join()


FUNCTION = "fn:"  # a part that is a modeling module's function, not a submodule


def fusable_parts(model: nn.Module, attention: list[nn.Module]) -> list[str]:
    """Names of the norms of the decoder layers that hold the modules in `attention`, and `fn:` names of the
    rotary embedding functions those modules' forwards call."""
    names = {module: name for name, module in model.named_modules()}
    layers = {names[m].rpartition(".")[0] for m in attention if m in names and "." in names[m]}
    parts = []
    for layer in sorted(layers, key=_natural):
        for child_name, child in model.get_submodule(layer).named_children():
            if child not in attention and _is_norm(child):
                parts.append(f"{layer}.{child_name}")
    for cls in sorted({type(m) for m in attention}, key=lambda c: c.__module__):
        function = rotary_function(cls)
        if function is not None and runs_as_written(function, attention):
            parts.append(f"{FUNCTION}{cls.__module__}.{ROTARY}")
    return list(dict.fromkeys(parts))  # once each, in order


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _is_norm(module: nn.Module) -> bool:
    params = list(module.parameters(recurse=False))
    return not list(module.children()) and bool(params) and all(p.dim() == 1 for p in params)


class CompiledPart:
    """A part's forward through its class's compiled function (or a function through its compiled self); eager
    again (with one warning) if compiling fails."""

    failed: set = set()  # classes and functions whose compilation failed in this process
    compiled: dict = {}  # (class or function, every_dim_dynamic) -> its compiled function

    def __init__(
        self, module: nn.Module | None = None, function=None, name: str | None = None, every_dim_dynamic: bool = False
    ):
        """A norm `module` (its class's forward compiled, once per class), or a `function` (compiled once; a
        function or `kernels`' module of one) named `name`.  Only the token count is dynamic (`token_dims`), the
        widths static; with `every_dim_dynamic`, torch.compile's `dynamic=True` (graphs of their own)."""
        self.module = module
        self.key = type(module) if module is not None else function  # one compiled function per class
        self.name = type(module).__name__ if module is not None else name
        self.eager = module.forward if module is not None else function
        compiled = (self.key, every_dim_dynamic)
        if compiled not in CompiledPart.compiled:  # Dynamo caches on the code, guards on shapes
            compiler_imported()
            code = self.key.forward if module is not None else function
            dynamic = True if every_dim_dynamic else None  # None: Dynamo's choice, with the token count marked
            CompiledPart.compiled[compiled] = torch.compile(code, dynamic=dynamic, options=OPTIONS)
        self.fn = CompiledPart.compiled[compiled]

    def __call__(self, *args, **kwargs):
        key = self.key
        if key not in CompiledPart.failed:
            try:
                for tensor, dim in token_dims(self.module is None, args, kwargs):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
                if self.module is None:
                    return self.fn(*args, **kwargs)
                return self.fn(self.module, *args, **kwargs)
            except Exception as err:  # noqa: BLE001 - a real input error recurs below, eagerly
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(
                    f"torch.compile of {self.name} failed ({type(err).__name__}: {err}); running it as it is",
                    stacklevel=2,
                )
                CompiledPart.failed.add(key)
        return self.eager(*args, **kwargs)


def token_dims(rotary: bool, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """(tensor, dim) of the token count in a part's inputs, as Transformers lays them out: a norm's input [B, N, ...];
    the rotary function's q and k [B, H, N, D] ([B, N, H, D] where it unsqueezes cos and sin at 2) and cos and sin
    [B, N, D].  A dim guessed wrong only costs a graph: Dynamo makes a dimension that changes dynamic itself."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not rotary:
        dims = [(tensors[0], 1 if tensors[0].dim() > 2 else 0)] if tensors else []
    elif len(tensors) >= 4:
        q, k, cos, sin = tensors[:4]
        head_first = kwargs.get("unsqueeze_dim", 1) == 1
        dims = [
            (q, q.dim() - 2 if head_first else 1),
            (k, k.dim() - 2 if head_first else 1),
            (cos, cos.dim() - 2),
            (sin, sin.dim() - 2),
        ]
    else:
        dims = []
    return [(t, d) for t, d in dims if 0 <= d < t.dim()]


@contextlib.contextmanager
def fused(model: nn.Module, parts: list[str], every_dim_dynamic: bool = False):
    """For the block: each part in `parts` runs compiled: a module's forward (an instance attribute, removed
    after); a function, through a forward of its own given to each module of `model` whose forward calls it (taken
    back after: the modeling module and other models are not touched).  Left alone: a norm whose forward is already
    its own (a hook's), and a module calling the function whose forward is its own other than through accelerate's
    hook (`compat.transformers_internals.set_forward`; an enclosing block's, say).  `every_dim_dynamic`: as
    `CompiledPart`'s."""
    modules = [model.get_submodule(name) for name in parts if not name.startswith(FUNCTION)]
    modules = [m for m in modules if "forward" not in vars(m)]  # a forward of its own (a hook's): left alone
    # the modeling modules whose rotary function runs compiled (the one function part there is), and its compiled
    # function once made
    functions = {name[len(FUNCTION) :].rpartition(".")[0]: None for name in parts if name.startswith(FUNCTION)}
    undo, forwards = [], {}
    try:
        for module in modules:
            module.forward = CompiledPart(module, every_dim_dynamic=every_dim_dynamic)
            undo.append(functools.partial(delattr, module, "forward"))
        for module in model.modules() if functions else ():
            cls = type(module)
            if cls.__module__ in functions and cls not in forwards:  # one rebuilt forward per class
                forwards[cls] = _compiled_rotary_forward(cls, functions, every_dim_dynamic)
            restore = set_forward(module, forwards[cls]) if forwards.get(cls) is not None else None
            if restore is not None:
                undo.append(restore)
        with _compiling() if undo else contextlib.nullcontext():
            yield
    finally:
        for restore in reversed(undo):
            restore()


def _compiled_rotary_forward(cls: type, functions: dict, every_dim_dynamic: bool):
    """`cls.forward` calling the compiled rotary function of its modeling module (made once, kept in `functions` by
    the module's name); None where its forward calls none, or cannot be rebuilt."""
    function = rotary_function(cls)
    if function is None:
        return None
    if functions[cls.__module__] is None:
        functions[cls.__module__] = CompiledPart(function=function, name=ROTARY, every_dim_dynamic=every_dim_dynamic)
    return forward_with_global(cls, ROTARY, functions[cls.__module__])


@contextlib.contextmanager
def _compiling():
    """Dynamo's recompile limit raised, and Inductor's builds of the parts' few kernels made in this process: a pool
    of compile workers takes longer to start than the builds it would share (docs/benchmarks/gpu.md, "The first
    call")."""
    with recompile_limit(RECOMPILE_LIMIT), inductor_config.patch(compile_threads=1):
        yield
