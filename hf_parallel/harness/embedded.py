"""The embedded SmolLM2-135M-Instruct as a model directory, which `--model hf` and `--model hf-parallel` both load.

The harness's own backend loads `pretrained=` a directory; transformers does not save a model loaded from GGUF,
so its dequantized float32 weights go into a fresh model of the same config, saved as safetensors, every file
readable as the umask allows (`frontends.default_model.save_model_dir`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..frontends.default_model import load_smollm2, save_model_dir

__all__ = ["embedded_model_dir", "save_model_dir"]


def embedded_model_dir(folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """`folder` holding the embedded SmolLM2 in `dtype`, written there unless it already holds a model."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        save_model_dir(*load_smollm2(dtype), folder)
    return folder
