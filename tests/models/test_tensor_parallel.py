"""Tensor parallelism: a tiny Llama loaded with `tp_plan="auto"` under `torchrun` (two ranks, gloo on the CPU,
NCCL on two GPUs) answers with hf_parallel as `model.generate` does under the same sharding, on every rank, with
each rank's cache holding its local KV heads only (tests/helpers/tensor_parallel_check.py runs on each rank)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import transformers

from tests.helpers.models import VOCAB
from tests.helpers.project import ROOT

SCRIPT = ROOT / "tests" / "helpers" / "tensor_parallel_check.py"
RANKS = 2
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory) -> str:
    """A tiny random fp32 Llama, 4 query heads and 2 KV heads (each splits over two ranks), saved for the ranks."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                      initializer_range=0.2)  # fmt: skip
    path = tmp_path_factory.mktemp("tp") / "tiny-llama"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


def _run_ranks(path: str, attns: list[str], env: dict | None = None) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}",
               f"--master_port={_free_port()}", str(SCRIPT), path, *attns]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    verdicts = re.findall(r"^VERDICT .*$", done.stdout, flags=re.MULTILINE)
    assert done.returncode == 0 and verdicts, f"torchrun failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return verdicts


def _assert_all_ok(verdicts: list[str], attns: list[str]) -> None:
    assert len(verdicts) == RANKS * len(attns), verdicts
    for line in verdicts:
        assert line.endswith(" ok") and "tp=True heads=2/1" in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; GPUs run test_tensor_parallel_on_gpus")
def test_tensor_parallel_on_the_cpu(sharded_llama):
    attns = ["reference", "triton"]  # Triton under its interpreter
    _assert_all_ok(_run_ranks(sharded_llama, attns, {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}), attns)


@pytest.mark.skipif(torch.cuda.device_count() < RANKS, reason="needs two GPUs")
def test_tensor_parallel_on_gpus(sharded_llama):
    attns = ["reference", "triton"]
    _assert_all_ok(_run_ranks(sharded_llama, attns, {"NVIDIA_TF32_OVERRIDE": "0"}), attns)
