"""One evaluation run's configuration, `QualityConfig`, and its command-line flags (one per field)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from .loaders import DATASETS

METHODS = ("standard", "parallel", "batch")
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
OFFLINE_DATA = {"squad": "squad-dev-v1.1.json.zip", "drop": "drop-dev.jsonl.gz"}  # QuAC has no offline copy


@dataclass
class QualityConfig:
    """One evaluation run; the `eval` command's flags map one-to-one onto these fields."""

    dataset: str = "squad"  # squad | drop | quac
    data: str | None = None  # path or HF dataset name; default: the offline copy in ../shared/data/
    methods: tuple[str, ...] = METHODS
    limit: int | None = None  # questions (whole documents, the last one truncated)
    max_new_tokens: int = 32  # per answer; batch prompting gets this times the document's questions
    standard_batch_size: int = 1  # independent prompts per left-padded model.generate call
    docs_per_call: int = 1  # documents packed into one generate_tokens call
    batch_rows: int = 1  # batch-prompting sequences (documents) per left-padded model.generate call
    dtype: str = "float32"
    device: str = "cpu"
    attn: str = "auto"  # generate_tokens' attention path
    resamples: int = 1000  # paired bootstrap resamples
    seed: int = 0
    out: str | None = None  # JSON path (a .md table is written beside it)
    checkpoint: str | None = None  # JSON-lines file of finished generate calls: an interrupted run resumes from it

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {self.dataset!r}")
        if self.data is None and self.dataset not in OFFLINE_DATA:
            raise ValueError(
                f"{self.dataset} has no offline copy; pass data= (--data FILE), the official val_v0.2.json"
            )
        self.data = self.data or str(SHARED_DATA / OFFLINE_DATA[self.dataset])
        self.methods = tuple(dict.fromkeys(self.methods))
        if not self.methods or not set(self.methods) <= set(METHODS):
            raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {self.methods}")
        for name in ("max_new_tokens", "standard_batch_size", "docs_per_call", "batch_rows", "resamples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `QualityConfig` field."""
    default = QualityConfig()
    parser.add_argument("--dataset", choices=sorted(DATASETS), default=default.dataset)
    parser.add_argument("--data", help="dataset file or HF name (default: the offline copy in ../shared/data/)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--limit", type=int, help="number of questions (whole documents, the last one cut)")
    parser.add_argument("--max-new-tokens", type=int, default=default.max_new_tokens)
    parser.add_argument("--standard-batch-size", type=int, default=default.standard_batch_size)
    parser.add_argument("--docs-per-call", type=int, default=default.docs_per_call)
    parser.add_argument(
        "--batch-rows",
        type=int,
        default=default.batch_rows,
        help="batch-prompting sequences per left-padded model.generate call",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=default.dtype)
    parser.add_argument("--device", default=default.device, help="cpu or cuda[:N]")
    parser.add_argument("--attn", default=default.attn, help="generate_tokens' attention path")
    parser.add_argument("--resamples", type=int, default=default.resamples)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--out", help="JSON report path; the table goes beside it as .md")
    parser.add_argument(
        "--checkpoint",
        help="JSON-lines file of finished generate calls; run again with the same "
        "file, an interrupted run skips the calls it holds (wall time: the calls' own seconds)",
    )
