"""Continuous refill's admission policy (`hf_parallel.engine.admission`) on its own, without a model."""

from __future__ import annotations

from hf_parallel.engine.admission import Admission
from hf_parallel.engine.budget import RowBudget
from hf_parallel.row.forest import Forest


def test_a_full_row_does_not_try_every_waiting_document(monkeypatch):
    """Once a document cannot start, the documents after it wait: an admission round costs a few placements,
    not one per waiting document (a corpus of thousands)."""
    prompts = [[1000 + d] * 30 + [7] for d in range(500)]  # 500 documents of one question each
    admission = Admission(prompts, [[d] for d in range(500)], room=10, budget=RowBudget(100, 4096, 0))
    first = admission.admit(live=0)
    assert [index for index, _ in first] == [0, 1]  # two fit (41 slots each), in input order
    tries = []
    admit = Forest.admit
    monkeypatch.setattr(Forest, "admit", lambda self, *a, **k: tries.append(a[0]) or admit(self, *a, **k))
    assert admission.admit(live=2) == []  # 18 slots free: due, but no document fits
    assert tries == [2, 2]  # the next document, once more after freeing unused prefixes; none after it
    assert [g[0] for g in admission.waiting][:3] == [2, 3, 4]
