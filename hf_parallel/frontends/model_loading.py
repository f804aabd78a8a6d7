"""`--model` of `hf-parallel answer` and `eval`: a model directory, a hub id, or the embedded SmolLM2.

`locate` decides where a name points before transformers is asked, so that a name that leads nowhere
is one clear error at once rather than transformers' minute of retries against an unreachable hub:

    an existing directory        loaded from there
    not a valid hub id           (it starts with . / or ~, or has more than one /, ...): no such directory
    a hub id NAME or ORG/NAME    offline (HF_HUB_OFFLINE=1): from the local Hugging Face cache, else an error;
                                 online: the hub is asked once, with a short timeout; a model it does not
                                 have, or a hub that cannot be reached, falls back to the cache, else an error
"""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub  # lazy itself: its parts load on first use
from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from . import default_model
from .progress import shown, transformers_bars
from .threads import choose_threads

DEFAULT_NAME = "SmolLM2-135M-Instruct"
PROBE_SECONDS = 5.0  # how long the hub may take to say whether it has the model
MODEL_HELP = (
    "a model directory, or a hub id NAME or ORG/NAME (from the local Hugging Face cache when HF_HUB_OFFLINE=1 "
    "or the hub cannot be reached); a name that is no valid hub id (it starts with . / or ~, or has more "
    f"than one /) must be an existing directory (default: the embedded {DEFAULT_NAME})"
)


class ModelSourceError(ValueError):
    """`--model` names nothing that can be loaded; the message says why."""


def placement(device: str | None, dtype: str) -> tuple[str, str]:
    """(device, dtype name) that `--device` and `--dtype` resolve to: device None is cuda when there is one, else
    cpu; dtype "auto" is bfloat16 on CUDA, float32 on the CPU."""
    import torch  # start-up: as in load_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype if dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")


def load_model(name: str | None, dtype, device: str, progress: bool | None = None):
    """(model, tokenizer) of `name` (None: the embedded SmolLM2) in `dtype` (a torch dtype) on `device`, in eval mode.

    progress: the loading's progress bars on stderr; default: when stderr is a terminal.  On the CPU, torch
    computes on the threads `threads.choose_threads` chooses (once per process; a count the user set is kept).
    Raises `ModelSourceError` when the name leads nowhere, the device is not there, or the model cannot be loaded.
    """
    import torch  # start-up: `hf-parallel --help` imports neither torch nor transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ModelSourceError(f"the device {device} is not there: torch sees no CUDA device on this machine")
    source, cache_only = locate(name) if name is not None else (None, True)
    choose_threads(str(device))
    try:
        if source is None:
            return default_model.load_smollm2(dtype, device, progress)
        with transformers_bars(shown(progress)):
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, device_map=device, local_files_only=cache_only
            )
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=cache_only)
    except (OSError, ValueError, ImportError) as error:  # no weights, a missing package, a bad config
        said = " ".join(str(error).split())  # transformers' messages run over several lines
        raise ModelSourceError(f"cannot load the model {name or DEFAULT_NAME}: {said}") from error
    return model.eval(), tokenizer


def locate(name: str) -> tuple[str, bool]:
    """(the directory or hub id to load, whether to read the local cache only), as the module says.

    Raises `ModelSourceError` for a missing directory or a hub id that is neither reachable nor cached.
    """
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelSourceError(f"{name} has no config.json; --model takes a directory that save_pretrained wrote")
    if path.is_dir():
        return str(path), True
    if path.exists():
        raise ModelSourceError(f"{name} is a file; --model takes a model directory or a hub id")
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelSourceError(f"no such directory: {name}") from None
    cached = isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)
    if offline():
        if cached:
            return name, True
        raise ModelSourceError(
            f"{name} is not a directory, and as a hub id it is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); HF_HUB_OFFLINE=1 keeps the hub from being asked"
        )
    problem = _hub_problem(name)
    if problem is None or cached:
        return name, problem is not None
    raise ModelSourceError(f"{name} is not a directory, and as a hub id {problem}")


def offline() -> bool:
    """Whether the hub must not be asked: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set.

    huggingface_hub reads the variable once, at import; a value set since (as the tests set it) counts too.
    """
    said = (os.environ.get(name, "").upper() for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(value in constants.ENV_VARS_TRUE_VALUES for value in said)


def _hub_problem(name: str) -> str | None:
    """None when the hub has the model; else why it cannot be loaded from the hub, as the end of a sentence."""
    try:
        huggingface_hub.model_info(name, timeout=PROBE_SECONDS)
    except RepositoryNotFoundError:
        return "it is neither on the hub nor in the local cache (a private or gated model needs `hf auth login`)"
    except HfHubHTTPError as error:  # the hub is down, or refuses this client
        return f"the hub answered with an error ({error}) and it is not in the local cache"
    except Exception as error:  # the HTTP client's connection errors: their classes change with huggingface_hub
        return f"the hub cannot be reached ({type(error).__name__}: {error}) and it is not in the local cache"
    return None
