"""`hf-parallel serve` and `hf-parallel batch` as the command line meets them, without a model: their flags and
help import no engine or server, a rerun with nothing left to answer loads no model, `--sort` puts the output in
input order, and the exit status and summary say what the output holds.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from hf_parallel.cli import main
from tests.helpers.project import ROOT

HEAVY = ("hf_parallel.frontends.serving", "hf_parallel.server", "fastapi", "starlette", "uvicorn")
CLI = ROOT / "hf_parallel" / "cli"
# cli/serve.py on its own: its package's __init__ (which imports every command) replaced by a bare package
IMPORT_SERVE_ALONE = f"""
import importlib, importlib.machinery, importlib.util, sys
import hf_parallel
spec = importlib.machinery.ModuleSpec("hf_parallel.cli", None, is_package=True)
package = importlib.util.module_from_spec(spec)
package.__path__ = [{str(CLI)!r}]
sys.modules["hf_parallel.cli"] = package
before = set(sys.modules)
importlib.import_module("hf_parallel.cli.serve")
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_the_serve_and_batch_flags_import_no_engine_server_or_web_framework():
    """What cli/serve.py's own imports bring in (beyond the hf_parallel package's): none of the heavy modules
    that only running a command needs."""
    result = subprocess.run([sys.executable, "-c", IMPORT_SERVE_ALONE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    added = result.stdout.split()
    assert "hf_parallel.cli.serve" in added
    assert [m for m in added if m.split(".")[0] in HEAVY or m.startswith(HEAVY)] == []


def request_line(custom_id: str, prompt: str) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def answered(custom_id: str, status: int = 200) -> dict:
    """An output line as a run writes one (a response of `status`)."""
    body = {"choices": [{"index": 0, "text": f"answer to {custom_id}"}]} if status == 200 else {"error": {}}
    response = {"status_code": status, "request_id": f"req-{custom_id}", "body": body}
    return {"id": f"batch_req_{custom_id}", "custom_id": custom_id, "response": response, "error": None}


def error_line(key: str, number: int) -> dict:
    error = {"code": "invalid_request", "message": f"line {number}: not a JSON object"}
    return {"id": f"batch_req_{number}", "custom_id": key, "response": None, "error": error}


@pytest.fixture
def finished_batch(tmp_path):
    """An input of five requests and a line that is not JSON (line 4), and an output that answers them all, in a
    shuffled (finishing) order: one request refused with 400, the bad line an error line."""
    ids = ["a", "b", "c", "d", "e"]
    texts = [json.dumps(request_line(i, f"prompt {i}")) for i in ids]
    texts.insert(3, "{not json")
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(texts) + "\n")
    records = [answered(i, 400 if i == "b" else 200) for i in ids] + [error_line("line 4", 4)]
    random.Random(0).shuffle(records)
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return source, out, records


def test_a_rerun_with_every_line_answered_loads_no_model_and_exits_0(finished_batch, no_model, capsys):
    source, out, records = finished_batch
    before = out.read_text()
    main(["batch", "--input", str(source), "--output", str(out)])  # no SystemExit: status 0
    assert out.read_text() == before
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"0 lines answered now, {len(records)} already in {out}" in summary
    assert f"2 of its {len(records)} lines failed" in summary  # the 400 response and the error line


def test_sort_rewrites_the_output_in_input_order(finished_batch, no_model):
    source, out, records = finished_batch
    main(["batch", "--input", str(source), "--output", str(out), "--sort"])
    sorted_records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in sorted_records] == ["a", "b", "c", "line 4", "d", "e"]
    by_id = {r["custom_id"]: r for r in records}
    assert sorted_records == [by_id[r["custom_id"]] for r in sorted_records]  # each line as it was
    assert not list(out.parent.glob("*.sorting"))


def test_batch_help_states_the_exit_status_order_and_sort(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["batch", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "the exit status is 0 once OUT has a line for every input line, error lines included" in text
    assert "in finishing order" in text and "--sort" in text


@pytest.mark.parametrize("size", ["lots", "0"])
def test_a_bad_max_body_is_a_usage_error_before_any_loading(size, no_model, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--max-body", size])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hf-parallel serve: error: --max-body {size!r}: expected a size such as 4MiB, 40GiB or 500KB"]
