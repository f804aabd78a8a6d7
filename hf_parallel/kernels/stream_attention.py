"""Stream-id attention: the stream mask evaluated in-kernel, KV tiles visited by a per-forward plan.

A program owns one row tile of one KV head (and one KV split): BLOCK_M rows, each a
(query, query head of this KV head) pair, so every KV tile it loads serves all the
GQA heads and all the streams packed into the tile at once.  It visits only the KV
slot ranges the plan lists for its tile (CSR: `range_ptr` into `ranges`), an own segment's
end clipped at run time to the last slot its queries may see.  A range is a chain of segments
down the prefix tree, so what a row sees of it is a prefix, given by the plan (`limits`), of
which an ancestor's slots are seen wherever they lie and the row's own segment's causally by
slot.  The own segment is one slot range [start, seg_stop[q_seg]) holding q_slot, and an
ancestor's slots lie outside it, so the rule is one load per row, none per key:
k < limit and (k <= q_slot or k >= seg_stop[q_seg]) (and q_pos - slot_pos[k] < window).  The
interleaved layout's answer range is strided; there the stream-id rule is evaluated from
the slot ids:  slot_seg[k] <= q_seg < seg_end[slot_seg[k]].

A tile's first range usually holds a document that every row sees whole: its leading KV blocks
that no row's rule masks run first, in a loop of their own with no mask to build or apply (the
tutorial's unmasked stage); the general loop takes the rest.

Online softmax as in Triton's 06-fused-attention tutorial (base-2 exponentials).  With
several KV splits per tile (flash-decoding), each split writes its normalized partial
output and log-sum-exp and `combine_splits` merges them.  Attention sinks (gpt-oss: one
logit per query head, a virtual key with no value) start the first split's running
softmax: m_i = sink, l_i = 1, acc = 0.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # tanh from exp (libdevice names differ across Triton versions and the interpreter)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_ranges(first, last, ranges_ptr, q_slot_ptr, kv_len, BLOCK_N: tl.constexpr, RANGES: tl.constexpr):
    """Ranges first..last-1 (at most RANGES) at once: start, clipped stop, by_ids, first flat KV block, blocks."""
    idx = first + tl.arange(0, RANGES)
    ok = idx < last
    start = tl.load(ranges_ptr + idx * 4, mask=ok, other=0)
    stop = tl.load(ranges_ptr + idx * 4 + 1, mask=ok, other=0)
    clip = tl.load(ranges_ptr + idx * 4 + 2, mask=ok, other=-1)
    by_ids = tl.load(ranges_ptr + idx * 4 + 3, mask=ok, other=0)
    clip_stop = (tl.load(q_slot_ptr + tl.maximum(clip, 0), mask=ok, other=0) + 1).to(tl.int32)
    stop = tl.where(clip >= 0, tl.minimum(stop, clip_stop), stop)  # an own segment: up to its query
    stop = tl.minimum(stop, kv_len)
    blocks = tl.maximum(stop - start + BLOCK_N - 1, 0) // BLOCK_N
    first_block = tl.cumsum(blocks, 0) - blocks
    return start, stop, by_ids, first_block, blocks


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, start, stop, limit, by_ids, K, V, stride_kn, stride_vn,
    slot_seg_ptr, slot_pos_ptr, seg_end_ptr, q_slot, q_seg, q_pos, own_stop,
    scale, softcap, window, offs_d, d_ok,
    BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Fold keys [start, min(start + BLOCK_N, stop)) into the running softmax of every row (not MASKED: a block
    every row sees whole, below stop: no mask)."""
    # -- load one KV tile --
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < stop
    if MASKED:
        k = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    if DOT_F32:  # triton-lang/triton#11584: the interpreter's tl.dot multiplies bf16 bit patterns
        k, v = k.to(tl.float32), v.to(tl.float32)
    # -- scores in log2 units --
    qk = tl.dot(q, k, input_precision=PRECISION)
    if USE_SOFTCAP:
        qk = _tanh(qk * (scale / softcap)) * (softcap * LOG2E)
    else:
        qk = qk * (scale * LOG2E)
    if MASKED:
        # -- visibility: a prefix of the range per row (from the plan), the own segment causal, sliding window --
        causal = (offs_n[None, :] <= q_slot[:, None]) | (offs_n[None, :] >= own_stop[:, None])
        visible = (offs_n[None, :] < limit[:, None]) & causal & n_ok[None, :]
        if by_ids:  # strided (interleaved answers): the stream-id rule itself, from the slot ids
            k_seg = tl.load(slot_seg_ptr + offs_n, mask=n_ok, other=-1)
            k_end = tl.load(seg_end_ptr + tl.maximum(k_seg, 0), mask=n_ok, other=0)
            visible &= (k_seg[None, :] <= q_seg[:, None]) & (q_seg[:, None] < k_end[None, :]) & (k_seg[None, :] >= 0)
        if USE_WINDOW:
            k_pos = tl.load(slot_pos_ptr + offs_n, mask=n_ok, other=0)
            visible &= (q_pos[:, None] - k_pos[None, :]) < window
        qk = tl.where(visible, qk, float("-inf"))
    # -- online softmax update (a row that has seen nothing yet keeps m_i = -inf) --
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_ij, l_i


@triton.jit(do_not_specialize=["kv_len", "num_queries", "num_splits", "split_offset", "window"])  # change per step
def stream_attention_fwd(
    Q, K, V, Out, PartO, PartLse, Sinks,
    q_slot_ptr, q_seg_ptr, q_pos_ptr, slot_seg_ptr, slot_pos_ptr, seg_end_ptr, seg_stop_ptr,
    tile_query_ptr, range_ptr, ranges_ptr, limits_ptr,
    stride_qh, stride_qn, stride_kh, stride_kn, stride_vh, stride_vn, stride_on, stride_oh,
    kv_len, num_queries, num_heads, num_splits, split_offset, scale, softcap, window,
    GROUP: tl.constexpr, QUERIES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    RANGES: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    USE_SINKS: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
):  # fmt: skip
    """Grid (row tiles, KV heads, KV splits).  Q [H, N, D], K/V [H_kv, kv_len, D] (strided), Out [N, H, D],
    Sinks [H] float32 (read only with USE_SINKS).  With SPLIT, split s writes partial output split_offset + s
    (a second launch over other ranges of the same rows writes after the first's)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # -- rows of this tile: (query, head of the group) pairs --
    offs_m = tl.arange(0, BLOCK_M)
    member = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    query = tl.load(tile_query_ptr + tile * QUERIES + member, mask=member < QUERIES, other=-1)
    row_ok = query >= 0
    q_slot = tl.load(q_slot_ptr + query, mask=row_ok, other=-1).to(tl.int32)  # int32 keeps the masks small
    q_seg = tl.load(q_seg_ptr + query, mask=row_ok, other=-1)
    q_pos = tl.load(q_pos_ptr + query, mask=row_ok, other=0)
    own_stop = tl.load(seg_stop_ptr + q_seg, mask=row_ok, other=0)  # one past the own segment's last slot
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        Q + head[:, None] * stride_qh + query[:, None] * stride_qn + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    K += kv_head.to(tl.int64) * stride_kh  # int64: a long cache's H_kv * S * D can pass 2**31
    V += kv_head.to(tl.int64) * stride_vh
    # -- online softmax over the tile's ranges, RANGES at a time; split s takes every num_splits-th KV block --
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:  # the sink is one more logit of the softmax, counted once: in the first split
        sink = tl.load(Sinks + head) * LOG2E
        m_i = tl.where(split + split_offset == 0, sink, m_i)
        l_i = tl.where(split + split_offset == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    first_range = tl.load(range_ptr + tile)
    last_range = tl.load(range_ptr + tile + 1)
    # -- the first range's leading blocks that every row sees whole, unmasked: flat blocks 0 .. whole - 1 --
    whole = split * 0
    if WHOLE_BLOCKS and not USE_WINDOW:
        r_start, r_stop, r_by_ids, _, _ = _load_ranges(
            first_range, last_range, ranges_ptr, q_slot_ptr, kv_len, BLOCK_N, RANGES
        )
        is_first = tl.arange(0, RANGES) == 0
        start0 = tl.sum(tl.where(is_first, r_start, 0), 0)
        stop0 = tl.sum(tl.where(is_first, r_stop, 0), 0)  # 0 for a tile with no range
        plain = tl.sum(tl.where(is_first, r_by_ids, 0), 0) == 0
        has_range = (member * 0 + first_range) < last_range  # per row: the interpreter takes no scalar in a mask
        limit0 = tl.load(limits_ptr + first_range * QUERIES + member, mask=row_ok & has_range, other=0)
        # a row sees the keys below its limit up to its own slot, and all of them where its own segment ends first
        seen = tl.where(start0 >= own_stop, limit0, tl.minimum(limit0, q_slot + 1))
        seen_by_all = tl.min(tl.where(row_ok, seen, stop0), 0)
        whole = tl.where(plain, tl.maximum(tl.minimum(stop0, seen_by_all) - start0, 0) // BLOCK_N, 0)
        for b in range(split, whole, num_splits):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, start0 + b * BLOCK_N, stop0, limit0, False, K, V, stride_kn, stride_vn,
                slot_seg_ptr, slot_pos_ptr, seg_end_ptr, q_slot, q_seg, q_pos, own_stop,
                scale, softcap, window, offs_d, d_ok, BLOCK_N, USE_WINDOW, USE_SOFTCAP, PRECISION, DOT_F32, False,
            )  # fmt: skip
    blocks_before = split * 0  # KV blocks of earlier chunks of ranges (a runtime int32 loop carry)
    for chunk in range(first_range, last_range, RANGES):
        r_start, r_stop, r_by_ids, r_first, r_blocks = _load_ranges(
            chunk, last_range, ranges_ptr, q_slot_ptr, kv_len, BLOCK_N, RANGES
        )
        r_idx = tl.arange(0, RANGES)
        total = tl.sum(r_blocks, 0)
        # split s takes the flat blocks b = s (mod num_splits), past the whole ones in the first chunk
        lowest = (split - blocks_before % num_splits + num_splits) % num_splits
        skip = tl.where(chunk == first_range, whole, 0)
        lowest += tl.cdiv(tl.maximum(skip - lowest, 0), num_splits) * num_splits
        # the flat block b lies in range r = (number of ranges ending at or before b): no loads on the way
        for b in range(lowest, total, num_splits):
            r = tl.sum((r_first + r_blocks <= b).to(tl.int32), 0)
            start = tl.sum(tl.where(r_idx == r, r_start + (b - r_first) * BLOCK_N, 0), 0)
            stop = tl.sum(tl.where(r_idx == r, r_stop, 0), 0)
            by_ids = tl.sum(tl.where(r_idx == r, r_by_ids, 0), 0)
            limit = tl.load(limits_ptr + (chunk + r) * QUERIES + member, mask=row_ok, other=0)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, start, stop, limit, by_ids != 0, K, V, stride_kn, stride_vn,
                slot_seg_ptr, slot_pos_ptr, seg_end_ptr, q_slot, q_seg, q_pos, own_stop,
                scale, softcap, window, offs_d, d_ok, BLOCK_N, USE_WINDOW, USE_SOFTCAP, PRECISION, DOT_F32, True,
            )  # fmt: skip
        blocks_before += total
    # -- epilogue: no real row sees nothing, but guard l_i == 0 (empty rows of a tile, empty splits) --
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    store_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        flat = ((split + split_offset) * num_queries + query) * num_heads + head
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(PartLse + flat, lse, mask=row_ok)
        tl.store(PartO + flat[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_ok)
    else:
        o_ptr = Out + query[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=store_ok)


@triton.jit
def combine_splits(
    PartO, PartLse, Out, num_rows, num_heads, num_splits, stride_on, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Merge the KV splits' partial outputs [splits, N * H, D] and LSEs [splits, N * H] into Out [N, H, D]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    offs_d = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        # -- fold split s in, weighted by its share of the softmax mass --
        lse = tl.load(PartLse + s * num_rows + rows, mask=row_ok, other=float("-inf"))
        o = tl.load(PartO + (s * num_rows + rows)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
        m_ij = tl.maximum(m_i, lse)
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m_i = m_ij
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    query, head = rows // num_heads, rows % num_heads
    tl.store(
        Out + query[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=ok,
    )
