"""A forward's new keys and values written at their slots of the packed cache, both in one launch.

`index_copy_` moves one 2-byte element per thread, in two launches a layer; here a program copies a block of
heads of one token's key and value rows, 16 bytes per thread (docs/benchmarks/kernel.md, "The K/V writes").
"""

import triton
import triton.language as tl


@triton.jit
def write_slots(
    Keys, Values, NewK, NewV, slots_ptr, num_heads,
    stride_ch, stride_cs, stride_vch, stride_vcs, stride_kh, stride_kn, stride_vh, stride_vn,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (tokens, head blocks).  Keys/Values [H, S, D] (strided), NewK/NewV [H, N, D] (strided); token n's row
    of heads goes to slot slots[n]."""
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (heads < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    slot = tl.load(slots_ptr + n).to(tl.int64)
    h = heads.to(tl.int64)[:, None]  # a long cache's H * S * D can pass 2**31
    k = tl.load(NewK + h * stride_kh + n * stride_kn + offs_d[None, :], mask=ok)
    v = tl.load(NewV + h * stride_vh + n * stride_vn + offs_d[None, :], mask=ok)
    tl.store(Keys + h * stride_ch + slot * stride_cs + offs_d[None, :], k, mask=ok)
    tl.store(Values + h * stride_vch + slot * stride_vcs + offs_d[None, :], v, mask=ok)
