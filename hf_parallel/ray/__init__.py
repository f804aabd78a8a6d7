"""hf_parallel on a Ray cluster (the `ray` extra): `Answerer`, a stage for Ray Data's `Dataset.map_batches`, and the
corpus run of `hf-parallel answer --corpus IN --out OUT --ray` (`corpus`).

`import hf_parallel` does not import this package, and this package imports ray only where a cluster is used:
`Answerer` answers batches handed to it without ray, as Ray Data's actors hand them.
"""

from __future__ import annotations

from .answerer import Answerer

__all__ = ["Answerer"]
