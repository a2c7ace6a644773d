"""The files of a batch job: input records (JSON lines or Parquet) and the output that a job
appends to and resumes from.

Input: one record per JSON line (or Parquet row), each an object with a unique `id` (a
string or an integer). The ids are checked for the whole file before any work: the output
is keyed by id, so a line without one, or with an id already used, cannot be answered and
is refused with its line number. Everything else about a record is checked later, record
by record (`batch.request_of`): a bad record gets an `error` field in its output line.

Output, append-only: one JSON object per line, written by one process and flushed line by
line. On start every complete line's id is read back, and those ids are skipped; a last
line without its newline (a job killed while writing it) is cut off first. The writer
checks each id before writing, so no id is written twice, even when Ray retries a batch
whose records already arrived. A job killed midway loses only the records in flight.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Hashable, Iterator

from .prompt_files import decode_text, load_line


def is_parquet(path) -> bool:
    return Path(str(path)).suffix.lower() in (".parquet", ".pq")


def check_id(value, where: str) -> Hashable:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{where}: \"id\" must be a string or an integer, got {json.dumps(value, default=repr)}")
    return value


def read_jsonl_records(path) -> list[tuple[str, dict]]:
    """(where, record) for every non-blank line, where = 'FILE line N'. A line that is not a
    JSON object with an id raises ValueError naming it."""
    records = []
    text = decode_text(Path(path).read_bytes(), str(path))
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        record = load_line(line, where)
        if not isinstance(record, dict):
            raise ValueError(f"{where}: each line must be a JSON object like {{\"id\": 1, \"prompt\": \"...\"}}, "
                             f"got {type(record).__name__}")
        if "id" not in record:
            raise ValueError(f"{where} has no \"id\": every record needs a unique id, which its output line carries")
        check_id(record["id"], where)
        records.append((where, record))
    return records


def read_parquet_records(path) -> list[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: Parquet input needs pyarrow: pip install 'speculative[ray]'") from None
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises its own error types for a bad file
        raise ValueError(f"{path} is not a Parquet file pyarrow can read: {error}") from None
    if "id" not in table.column_names:
        raise ValueError(f"{path} has no \"id\" column (columns: {', '.join(table.column_names)}); every record "
                         "needs a unique id")
    records = []
    for number, record in enumerate(table.to_pylist(), 1):
        where = f"{path} row {number}"
        check_id(record["id"], where)
        records.append((where, record))
    return records


def read_records(path) -> list[tuple[str, dict]]:
    """Every record of INPUT with where it is, ids checked (present, well typed, unique)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"INPUT {path} does not exist")
    if path.is_dir():
        raise ValueError(f"INPUT {path} is a directory; give a .jsonl or .parquet file")
    records = read_parquet_records(path) if is_parquet(path) else read_jsonl_records(path)
    first: dict = {}
    for where, record in records:
        if record["id"] in first:
            raise ValueError(f"{where}: id {json.dumps(record['id'])} is already used by {first[record['id']]}; "
                             "ids must be unique, since the output holds one record per id")
        first[record["id"]] = where
    if not records:
        raise ValueError(f"INPUT {path} holds no records (one JSON object with an \"id\" per line)")
    return records


def check_paths(input_path, output_path) -> None:
    """Refuse, before either file is touched, an OUTPUT that is INPUT (the same file, also
    through a symbolic or hard link: resuming would cut and append to the records being
    read), and an OUTPUT that OutputFile refuses."""
    output = Path(output_path)
    try:
        same = os.path.samefile(input_path, output)
    except (OSError, ValueError):  # one of them does not exist (yet)
        same = False
    if same:
        also = "" if os.path.abspath(input_path) == os.path.abspath(output) else " (the same file through a link)"
        raise ValueError(f"OUTPUT {output} is INPUT {input_path}{also}; the output is appended to and resumed from, "
                         "so give another file")
    check_output(output)


def check_output(output: Path) -> None:
    """OUTPUT is a new path or a regular file: a job appends to it and reads it back to resume
    (reading a pipe or a terminal would wait forever)."""
    if output.is_dir():
        raise ValueError(f"OUTPUT {output} is a directory; give a file path (.jsonl)")
    if output.exists() and not stat.S_ISREG(output.stat().st_mode):
        raise ValueError(f"OUTPUT {output} is not a regular file (a device, pipe or socket): a job appends to its "
                         "OUTPUT and reads it back to resume, so give a file path (.jsonl)")


class OutputFile:
    """OUTPUT, appended to one record per line; the ids already in it are `done`."""

    def __init__(self, path):
        self.path = Path(path)
        check_output(self.path)
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"OUTPUT {self.path}: the folder {self.path.parent} does not exist")
        self.done: set[Hashable] = set()
        self.errors = 0  # records with an error among those done
        if self.path.exists():
            self._resume()
        self.file = open(self.path, "a", encoding="utf-8")

    def _resume(self) -> None:
        """Read back the ids written so far; then (an OUTPUT that is refused is left as it
        was) cut off a partially written last line."""
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        for number, line in enumerate(data[:complete].decode("utf-8", "replace").split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, or JSON no job writes
                record = None
            record_id = record.get("id") if isinstance(record, dict) else None
            if isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
                raise ValueError(f"OUTPUT {self.path} line {number} is not a record of a batch job (a JSON object "
                                 "with a string or integer id); give another OUTPUT, or remove that line")
            self.done.add(record_id)
            self.errors += "error" in record
        if complete < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(complete)

    def write(self, record: dict) -> bool:
        """Append one record unless its id is done already; False when it was."""
        if record["id"] in self.done:
            return False
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()  # the OS keeps the line if this process is killed now
        self.done.add(record["id"])
        return True

    def close(self) -> None:
        self.file.close()


def pending(records: list[tuple[str, dict]], done: set) -> Iterator[tuple[str, dict]]:
    return ((where, record) for where, record in records if record["id"] not in done)
