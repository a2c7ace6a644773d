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

One job per OUTPUT: a job holds an exclusive lock (`OutputLock`: flock on OUTPUT.lock, which
names the holder's pid and host) from before it reads OUTPUT back until it ends; a second job
on the same OUTPUT is refused at once, naming the holder. The kernel lets go of the lock when
the holder dies, so a killed job never blocks the next one. Each line carries a short hash
of the request it answers (`request_hash`), so a resumed job can tell an answer to a request
INPUT no longer holds (`drop` rewrites OUTPUT without such lines: a temporary file, renamed
over OUTPUT at once).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Hashable, Iterator

try:
    import fcntl
except ImportError:  # not on POSIX: jobs run without the lock
    fcntl = None

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


class OutputInUse(ValueError):
    """Another job holds the lock on OUTPUT."""


class OutputLock:
    """An exclusive lock on OUTPUT for a job's whole run: flock on the file OUTPUT.lock beside
    it (not on OUTPUT itself, which `OutputFile.drop` replaces), holding the holder's pid,
    host and start time. The kernel releases it when the holder's file is closed or its
    process dies, killed or not; the holder removes the file as it lets go (under the lock:
    a job that opened the old file meanwhile sees that it is gone, and locks a new one)."""

    def __init__(self, output: Path):
        self.path = output.with_name(output.name + ".lock")
        self.file = None

    def acquire(self) -> None:
        """Take the lock, or raise OutputInUse naming the process that holds it. Where no lock
        can be taken (no flock, a folder that cannot hold the lock file) the job runs
        without one, and says so."""
        if fcntl is None:
            return
        while True:
            try:
                handle = open(self.path, "a+b")  # created if missing; closed on collection
            except OSError as error:
                return self._without(f"{self.path} cannot be created ({error.strerror or error})")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(handle)
                handle.close()
                output = self.path.with_name(self.path.name[:-len(".lock")])
                raise OutputInUse(f"OUTPUT {output} is in use by another batch job ({holder}, holding "
                                  f"{self.path}); wait for it to finish, or give another OUTPUT") from None
            except OSError as error:  # a file system without locks
                handle.close()
                return self._without(f"{self.path} cannot be locked ({error.strerror or error})")
            try:
                same = os.path.samestat(os.fstat(handle.fileno()), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            handle.close()  # the previous holder removed it as it let go: lock the new one
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode() + b"\n")
        handle.flush()
        self.file = handle

    @staticmethod
    def _holder(handle) -> str:
        handle.seek(0)
        try:
            holder = json.loads(handle.read(4096).decode("utf-8", "replace"))
            where = "" if holder["host"] == socket.gethostname() else f" on host {holder['host']}"
            return f"pid {holder['pid']}{where}, started {holder['started']}"
        except (ValueError, KeyError, TypeError):  # the holder has not written its name yet
            return "a process that has just started"

    @staticmethod
    def _without(why: str) -> None:
        print(f"warning: {why}: this job runs without a lock on its OUTPUT, so do not start a second job on the "
              "same OUTPUT while it runs", file=sys.stderr)

    def release(self) -> None:
        if self.file is None:
            return
        try:
            os.unlink(self.path)  # still holding it: see the class's docstring
        except OSError:
            pass
        self.file.close()
        self.file = None


def record_id(line: str, where: str) -> tuple[Hashable, dict]:
    """(id, record) of one output line; ValueError for a line no job writes."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, or JSON no job writes
        record = None
    found = record.get("id") if isinstance(record, dict) else None
    if isinstance(found, bool) or not isinstance(found, (str, int)):
        raise ValueError(f"{where} is not a record of a batch job (a JSON object with a string or integer id); "
                         "give another OUTPUT, or remove that line")
    return found, record


class OutputFile:
    """OUTPUT, appended to one record per line; the ids already in it are `done`, and
    `answered` maps each to the request hash its line carries (None in lines written before
    lines had one). Holds OUTPUT's lock from its start until `close`."""

    def __init__(self, path, lock: bool = True):
        self.path = Path(path)
        check_output(self.path)
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"OUTPUT {self.path}: the folder {self.path.parent} does not exist")
        try:
            open(self.path, "a").close()  # (before the lock, which could only warn that it cannot be made)
        except OSError as error:
            raise PermissionError(f"OUTPUT {self.path} cannot be written ({error.strerror or error}): give "
                                  "OUTPUT in a folder this job can write") from None
        self.lock = OutputLock(self.path)
        self.file = None
        if lock:
            self.lock.acquire()
        try:
            self.done: set[Hashable] = set()
            self.answered: dict[Hashable, str | None] = {}
            self.errors = 0  # records with an error among those done
            # The request hash each id of this job's INPUT gets in its line (`write`).
            self.request_hashes: dict[Hashable, str] = {}
            if self.path.exists():
                self._resume()
            self.file = open(self.path, "ab", buffering=0)
        except BaseException:
            self.lock.release()
            raise

    def _resume(self) -> None:
        """Read back the ids written so far; then (an OUTPUT that is refused is left as it
        was) cut off a partially written last line."""
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        for number, line in enumerate(data[:complete].decode("utf-8", "replace").split("\n"), 1):
            if not line.strip():
                continue
            found, record = record_id(line, f"OUTPUT {self.path} line {number}")
            self.done.add(found)
            digest = record.get("request_hash")
            self.answered[found] = digest if isinstance(digest, str) else None
            self.errors += "error" in record
        if complete < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(complete)

    def drop(self, ids: set) -> None:
        """Remove the lines of `ids` (to answer them again): OUTPUT is written whole to a
        temporary file beside it, then renamed over it, so a job killed meanwhile leaves it
        as it was."""
        self.file.close()
        text = self.path.read_text(encoding="utf-8", errors="replace")
        kept = []
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            found, record = record_id(line, f"OUTPUT {self.path} line {number}")
            if found in ids:
                self.errors -= "error" in record
                continue
            kept.append(line + "\n")
        handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=self.path.parent,
                                             prefix=f".{self.path.name}.", suffix=".partial", delete=False)
        try:
            with handle:
                handle.writelines(kept)
                handle.flush()
                os.fsync(handle.fileno())
            shutil.copymode(self.path, handle.name)
            os.replace(handle.name, self.path)
        except BaseException:
            Path(handle.name).unlink(missing_ok=True)
            self.file = open(self.path, "ab", buffering=0)
            raise
        self.done -= ids
        for found in ids:
            self.answered.pop(found, None)
        self.file = open(self.path, "ab", buffering=0)

    def write(self, record: dict) -> bool:
        """Append one record unless its id is done already; False when it was. The line
        carries the hash of the request it answers, when this job knows it."""
        if record["id"] in self.done:
            return False
        digest = self.request_hashes.get(record["id"])
        line = record if digest is None else {**record, "request_hash": digest}
        self._append((json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
        self.done.add(record["id"])
        self.answered[record["id"]] = digest
        return True

    def _append(self, data: bytes) -> None:
        """One line, whole or not at all: written unbuffered (the OS keeps it if this process is
        killed next), cut back where a write fails (a disk full left half a line)."""
        end = os.fstat(self.file.fileno()).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[self.file.write(view):]
        except OSError as error:
            os.ftruncate(self.file.fileno(), end)
            raise OSError(error.errno, f"OUTPUT {self.path} cannot take another record ({error.strerror}); the "
                          f"{len(self.done)} it holds are whole: make room, then run the same command to go on") \
                from None

    def close(self) -> None:
        try:
            if self.file is not None:
                self.file.close()
        finally:
            self.lock.release()

    def __del__(self):  # an OutputFile dropped unclosed lets go of the lock too
        try:
            if getattr(self, "lock", None) is not None:
                self.close()
        except Exception:  # at interpreter exit: the kernel lets go of the lock anyway
            pass


def pending(records: list[tuple[str, dict]], done: set) -> Iterator[tuple[str, dict]]:
    return ((where, record) for where, record in records if record["id"] not in done)
