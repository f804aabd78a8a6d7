"""Budgets for a row of a chosen size, from the sizing's own arithmetic."""

from __future__ import annotations

from hf_parallel.frontends.probe import check_support
from hf_parallel.runner.sizing import size_row

CHUNK = 16


def max_memory_for(model, capacity: int, chunk: int = CHUNK) -> int:
    """The smallest max_memory whose row holds `capacity` slots (bisection over the budget's own arithmetic)."""
    support, lo, hi = check_support(model), 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            fits = size_row(model, support, chunk, mid).capacity >= capacity
        except ValueError:
            fits = False
        lo, hi = (lo, mid) if fits else (mid + 1, hi)
    return lo
