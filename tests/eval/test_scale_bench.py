"""eval/scale_bench.py on the CPU: each mode's code path on the tiny fp32 shape, hf_parallel's answers equal to stock
Transformers' (greedy, fp32), and the report's figures.  The GPU runs themselves wait for a machine with several GPUs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.project import ROOT, eval_module

SCRIPT = ROOT / "eval" / "scale_bench.py"
scale = eval_module("scale_bench")

SMALL = ["--shape", "tiny", "--doc", "40", "--answer", "6", "--stock-chunk", "2"]


def _check_methods(report: dict, answers: int) -> None:
    assert set(report["methods"]) == {"hf_parallel", "stock"}
    for method in report["methods"].values():
        assert method["wall_s"] > 0 and method["tokens_per_s"] > 0 and method["roofline_fraction"] > 0
    assert report["answers"] == answers and report["answers_equal"] == answers  # greedy fp32: token for token
    assert report["answer_tokens"] == answers * 6 and report["distinct_tokens"] > 1  # a model, not zeros
    assert report["roofline_s"] == pytest.approx(report["roofline_prefill_s"] + report["roofline_decode_s"])


def _written(out: Path, stem: str, report: dict | None = None) -> dict:
    saved = json.loads((out / f"{stem}.json").read_text())
    assert report is None or saved == json.loads(json.dumps(report))
    assert (out / f"{stem}.md").read_text().startswith(("placement", "tp", "| processes"))
    return saved


def test_placement_on_the_cpu(tmp_path, capsys):
    """Every block its own entry of a CPU map, dispatched with accelerate's hooks; 5 questions in chunks of 2."""
    report = scale.main(["--mode", "placement", *SMALL, "--questions", "5", "--out", str(tmp_path)])
    _check_methods(report, 5)
    assert report["layers_per_device"] == {"cpu": 2} and report["roofline_model"].startswith("pipelined")
    _written(tmp_path, "scale-placement-tiny", report)
    assert capsys.readouterr().out.splitlines()[-1].startswith("placement tiny on 1 device(s): hf_parallel ")


def test_a_failing_method_is_reported_beside_the_other(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(scale.bench, "generate_chunk", fail)
    report = scale.main(["--mode", "placement", *SMALL, "--questions", "3", "--attn", "reference", "--out",
                         str(tmp_path)])  # fmt: skip
    assert report["methods"]["stock"]["error"] == "RuntimeError: out of memory, say"
    assert report["methods"]["hf_parallel"]["wall_s"] > 0 and report["answers_equal"] is None
    assert report["hf_parallel_options"] == {"attn": "reference"}
    table = (tmp_path / "scale-placement-tiny.md").read_text()
    assert "| stock (failed: RuntimeError: out of memory, say) | nan |" in table


def test_the_placed_model_is_built_on_its_devices_with_hooks():
    config = scale.shape_config("tiny")
    device_map = scale.auto_map(scale.empty_model(config, torch.float32), [torch.device("cpu")], torch.float32)
    model = scale.build_model(config, device_map, torch.float32)
    assert not any(p.is_meta for p in model.parameters()) and hasattr(model.model.layers[1], "_hf_hook")
    assert model.hf_device_map == device_map and scale.mapped_device(device_map, "model.layers.1.mlp.up_proj.weight")
    again = scale.build_model(config, {"": "cpu"}, torch.float32, hooks=False)  # seeded: the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    model.model.rotary_emb.inv_freq.zero_()  # what a meta-initialized buffer would be left as
    with pytest.raises(RuntimeError, match="rotary inv_freq"):
        scale.check_rotary(model)


def test_roofline_pipelined_over_parts_and_tensor_parallel_over_summed_rates():
    config = scale.shape_config("7b")
    prompts = scale.make_documents(config.vocab_size, 1, 512, 8, seed=0)[0]
    gpu = dict(bandwidth=4.0e12, matmul=7.0e14)
    whole = scale.roofline(config, prompts, 512, 16, [(32, True, gpu)])
    halves = scale.roofline(config, prompts, 512, 16, [(16, False, gpu), (16, True, gpu)])
    assert halves["roofline_s"] == pytest.approx(whole["roofline_s"], rel=1e-9)  # one GPU after another: no gain
    two = scale.roofline(config, prompts, 512, 16, [(32, True, scale.summed([gpu, gpu]))])
    assert two["roofline_s"] == pytest.approx(whole["roofline_s"] / 2, rel=1e-9)  # at once: half the time


def test_data_mode_in_one_process(tmp_path, capsys):
    """No launcher: one process takes every document; every answer checked against stock Transformers."""
    args = ["--mode", "data", *SMALL, "--docs", "4", "--questions", "3", "--check-docs", "4", "--out", str(tmp_path)]
    report = scale.main(args)
    assert (report["processes"], report["answer_tokens"], report["answers_checked"]) == (1, 4 * 3 * 6, 12)
    assert report["answers_equal"] == 12 and report["tokens_per_s"] > 0
    assert [(r["docs"], r["prompts"]) for r in report["per_process"]] == [(4, 12)]
    assert capsys.readouterr().out.splitlines()[-1].startswith("data tiny x1: ")
    scale.main(args)  # a rerun with the same process count replaces its run
    assert [r["processes"] for r in _written(tmp_path, "scale-data-tiny")["runs"]] == [1]


def test_data_mode_on_two_launched_processes_joins_the_one_process_run(tmp_path):
    """`accelerate launch` of two CPU processes (its torchrun launcher, no CUDA device visible: gloo, as
    tests/frontends/test_data_parallel.py launches): the documents split between them, every answer equal to
    stock's, and the run kept beside the one-process run of the same shape."""
    args = ["--mode", "data", *SMALL, "--docs", "5", "--questions", "3", "--check-docs", "5", "--out", str(tmp_path)]
    scale.main(args)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(_free_port()), str(SCRIPT), *args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_cpu_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    one, two = _written(tmp_path, "scale-data-tiny")["runs"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert sorted(r["docs"] for r in two["per_process"]) == [2, 3]  # balanced by prompt tokens
    assert two["answers_equal"] == two["answers_checked"] == 15
    assert f"| 2 | 5 | {two['wall_s']:.2f} |" in (tmp_path / "scale-data-tiny.md").read_text()


def test_data_table_shows_the_speedup_over_one_process():
    run = lambda n, tps: dict(processes=n, docs=8, wall_s=8 / tps, tokens_per_s=tps, answers_equal=3,  # noqa: E731
                              answers_checked=3, per_process=[dict(own_s=1.0), dict(own_s=1.25)])  # fmt: skip
    table = scale.data_table([run(1, 100.0), run(2, 190.0)])
    assert "| 2 | 8 | 0.04 | 190 | 1.90x | 1.25 | 3/3 |" in table.splitlines()


def test_the_sparse_checkpoint_loads_as_zeros_in_shards(tmp_path):
    """Sharded as save_pretrained shards (a 70b in 5 GiB files), each file a header and a hole: from_pretrained
    finds every tensor, all zeros, and the files take next to no disk."""
    config = scale.shape_config("tiny")
    scale.write_sparse_checkpoint(config, tmp_path, torch.float32, shard_bytes=100_000)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 6 and (tmp_path / "model.safetensors.index.json").exists()
    model, info = scale.transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    shapes = {name: t.shape for name, t in scale.empty_model(config, torch.float32).state_dict().items()}
    assert {name: t.shape for name, t in model.state_dict().items()} == shapes
    assert all(not p.any() for p in model.parameters())
    assert sum(f.stat().st_blocks * 512 for f in files) < sum(f.stat().st_size for f in files) / 4
    assert scale.checkpoint_ready(tmp_path, "tiny") and not scale.checkpoint_ready(tmp_path / "absent", "tiny")
    with pytest.raises(SystemExit, match="another shape than 7b"):
        scale.checkpoint_ready(tmp_path, "7b")


def _cpu_env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1"}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_tensor_parallel_under_torchrun_on_the_cpu(tmp_path):
    """Two gloo ranks: rank 0 writes the sparse checkpoint, both load it with tp_plan "auto" and fill their shards."""
    checkpoint = tmp_path / "checkpoint"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={_free_port()}",
               str(SCRIPT), "--mode", "tp", *SMALL, "--questions", "4", "--checkpoint", str(checkpoint),
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_cpu_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    report = _written(tmp_path, "scale-tp-tiny")
    _check_methods(report, 4)
    assert report["tensor_parallel"] and report["ranks"] == 2 and report["ranks_agree"]
    assert len(report["ceilings"]) == 2 and report["roofline_model"].startswith("tensor parallel")
    assert [f.name for f in checkpoint.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    assert done.stdout.splitlines()[-1].startswith("tp tiny on 2 device(s): hf_parallel ")
