"""One evaluation run's configuration, `QualityConfig`, and its command-line flags (one per field)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..attention import BACKENDS
from ..frontends.model_loading import MODEL_HELP
from .loaders import DATASETS

METHODS = ("standard", "parallel", "batch")
ATTENTION = ("auto", *sorted(BACKENDS))
DTYPES = ("float32", "bfloat16", "float16")
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
OFFLINE_DATA = {"squad": "squad-dev-v1.1.json.zip", "drop": "drop-dev.jsonl.gz"}  # QuAC has no offline copy
DOWNLOADS = {  # where each dataset's official file comes from
    "squad": "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v1.1.json",
    "drop": "https://openaipublic.blob.core.windows.net/simple-evals/drop_v0_dev.jsonl.gz",
    "quac": "https://s3.amazonaws.com/my89public/quac/val_v0.2.json",
}


@dataclass
class QualityConfig:
    """One evaluation run; the `eval` command's flags map one-to-one onto these fields."""

    dataset: str = "squad"  # squad | drop | quac
    data: str | None = None  # path or HF dataset name; default: the offline copy in ../shared/data/
    model: str | None = None  # a model directory or hub id; default: the embedded SmolLM2-135M-Instruct
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
    progress: bool | None = None  # bars on stderr (loading, each method's questions); None: when stderr is a terminal

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {sorted(DATASETS)}, got {self.dataset!r}")
        if self.data is None and self.dataset not in OFFLINE_DATA:
            raise ValueError(
                f"{self.dataset} has no offline copy; pass data= (--data FILE), the official val_v0.2.json "
                f"from {DOWNLOADS[self.dataset]}"
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
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.attn not in ATTENTION:
            raise ValueError(f"attn must be one of {', '.join(ATTENTION)}, got {self.attn!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `QualityConfig` field."""
    default = QualityConfig()
    parser.add_argument(
        "--dataset",
        choices=sorted(DATASETS),
        default=default.dataset,
        help="squad (SQuAD v1.1 dev), drop (DROP dev) or quac (QuAC dev, from --data only); default: squad",
    )
    parser.add_argument(
        "--data",
        metavar="FILE_OR_NAME",
        help="the dataset's file, or a `datasets` name (default: the offline copy in ../shared/data/ beside the "
        "repository; QuAC has none)",
    )
    parser.add_argument("--model", metavar="DIR_OR_HUB_ID", help=MODEL_HELP)
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(METHODS), help="default: all three, in this order"
    )
    parser.add_argument(
        "--limit", type=int, metavar="N", help="the first N questions, in whole documents but the last (default: all)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        default=default.max_new_tokens,
        help=f"per answer; batch prompting gets this times the document's questions (default: "
        f"{default.max_new_tokens})",
    )
    parser.add_argument(
        "--standard-batch-size",
        type=int,
        metavar="N",
        default=default.standard_batch_size,
        help="standard prompting: independent prompts per left-padded model.generate call (default: 1)",
    )
    parser.add_argument(
        "--docs-per-call",
        type=int,
        metavar="N",
        default=default.docs_per_call,
        help="parallel prompting: documents packed into one generate_tokens call (default: 1)",
    )
    parser.add_argument(
        "--batch-rows",
        type=int,
        metavar="N",
        default=default.batch_rows,
        help="batch prompting: documents' sequences per left-padded model.generate call (default: 1)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default=default.dtype, help="the model's dtype (default: float32)")
    parser.add_argument("--device", default=default.device, metavar="DEVICE", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument(
        "--attn",
        choices=ATTENTION,
        default=default.attn,
        help="parallel prompting's attention path; auto: triton on CUDA, else reference (default: auto)",
    )
    parser.add_argument(
        "--resamples",
        type=int,
        metavar="N",
        default=default.resamples,
        help=f"paired bootstrap resamples of the F1 difference to standard (default: {default.resamples})",
    )
    parser.add_argument("--seed", type=int, default=default.seed, metavar="N", help="the bootstrap's seed (default: 0)")
    parser.add_argument(
        "--out", metavar="FILE", help="JSON report path; the table goes beside it as .md (default: none)"
    )
    parser.add_argument(
        "--checkpoint",
        metavar="FILE",
        help="JSON-lines file of finished generate calls; run again with the same file, an interrupted run "
        "skips the calls it holds (wall time: the calls' own seconds)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="progress bars on stderr: loading the model, each method's questions (default: when stderr is a terminal)",
    )
