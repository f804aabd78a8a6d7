"""The packed cache's Triton K/V write against `index_copy_`, the write it replaces.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by conftest) on small shapes; on
CUDA at a 7B model's (and through `write_slots`, the path the cache takes).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hf_parallel.row import cache  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SLOTS = 9000 if CUDA else 50
SHAPES = [(32, 128), (4, 128), (2, 80), (1, 64), (40, 256)] if CUDA else [(2, 16), (3, 20), (1, 8)]


def _states(heads, n, dim, dtype, layout):
    """New keys and values [1, H, N, D]: contiguous, or a transposed [1, N, H, D] as attention modules pass them."""
    if layout == "transposed":
        return [torch.randn(1, n, heads, dim, dtype=dtype, device=DEVICE).transpose(1, 2) for _ in range(2)]
    return [torch.randn(1, heads, n, dim, dtype=dtype, device=DEVICE) for _ in range(2)]


@pytest.mark.parametrize("heads,dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("n", [1, 7, 256] if CUDA else [1, 7])
def test_the_kernel_writes_what_index_copy_writes(heads, dim, dtype, layout, n):
    torch.manual_seed(n * dim + heads)
    keys = torch.randn(1, heads, SLOTS, dim, dtype=dtype, device=DEVICE)
    values = torch.randn_like(keys)
    slots = torch.randperm(SLOTS, device=DEVICE)[:n]
    new_k, new_v = _states(heads, n, dim, dtype, layout)
    want_k, want_v = keys.clone().index_copy_(2, slots, new_k), values.clone().index_copy_(2, slots, new_v)
    cache.launch_write_slots(keys, values, slots, new_k, new_v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


@pytest.mark.parametrize("n", [8192, 64] if CUDA else [40])
def test_a_prefill_chunk_and_repeated_padding_slots_are_written_whole(n):
    """A chunk of consecutive slots, and a captured step's padding rows (the last live row's slot repeated with
    the same key and value)."""
    heads, dim = (32, 128) if CUDA else (2, 16)
    keys = torch.zeros(1, heads, SLOTS + n, dim, dtype=torch.bfloat16, device=DEVICE)
    values = torch.zeros_like(keys)
    slots = torch.arange(5, 5 + n, device=DEVICE)
    slots[-3:] = slots[-4]
    new_k, new_v = _states(heads, n, dim, torch.bfloat16, "transposed")
    new_k[:, :, -3:], new_v[:, :, -3:] = new_k[:, :, -4:-3], new_v[:, :, -4:-3]
    want_k, want_v = keys.clone().index_copy_(2, slots, new_k), values.clone().index_copy_(2, slots, new_v)
    cache.launch_write_slots(keys, values, slots, new_k, new_v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


@pytest.mark.skipif(not CUDA, reason="the cache takes the kernel on CUDA only")
def test_the_cache_write_takes_the_kernel_on_cuda(monkeypatch):
    launches = []
    monkeypatch.setattr(cache, "launch_write_slots", lambda *args: launches.append(args))
    keys = torch.zeros(1, 2, 10, 16, dtype=torch.bfloat16, device=DEVICE)
    new = torch.ones(1, 2, 3, 16, dtype=torch.bfloat16, device=DEVICE)
    cache.write_slots(keys, keys.clone(), torch.arange(3, device=DEVICE), new, new)
    assert len(launches) == 1


def test_the_cache_writes_with_index_copy_off_cuda_and_for_mismatched_dtypes():
    keys = torch.zeros(1, 2, 10, 16, dtype=torch.bfloat16, device=DEVICE)
    values = keys.clone()
    new = torch.ones(1, 2, 3, 16, dtype=torch.bfloat16, device=DEVICE)
    cache.write_slots(keys, values, torch.tensor([1, 4, 7], device=DEVICE), new, new)
    assert keys[0, :, [1, 4, 7]].eq(1).all() and keys.sum() == 2 * 3 * 16 and torch.equal(keys, values)
    with pytest.raises(RuntimeError):  # index_copy_'s own error, as before the kernel
        cache.write_slots(keys, values, torch.tensor([1], device=DEVICE), new[:, :, :1].float(), new[:, :, :1].float())
