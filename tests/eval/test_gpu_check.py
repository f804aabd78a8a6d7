"""eval/gpu_check.py: which tests it runs, how it reads pytest's and the benchmarks' output, and the baseline package it
prepares (a commit's hf_parallel/, importable under another name)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.project import ROOT, eval_module

gpu_check = eval_module("gpu_check")
engine_bench = eval_module("engine_bench")
bench = eval_module("bench")


def test_every_test_file_that_runs_on_cuda_is_a_gpu_test():
    files = set(gpu_check.gpu_test_files())
    for known in ["tests/runner/test_gpu_generation.py", "tests/kernels/test_triton_kernel.py",
                  "tests/row/test_cache_write.py", "tests/runner/test_compile.py"]:  # fmt: skip
        assert known in files
    for path in (ROOT / "tests").rglob("test_*.py"):
        text = path.read_text()
        if re.search(r"\.(cuda|to)\(\"?cuda|device=\"cuda\"\)|torch\.device\(\"cuda", text):
            assert str(path.relative_to(ROOT)) in files, path
    assert "tests/library/test_docs_blocks.py" not in files  # names device_map="cuda" only to skip blocks with it


def test_pytest_summary(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("....F.E\nFAILED tests/a.py::test_x[1] - AssertionError\nERROR tests/b.py::test_y - OOM\n"
                   "= 1 failed, 634 passed, 16 skipped, 1 error in 221.50s (0:03:41) =\n")  # fmt: skip
    got = gpu_check.pytest_summary(log)
    assert got == dict(failed=1, passed=634, skipped=16, error=1, seconds=221.5,
                       failed_tests=["tests/a.py::test_x[1]", "tests/b.py::test_y"])  # fmt: skip


def test_table_puts_each_figure_beside_its_target():
    ab = dict(shape="qwen2.5-7b", new_median_s=1.0, main_median_s=0.97, new_over_main_median=0.97, roofline_s=0.8,
              identical=64, streams=64)  # fmt: skip
    engine = dict(concurrency=64, max_streams=256, output_tokens_per_s=7000.0, of_bound=0.85, bound_tokens_per_s=8235,
                  ttft_p50_s=0.2, ttft_p99_s=1.6, requests_done=512, requests=512, errors=0)  # fmt: skip
    at_once = {**engine, "concurrency": "all", "max_streams": 512, "of_bound": 0.71}
    copy = dict(speculative_s=1.0, plain_s=1.3, speedup=1.3, speculative_tokens_per_s=8000,
                roofline_tokens_per_s=10000, tokens_per_forward=2.5, identical=64, streams=64, k=8)  # fmt: skip
    report = {"parts": {
        "tests": dict(outcome="ok", wall_s=100.0, passed=10, skipped=1, seconds=99.0),
        "ab": dict(outcome="ok", rows=[ab]),
        "engine": dict(outcome="ok", rows=[engine, at_once]),
        "copy": dict(outcome=["ok", "stopped after 45 s"],
                     rows=[{"results": {**copy, "reject": 0.1}}, {"results": {**copy, "reject": 0.3}}]),
    }}  # fmt: skip
    met = {row[0]: row[3] for row in gpu_check.table(report)}
    assert met == {
        "GPU tests, -n auto": "yes",
        "one row, qwen2.5-7b, 8k x 64q x 128": "NO",  # 3% slower than the baseline
        "serving engine, 64 clients, 256 streams": "NO",  # TTFT p99 over 1.5 s
        "serving engine, all at once, 512 streams": "yes",
        "copy, 10% rejected, k=8": "NO",  # under the one-token roofline
        "copy, 30% rejected, k=8": "yes",
        "copy": "NO",  # a run stopped
    }
    failed = {"parts": {"tests": dict(outcome="ok", wall_s=1.0, passed=3, failed=1)}}
    assert gpu_check.table(failed)[0][3] == "NO"


def test_the_serving_bound():
    """At 64 live streams from closed-loop clients the bound is the decode rounds' reads; with every request at once
    at 512 streams, fewer and wider rounds: a higher bound."""
    config = bench.SHAPES["qwen2.5-7b"]()
    ceilings = dict(bandwidth=3e12, matmul=8e14)
    args = (config, 32, 16, 2048, 128, 256)
    clients = engine_bench.bound(*args, 64, True, ceilings)
    at_once = engine_bench.bound(*args, 512, False, ceilings)
    weights = 2 * sum(bench.linear_params(config))
    assert clients["bound_round_gb"] * 1e9 > weights
    rounds = 512 * 255 / 64
    assert clients["bound_decode_s"] == pytest.approx(rounds * clients["bound_round_gb"] * 1e9 / 3e12, rel=1e-2)
    assert 0.5 * at_once["bound_s"] < at_once["bound_prefill_s"] + 512 * 255 / 512 * 0.03
    assert at_once["bound_tokens_per_s"] > 2 * clients["bound_tokens_per_s"]
    one_group = engine_bench.bound(config, 1, 64, 2048, 128, 256, 64, True, ceilings)  # every stream shares one
    assert one_group["bound_round_gb"] < clients["bound_round_gb"]


def test_prepare_exports_an_importable_baseline(tmp_path, monkeypatch):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    data = tmp_path / "data"
    data.mkdir()
    (data / gpu_check.BOOK).write_bytes(b"not read")
    monkeypatch.setattr(gpu_check, "CARRY", tmp_path / "carry")
    gpu_check.prepare("HEAD", data)
    pkgs = tmp_path / "carry" / "pkgs"
    assert (pkgs / "BASELINE").read_text().strip()
    code = "import hf_parallel_main, sys; print(hf_parallel_main.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(pkgs)},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert Path(out.stdout.strip()).is_relative_to(pkgs)
    assert (tmp_path / "carry" / "data" / gpu_check.BOOK).read_bytes() == b"not read"
