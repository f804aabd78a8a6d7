"""The CPU threads torch computes on (`hf_parallel.frontends.threads`): the CPUs this process may use, by its affinity
mask and a cgroup quota, less those other work keeps busy; an explicit count wins, and a busy machine is said once.

Each choice runs in a fresh interpreter (a thread count is the whole process's), under `taskset`-like affinity
masks, a fake cgroup folder, or beside a real busy process pinned to one CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hf_parallel import cli
from hf_parallel.frontends import threads
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.models import tiny_model
from tests.helpers.project import ROOT

TWO_CPUS = sorted(threads.affinity())[:2]
needs_two = pytest.mark.skipif(
    len(TWO_CPUS) < 2 or not hasattr(os, "sched_setaffinity"), reason="needs two CPUs and affinity masks (Linux)"
)


def choose(code: str, cpus: list[int] | None = None, **env) -> subprocess.CompletedProcess:
    """`code` after `from hf_parallel.frontends import threads` in a fresh interpreter, on `cpus` (an affinity mask),
    with no OMP_NUM_THREADS or MKL_NUM_THREADS unless `env` sets them."""
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    environ |= {"PYTHONPATH": str(ROOT), **env}
    program = "from pathlib import Path\nimport torch\nfrom hf_parallel.frontends import threads\n" + textwrap.dedent(
        code
    )
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None
    return subprocess.run(
        [sys.executable, "-c", program], env=environ, capture_output=True, text=True, timeout=120, preexec_fn=pin
    )


@pytest.fixture
def busy_cpu():
    """A process that keeps the first of TWO_CPUS busy (a `while True: pass` pinned to it), for the test's length."""
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 120\nwhile time.time() < end: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, TWO_CPUS[:1]),
    )
    time.sleep(0.5)  # it runs
    yield TWO_CPUS[0]
    busy.kill()
    busy.wait()


def fake_cgroup(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    """(a cgroup mount folder holding `files`, a /proc/self/cgroup holding `membership`)."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return root, tmp_path / "membership"


# --------------------------------------------------------------------------- the CPUs this process may use


def test_one_cpu_of_affinity_is_one_thread():
    """Under an affinity mask of one CPU (as `taskset -c 0` starts a process): one thread."""
    done = choose("print(threads.usable_cpus(), threads.choose_threads(), torch.get_num_threads())", cpus=[0])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1", "1"] and done.stderr == ""


def test_a_cgroup_v2_quota_caps_the_cpus_at_the_smallest_of_the_cgroup_and_those_above(tmp_path):
    files = {"job/step/cpu.max": "max 100000\n", "job/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"}
    root, membership = fake_cgroup(tmp_path, "0::/job/step\n", files)
    assert threads.cgroup_quota(root, membership) == 1.5
    assert threads.usable_cpus(root, membership) == min(len(threads.affinity()), 2)  # 1.5 CPUs: 2 threads
    (root / "job" / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_quota(root, membership) is None
    assert threads.usable_cpus(root, membership) == len(threads.affinity())


def test_a_container_whose_cgroup_is_its_mounts_root_reads_the_root(tmp_path):
    """/proc/self/cgroup names the host's path, which the container's mount does not hold: the mount's own file."""
    root, membership = fake_cgroup(tmp_path, "0::/system.slice/docker-abc.scope\n", {"cpu.max": "50000 100000\n"})
    assert threads.cgroup_quota(root, membership) == 0.5
    assert threads.usable_cpus(root, membership) == 1


def test_a_cgroup_v1_quota(tmp_path):
    membership = "12:memory:/job\n4:cpu,cpuacct:/job\n"
    files = {"cpu,cpuacct/job/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
             "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}  # fmt: skip
    root, membership = fake_cgroup(tmp_path, membership, files)
    assert threads.cgroup_quota(root, membership) == 2.5
    (root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_quota(root, membership) is None


@needs_two
def test_the_default_follows_a_cgroup_quota_not_the_cores_torch_sees(tmp_path):
    """Two CPUs in the affinity mask (torch's own default: 2 threads) under a quota of one CPU: one thread."""
    root, membership = fake_cgroup(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"})
    code = f"""
        threads.CGROUP, threads.PROC_CGROUP = Path({str(root)!r}), Path({str(membership)!r})
        print(threads.choose_threads(), torch.get_num_threads())
    """
    done = choose(code, cpus=TWO_CPUS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def test_the_default_leaves_the_cpus_other_work_keeps_busy():
    assert threads.default_threads(8, 8, 0.0) == threads.default_threads(8, 8, 0.4) == 8
    assert threads.default_threads(8, 8, 0.5) == threads.default_threads(8, 8, 1.3) == 7
    assert threads.default_threads(2, 2, 1.0) == threads.default_threads(2, 2, 2.0) == 1
    assert threads.default_threads(2, 64, 30.0) == 2  # a quota of 2 CPUs on a half-busy host: 2 threads
    assert threads.default_threads(4, 4, None) == 4  # no /proc/stat: the usable CPUs


def test_busy_cpus_are_read_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 80 0 0 0 0 0 0\ncpu0 5 0 5 40 0 0 0 0 0 0\ncpu1 5 0 5 40 0 0 0 0 0 0\n")
    before = threads.cpu_times(stat)
    stat.write_text("cpu  10 0 10 80 0 0 0 0 0 0\ncpu0 105 0 5 40 0 0 0 0 0 0\ncpu1 30 0 5 115 0 0 0 0 0 0\n")
    after = threads.cpu_times(stat)
    assert before == {0: (10, 50), 1: (10, 50)}
    assert threads.busy_between(before, after, {0, 1}) == pytest.approx(1.25)
    assert threads.busy_between(before, after, {1}) == pytest.approx(0.25)


# --------------------------------------------------------------------------- beside a busy process


@needs_two
def test_a_cpu_kept_busy_leaves_one_thread_and_a_note_naming_the_flag(busy_cpu):
    code = """
        with threads.requested(None):  # as a command runs: its note names --threads
            print(threads.choose_threads(), torch.get_num_threads())
    """
    done = choose(code, cpus=TWO_CPUS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]
    (line,) = done.stderr.splitlines()  # said once
    assert line.startswith("other work keeps ") and line.endswith(
        "computing on 1 thread rather than 2 (--threads N chooses)"
    )


@needs_two
def test_an_explicit_count_is_kept_and_a_busy_machine_is_said_once(busy_cpu):
    flag = choose("""
        with threads.requested(2):
            print(threads.choose_threads(), threads.choose_threads(), torch.get_num_threads())
    """, cpus=TWO_CPUS)  # fmt: skip
    environment = choose("print(threads.choose_threads(), torch.get_num_threads())", cpus=TWO_CPUS, OMP_NUM_THREADS="2")
    user = choose("torch.set_num_threads(3)\nprint(threads.choose_threads(), torch.get_num_threads())", cpus=TWO_CPUS)
    for done, said in ((flag, "--threads 1"), (environment, "torch.set_num_threads(1)"), (user, "set_num_threads(1)")):
        assert done.returncode == 0, done.stderr
        assert set(done.stdout.split()) == {"3" if done is user else "2"}
        (line,) = done.stderr.splitlines()
        assert line.startswith("other work keeps ") and line.endswith(f"{said} may be several times faster"), line


@needs_two
def test_a_command_beside_a_busy_cpu(busy_cpu, tmp_path):
    """`hf-parallel answer` as a user runs it: one thread and the note naming --threads; with --threads 2, two
    threads and the note that the machine looks oversubscribed; --quiet: neither note."""
    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    char_tokenizer().save_pretrained(tmp_path / "tiny")
    (tmp_path / "doc.txt").write_text("The cat is named Tom.")
    (tmp_path / "q.txt").write_text("Who is Tom?\n")
    answer = ["answer", "--document", "doc.txt", "--questions", "q.txt", "--model", "tiny", "--max-new-tokens", "2"]
    code = "import sys, torch\nfrom hf_parallel.cli import main\nmain(sys.argv[1:])\nprint(torch.get_num_threads())"
    said, env = {}, {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(ROOT)}
    for flags in ([], ["--threads", "2"], ["--quiet"]):
        done = subprocess.run(
            [sys.executable, "-c", code, *answer, "--device", "cpu", *flags], cwd=tmp_path, capture_output=True,
            text=True, timeout=300, env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, TWO_CPUS),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        said[" ".join(flags)] = (done.stdout.split()[-1], done.stderr.splitlines())
    assert said[""][0] == "1" and said[""][1][0].endswith("computing on 1 thread rather than 2 (--threads N chooses)")
    assert said["--threads 2"][0] == "2" and said["--threads 2"][1][0].endswith(
        "--threads 1 may be several times faster"
    )
    assert said["--quiet"] == ("1", [])


def test_every_command_takes_threads(capsys):
    """Each command's parser knows --threads (a count it checks), also those whose other flags are their own."""
    for command in ("demo", "answer", "eval", "lm-eval", "serve", "batch"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--threads", "0", "--port", "1"])
        said = capsys.readouterr().err
        assert exit_.value.code == 2 and f"hf-parallel {command}: error: argument --threads: must be >= 1" in said
