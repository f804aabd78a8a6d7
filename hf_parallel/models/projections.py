"""Sibling linear layers that read the same input, run as one GEMM.

A decode step's GEMMs have a few rows each, so each is bound by reading its weight, and cuBLAS reads a small
weight further below the copy bandwidth than one the size of q|k|v together (docs/benchmarks/kernel.md, "Where a decode
step's time goes").  An attention module calls `q_proj`, `k_proj` and `v_proj` on one hidden state: such a group
of plain `nn.Linear` children gets one weight [sum of out_features, in_features], and its members' parameters
become row slices of it (the same objects, names and values; `save_pretrained` saves disjoint slices as tensors
of their own), once: later calls find them adjacent and view the whole.  For the block, the first member called
computes every member's output in one GEMM and each later member takes its own; a member called on another
input, or a second time, runs the group's GEMM again, so every call returns exactly its own output.  An input of
more than `MOST_ROWS` rows (a prefill chunk) runs each member's own GEMM, whose output fills its columns of one
tensor, so that its outputs are strided as a narrow input's: a function compiled downstream (the rotary
embedding, `hf_parallel.models.compiled_parts`) then compiles one graph for both, not a second one for other
strides (docs/benchmarks/gpu.md, "The first call").  Compiled code runs each member's `F.linear`.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

SIBLINGS = (("q_proj", "k_proj", "v_proj"),)  # children called in turn on one input.  Not a gated MLP's gate_proj
# and up_proj: their GEMM gains little, and the activation and product on the two strided halves run PyTorch's
# unvectorized elementwise kernels, which cost more than the GEMM saves (docs/benchmarks/kernel.md, "q, k and v as
# one GEMM")
MOST_ROWS = 256  # inputs of more rows run each member's own GEMM: a wide prefill chunk's GEMMs are bound by their
# arithmetic, not their reads, and grouped they prefill slower (docs/benchmarks/kernel.md, "q, k and v as one
# GEMM")


class ProjectionGroup:
    """Members [nn.Linear] whose weights (and biases) are adjacent row slices of one weight [O, I] (bias [O])."""

    def __init__(self, members: list[nn.Linear], columns: bool = True):
        """`columns`: a wide input's outputs as columns of one tensor (`outputs`); False: each a tensor of its own."""
        self.members, self.columns = members, columns
        self.sizes = [m.out_features for m in members]
        self.weight = _joined([m.weight for m in members])
        self.bias = _joined([m.bias for m in members]) if members[0].bias is not None else None
        if self.weight is None or (members[0].bias is not None and self.bias is None):
            self.weight, self.bias = _join(members)
        self.pending: tuple[torch.Tensor, list] | None = None  # (input, the members' outputs not yet taken)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output on `x`: from the pending GEMMs on the same input, else from new ones."""
        if torch.compiler.is_compiling():
            member = self.members[index]
            return F.linear(x, member.weight, member.bias)
        if self.pending is None or self.pending[0] is not x or self.pending[1][index] is None:
            self.pending = (x, self.outputs(x))
        outputs = self.pending[1]
        out, outputs[index] = outputs[index], None
        if all(o is None for o in outputs):
            self.pending = None
        return out

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's output on `x`, each a column slice of one [..., O] tensor: one GEMM over the group's
        weight, or for an input of more than `MOST_ROWS` rows each member's own GEMM into its columns (with biases,
        into a tensor of its own, then copied there; without `columns`, each output a tensor of its own)."""
        if one_gemm(x):
            return list(F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
        if not self.columns:
            return [F.linear(x, m.weight, m.bias) for m in self.members]
        if self.bias is not None or x.dtype != self.weight.dtype or torch.is_autocast_enabled(x.device.type):
            # `addmm` into a column slice adds the bias apart from cuBLAS's epilogue: other roundings, and slower than
            # `F.linear` and a copy (docs/benchmarks/gpu.md, "The first call").  (`out=` takes no casts either.)
            return list(torch.cat([F.linear(x, m.weight, m.bias) for m in self.members], dim=-1).split(self.sizes, -1))
        out = x.new_empty(*x.shape[:-1], sum(self.sizes))
        rows, columns = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1]).split(self.sizes, dim=-1)
        for member, cols in zip(self.members, columns):  # cuBLAS writes a column slice in place (its row stride)
            torch.mm(rows, member.weight.t(), out=cols)
        return list(out.split(self.sizes, dim=-1))


def one_gemm(x: torch.Tensor) -> bool:
    """Whether a group runs one GEMM over its weight on input `x`: at most `MOST_ROWS` rows."""
    return x.numel() <= MOST_ROWS * x.shape[-1]


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor `tensors` are adjacent slices of, in order (a view), or None where they are not."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def _join(members: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One new weight (and bias) holding the members', which become its slices: same parameters, same values."""
    sizes = [m.out_features for m in members]
    with torch.inference_mode(False), torch.no_grad():  # plain tensors: the model may be trained after
        weight = torch.cat([m.weight for m in members])
        bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
        for i, m in enumerate(members):
            m.weight.data = weight.split(sizes)[i]
            if bias is not None:
                m.bias.data = bias.split(sizes)[i]
    return weight.detach(), bias.detach() if bias is not None else None


def sibling_groups(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(parent, child names) of every group of siblings in `model` that can share a weight: plain `nn.Linear`
    children, no hooks, on one device, of one dtype and input size, all with a bias or none, no weight shared."""
    modules = list(model.modules())
    uses = Counter(id(p) for m in modules for p in m._parameters.values() if p is not None)  # a module's own, in C
    found = []
    for parent in modules:
        for names in SIBLINGS:
            if not all(n in parent._modules for n in names):  # children are registered there (quicker than getattr)
                continue
            members = [parent._modules[n] for n in names]
            if all(_plain(m, uses) for m in members) and _alike(members):
                found.append((parent, names))
    return found


def _plain(m, uses: Counter) -> bool:
    return (
        type(m) is nn.Linear
        and not (m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"))
        and "forward" not in vars(m)
        and all(uses[id(p)] == 1 for p in m.parameters())
        and type(m.weight.data) is torch.Tensor
        and m.weight.device.type != "meta"
    )


def _alike(members: list[nn.Linear]) -> bool:
    first = members[0]
    return all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in members
    )


@contextlib.contextmanager
def grouped(model: nn.Module, enabled: bool = True, columns: bool = True):
    """For the block: each group of sibling projections in `model` computed by one GEMM (see the module's
    docstring); with `enabled` false, nothing changes.  `columns`: as `ProjectionGroup`'s."""
    groups = (
        [ProjectionGroup([getattr(parent, n) for n in names], columns) for parent, names in sibling_groups(model)]
        if enabled
        else []
    )
    for group in groups:
        for index, member in enumerate(group.members):
            member.forward = functools.partial(group.output, index)
    try:
        yield
    finally:
        for group in groups:
            group.pending = None
            for member in group.members:
                del member.forward
