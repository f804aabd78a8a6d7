"""Continuous refill's admission policy (`hf_parallel.engine.policies.Refill`) on its own, without a model."""

from __future__ import annotations

import itertools

from hf_parallel.engine.policies import Refill
from hf_parallel.engine.streams import Request
from hf_parallel.row.prefix_tree import PrefixTree
from hf_parallel.runner.sizing import RowSize


def test_a_full_row_does_not_try_every_waiting_document():
    """Once a document cannot start, the documents after it wait: an admission round costs a few placements,
    not one per waiting document (a corpus of thousands)."""
    policy, keys = Refill(RowSize(100, 4096, 0)), itertools.count()
    memory = PrefixTree(100)
    for d in range(500):  # 500 documents of one question each
        request = Request([1000 + d] * 30 + [7], None, 1, 10, document=d)
        request.make_streams(keys)
        policy.add(request)
    first = policy.admit(memory, live=0)
    assert [r.streams[0].key for r in first] == [0, 1]  # two fit (41 slots each), in input order
    tries = policy.stats.placements
    assert policy.admit(memory, live=2) == []  # 18 slots free: due, but no document fits
    assert policy.stats.placements - tries == 2  # the next document, again after freeing unused prefixes; no later one
    assert [d[0].streams[0].key for d in policy.documents][:3] == [2, 3, 4]
