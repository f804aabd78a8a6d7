"""The embedded SmolLM2-135M-Instruct as a model directory, which `--model hf` and `--model hf-parallel` both load.

The harness's own backend loads `pretrained=` a directory; transformers does not save a model loaded from GGUF,
so its dequantized float32 weights go into a fresh model of the same config, saved as safetensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..frontends.default_model import load_smollm2


def save_model_dir(model: PreTrainedModel, tokenizer, folder: str | Path) -> Path:
    """Write `model` (GGUF-loaded or not) and `tokenizer` to `folder` with save_pretrained; returns the folder."""
    folder = Path(folder)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF marker, which keeps transformers from saving
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def embedded_model_dir(folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """`folder` holding the embedded SmolLM2 in `dtype`, written there unless it already holds a model."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        save_model_dir(*load_smollm2(dtype), folder)
    return folder
