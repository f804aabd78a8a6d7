"""The corpus on Ray Data, for `hf-parallel answer --corpus IN --out OUT --ray [ADDRESS]`.

The pipeline: Ray Data reads IN's files (`read_binary_files`: JSON lines, or Parquet where a name ends in
.parquet), one task a file numbering its lines as `hf-parallel answer --corpus` does (`corpus_records`; a bad
line becomes an error row) and dropping the documents OUT holds; `Answerer` answers them on a pool of actors, one
model each; each row becomes its output line (`answer_line`, `error_line`).  OUT is a JSON-lines file, to which
the driver appends the lines as they come back, or a folder, into which Ray Data's write tasks write JSON-lines
files (Parquet files where its name ends in .parquet).

Faults are Ray's to handle: an actor that dies is restarted (`max_restarts`) and its batches retried
(`max_task_retries`); a read or write task that fails runs again.  A batch's rows come out once, whatever its
retries, so each document has one line in OUT.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

from ..frontends.corpus import answer_key, answer_line, corpus_record, corpus_records, error_line, finished_lines
from ..frontends.jsonlines import json_or_none
from .answerer import Answerer

PARQUET = ".parquet"
JSON_LINES = (".jsonl", ".json", ".ndjson")  # an OUT of one of these names is a file; any other a folder
# the CPUs Ray reserves for a task that reads, renders or writes lines: none, as light work next to the model's, which
# must not wait for the CPUs the actors hold
LIGHT = 0


@dataclass
class Cluster:
    """How the run uses Ray: the stage's actors and their resources, its batches and its fault handling.

    actors: model replicas (the actor pool's size); gpus_per_actor: Ray's `num_gpus` for each (a
    fraction packs several on a GPU; None: 1 where the cluster has GPUs, else 0); cpus_per_actor:
    Ray's `num_cpus` for each; batch_size: documents per batch, each batch one call of the engine;
    max_restarts, max_task_retries: Ray's for the actors (-1: without limit).
    """

    actors: int = 1
    gpus_per_actor: float | None = None
    cpus_per_actor: float = 1
    batch_size: int = 32
    max_restarts: int = -1
    max_task_retries: int = -1
    stage: type | None = None  # the map_batches class; None: `Answerer`


def start(address: str | None, quiet: bool = False) -> bool:
    """Connect to Ray unless this process already has: `address` ("auto", HOST:PORT, ray://...) or, None, a cluster
    running on this machine, else a new local one.  Whether this call started the connection (to be shut down)."""
    import ray  # optional: the ray extra

    if ray.is_initialized():
        return False
    ray.init(address=address, log_to_driver=not quiet, logging_level="WARNING" if quiet else "INFO")
    return True


def gpus_per_actor(cluster: Cluster) -> float:
    """The GPUs each actor asks for: the given number, else 1 where the cluster has GPUs, else 0."""
    import ray  # optional: the ray extra

    if cluster.gpus_per_actor is not None:
        return cluster.gpus_per_actor
    return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def spare_cpus(cluster: Cluster) -> float:
    """The cluster's CPUs that its actors leave to the tasks that read and write (at least one is needed)."""
    import ray  # optional: the ray extra

    return ray.cluster_resources().get("CPU", 0) - cluster.actors * cluster.cpus_per_actor


# --------------------------------------------------------------------------- paths


def filesystem(path: str):
    """(pyarrow filesystem, path in it) of a local path or a URI (s3://, gs://, ...)."""
    import pyarrow.fs as pafs  # optional: the ray extra

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def is_folder(path: str) -> bool:
    import pyarrow.fs as pafs  # optional: the ray extra

    fs, where = filesystem(path)
    return fs.get_file_info(where).type == pafs.FileType.Directory


def is_file_output(out: str) -> bool:
    """Whether OUT is one JSON-lines file (a name ending in .jsonl, .json or .ndjson that is no folder)."""
    return out.lower().endswith(JSON_LINES) and not is_folder(out)


# --------------------------------------------------------------------------- keys


def line_key(line: dict) -> str:
    """What identifies an input line across runs, as text: its file (of a folder IN) and `answer_key`."""
    return json.dumps([line.get("file"), *answer_key(line)])


# --------------------------------------------------------------------------- reading IN


def corpus_dataset(source: str, skip: Iterable[str] = ()):
    """Ray Data rows of the corpus `source` (a file or a folder of JSON-lines and Parquet files, local or a URI):
    {"key", "document", "questions", "error"}, an error row per bad line, none for the keys (`line_key`) in skip."""
    import ray  # optional: the ray extra

    folder = filesystem(source)[1] if is_folder(source) else None
    rows = partial(_file_rows, folder=folder, skip=frozenset(skip))
    read = ray.data.read_binary_files(source, include_paths=True, num_cpus=LIGHT)
    return read.map_batches(partial(_files_rows, rows=rows), batch_format="pyarrow")  # a CPU: see `answered`


def _files_rows(files, rows):
    """A batch of input files' rows (`_file_rows`), as one table (a map_batches stage of Ray's default resources,
    which `answered`'s repartition fuses with: its tasks cut the table into batches)."""
    import pyarrow as pa  # optional: the ray extra

    schema = pa.schema([("key", pa.string()), ("document", pa.string()), ("questions", pa.list_(pa.string())),
                        ("error", pa.string())])  # fmt: skip
    return pa.Table.from_pylist([row for file in files.to_pylist() for row in rows(file)], schema=schema)


def _file_rows(file: dict, folder: str | None, skip: frozenset) -> list[dict]:
    """One input file's rows (`corpus_dataset`): its lines numbered as `corpus_records` numbers them."""
    name = posixpath.relpath(file["path"], folder) if folder is not None else None
    if file["path"].lower().endswith(PARQUET):
        import pyarrow as pa  # optional: the ray extra
        import pyarrow.parquet as pq  # optional: the ray extra

        records, problems, seen = [], [], {}
        for number, row in enumerate(pq.read_table(pa.BufferReader(file["bytes"])).to_pylist(), 1):
            try:
                records.append(corpus_record(number, row, seen))
            except (TypeError, ValueError) as error:
                problems.append((number, str(error)))
    else:
        records, problems = corpus_records(io.StringIO(file["bytes"].decode("utf-8"), newline=None))
    rows = [_row(name, r["line"], r["id"], r["document"], r["questions"], None) for r in records]
    rows += [_row(name, number, None, None, None, problem) for number, problem in problems]
    return [row for row in rows if _key_of(row) not in skip]


def _row(file, line: int, record_id, document, questions, error) -> dict:
    where = {"file": file} if file is not None else {}
    key = where | {"line": line} | ({"id": record_id} if record_id is not None else {})
    return {"key": json.dumps(key), "document": document, "questions": questions, "error": error}


def held_questions(source: str, keys: Iterable[str]) -> dict[str, list | None]:
    """The questions of the corpus's lines with these keys (None for a bad line), read with Ray Data."""
    keys = frozenset(keys)
    found = {}
    for batch in corpus_dataset(source).filter(lambda row: _key_of(row) in keys).iter_batches(batch_format="pyarrow"):
        for row in batch.to_pylist():
            found[_key_of(row)] = row["questions"] if row["error"] is None else None
    return found


def _key_of(row: dict) -> str:
    return line_key(json.loads(row["key"]))


# --------------------------------------------------------------------------- answering


def answered(rows, cluster: Cluster, **stage_options):
    """The rows answered by `cluster.stage` on a pool of `cluster.actors` actors: each row's output line, JSON text
    in a "json" column.  stage_options: `Answerer`'s."""
    # a block a batch, so that batches spread over the actors; fused into the reading stage's tasks, which take a CPU
    # (Ray's default, as the repartition's): the actors must leave one (`spare_cpus`)
    batches = rows.repartition(target_num_rows_per_block=cluster.batch_size)
    with warnings.catch_warnings():  # Ray 2.60 deprecates its remote args as keywords, with no other way to set
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")  # these two (the extra: <2.64)
        stage = _stage(batches, cluster, stage_options)
    return stage.map_batches(_lines, batch_format="pyarrow", num_cpus=LIGHT)


def _stage(batches, cluster: Cluster, stage_options: dict):
    from ray.data import ActorPoolStrategy  # optional: the ray extra

    return batches.map_batches(
        cluster.stage or Answerer,
        fn_constructor_kwargs=stage_options,
        batch_size=cluster.batch_size,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=cluster.actors),
        num_gpus=gpus_per_actor(cluster),
        num_cpus=cluster.cpus_per_actor,
        max_restarts=cluster.max_restarts,
        max_task_retries=cluster.max_task_retries,
    )


def _lines(batch):
    """A batch's output lines, as JSON text."""
    import pyarrow as pa  # optional: the ray extra

    lines = [json.dumps(output_line(row), ensure_ascii=False) for row in batch.to_pylist()]
    return pa.table({"json": pa.array(lines, type=pa.string())})


def output_line(row: dict) -> dict:
    """A row's line in OUT, as `hf-parallel answer --corpus` writes it (and "file" first, for a folder IN)."""
    key, recorded = json.loads(row["key"]), {"model": row["model"], "options": row["options"]}
    where = {"file": key["file"]} if "file" in key else {}
    if row["error"] is not None:
        return where | error_line(key["line"], row["error"], key.get("id"), recorded)
    return where | answer_line({**key, "questions": row["questions"]}, row["answers"], recorded)


# --------------------------------------------------------------------------- OUT


def held_lines(out: str) -> dict[str, dict]:
    """The lines OUT holds (a file, a folder of JSON-lines or Parquet files, or nothing yet), by `line_key`.

    A JSON-lines file's last line cut short is cut off the file (its document runs again); a Parquet file
    that cannot be read (cut short while written) is removed; a line that is not an output line raises
    ValueError naming it."""
    import pyarrow.fs as pafs  # optional: the ray extra

    fs, where = filesystem(out)
    info = fs.get_file_info(where)
    if info.type == pafs.FileType.NotFound:
        return {}
    if info.type != pafs.FileType.Directory:
        return _keyed(finished_lines(_read_lines(fs, where), out))
    selector = pafs.FileSelector(where, recursive=True)
    held = {}
    for file in sorted(fs.get_file_info(selector), key=lambda f: f.path):
        if file.type != pafs.FileType.File or posixpath.basename(file.path).startswith((".", "_")):
            continue
        lines = _read_parquet(fs, file.path) if file.path.lower().endswith(PARQUET) else _read_lines(fs, file.path)
        held.update(_keyed(finished_lines(lines, file.path)))
    return held


def _keyed(finished: dict) -> dict[str, dict]:
    return {line_key(line): line for line in finished.values()}


def _read_lines(fs, path: str) -> list:
    """A JSON-lines file's values; a last line without its newline cut off the file."""
    with fs.open_input_stream(path) as stream:
        data = stream.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with fs.open_output_stream(path) as stream:
            stream.write(data[:end])
    return [json_or_none(line) for line in data[:end].decode("utf-8").splitlines()]


def _read_parquet(fs, path: str) -> list:
    """A Parquet output file's lines, without their null fields; a file that cannot be read is removed."""
    import pyarrow  # optional: the ray extra
    import pyarrow.parquet as pq  # optional: the ray extra

    try:
        rows = pq.read_table(path, filesystem=fs).to_pylist()
    except (OSError, pyarrow.ArrowInvalid):
        fs.delete_file(path)
        return []
    return [{k: v for k, v in row.items() if v is not None} for row in rows]


def write_folder(lines, out: str) -> None:
    """Ray Data's write tasks write the lines into the folder OUT: JSON-lines files, or Parquet where OUT's name ends
    in .parquet; each run adds files of its own."""
    if out.rstrip("/").lower().endswith(PARQUET):
        columns = lines.map_batches(_columns, batch_format="pyarrow", num_cpus=LIGHT)
        columns.write_parquet(out, ray_remote_args={"num_cpus": LIGHT})
    else:
        lines.write_datasink(_json_lines_sink(out), ray_remote_args={"num_cpus": LIGHT})


def _columns(batch):
    """Output lines as Parquet columns: each line's fields, null where a line has none."""
    import pyarrow as pa  # optional: the ray extra

    rows = [json.loads(text) for text in batch.column("json").to_pylist()]
    names = ["file", "line", "id", "questions", "answers", "error", "model", "options"]
    names = [name for name in names if any(name in row for row in rows)]
    return pa.Table.from_pylist([{name: row.get(name) for name in names} for row in rows])


def _json_lines_sink(out: str):
    from ray.data.datasource import BlockBasedFileDatasink  # optional: the ray extra

    class JsonLinesDatasink(BlockBasedFileDatasink):
        """Each block's "json" column, a line each, as it is (Ray's write_json would rewrite it through pandas)."""

        def write_block_to_file(self, block, file):
            text = "".join(line + "\n" for line in block.to_arrow().column("json").to_pylist())
            file.write(text.encode("utf-8"))

    return JsonLinesDatasink(out, file_format="jsonl")
