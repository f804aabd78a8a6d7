"""The offline tasks' data files, found missing from the run's --tasks and --metadata before lm-eval loads a model."""

from __future__ import annotations

import json

import pytest

from hf_parallel.harness import cli
from hf_parallel.harness.data import SQUAD, missing_data


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A data folder holding SQuAD only, and no HF_PARALLEL_DATA."""
    monkeypatch.delenv("HF_PARALLEL_DATA", raising=False)
    (tmp_path / SQUAD).write_bytes(b"")
    return tmp_path


def test_the_tasks_and_the_folder_are_read_as_lm_eval_reads_them(data, monkeypatch):
    folder = json.dumps({"data_dir": str(data)})
    assert missing_data(["--tasks", "hfp_squad,hfp_squad_mc", "--metadata", folder]) is None
    assert missing_data(["-t", "hfp_squad", "arc_easy", "--metadata", f"data_dir={str(data)!r}"]) is None
    said = missing_data(["--tasks=hfp_offline", "--limit", "3", "--metadata", folder])
    assert said == (
        f"drop-dev.jsonl.gz, war-and-peace.txt.gz not found in {data} (read by hfp_drop, hfp_war_and_peace): pass "
        """--metadata '{"data_dir": "DIR"}' or set HF_PARALLEL_DATA=DIR, DIR a folder holding them"""
    )
    monkeypatch.setenv("HF_PARALLEL_DATA", str(data))
    assert missing_data(["--tasks", "hfp_squad"]) is None and missing_data(["--tasks", "arc_easy"]) is None
    assert missing_data(["--tasks", "hfp_drop"]).startswith(f"drop-dev.jsonl.gz not found in {data} (read by hfp_drop)")


def test_a_missing_file_is_one_line_and_status_2_before_the_model(data, capsys, no_model):
    folder = json.dumps({"data_dir": str(data / "elsewhere")})
    argv = ["--model_args", f"pretrained={data / 'no-model'}", "--tasks", "hfp_squad", "--metadata", folder]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        f"hf-parallel lm-eval: error: {SQUAD} not found in {data / 'elsewhere'} (read by hfp_squad): pass "
        """--metadata '{"data_dir": "DIR"}' or set HF_PARALLEL_DATA=DIR, DIR a folder holding it\n"""
    )
