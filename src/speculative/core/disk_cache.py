"""What is made once at first use and kept on disk (int8 weights, draft vocabularies, assembled
GGUF files, dequantized presets): written whole or not at all, checked at every load, made by
one process at a time.

Why: a cache outlives the process that wrote it, so it meets what that process never sees: a
disk or a copy that damages a file, a folder mounted read-only, a second process doing the same
first use at the same moment. So:

- it is written under a name of its own (`partial`: the process id and a random part, as two
  containers sharing a folder may share a pid), then renamed into place (`publish`): a reader
  sees the old whole or the new whole, never a half;
- its maker holds a lock beside it (`lock`: flock on NAME.lock, released by the kernel even when
  the process is killed): a second maker waits there, then finds the first one's result;
- every file's SHA-256 is recorded when written (`record`: a manifest for a folder, NAME.sha256
  beside a file) and checked at load (`damage`, `file_damage`, `has_sha256`): what does not match
  is made again, with a line on stderr (`say`), never loaded. Hashing gigabytes takes seconds, so
  what was found whole is stamped (`CHECKED`: the files' inodes, sizes, mtimes and ctimes) and
  hashed again only once it changed: every write sets ctime, which no tool can set back (what a
  stamp misses: damage under the file system, which changes no time);
- a folder that cannot be written makes `lock` give the OSError that says so: a caller that can
  compute in memory does, and says so once (`say_once`).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import glob
import hashlib
import json
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def sha256s(paths: list[Path]) -> list[str]:
    """The SHA-256 of each file, hashed in parallel (hashlib lets go of the GIL)."""
    with ThreadPoolExecutor(max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(sha256, paths))


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@functools.cache
def say_once(message: str) -> None:
    say(message)


@contextmanager
def lock(target: Path) -> Iterator[OSError | None]:
    """Held while `target` is made: a second process making it waits here, and should look for
    it again once inside. Partial files a killed maker left are removed (no one else writes
    while this is held). Gives None, or the OSError that says why the folder cannot be written
    (then nothing is held: make it in memory)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK):  # (a lock file already there would still open)
            raise PermissionError(errno.EACCES, "not writable", str(target.parent))
        handle = os.open(target.with_name(target.name + ".lock"), os.O_RDONLY | os.O_CREAT, 0o666)
    except OSError as error:
        yield error
        return
    try:
        _hold(handle, target)
        for stale in target.parent.glob(glob.escape(target.name) + ".*partial"):
            remove(stale)
        yield None
    finally:
        os.close(handle)


def _hold(handle: int, target: Path) -> None:
    """flock on `handle` (released when it is closed, or its process dies), saying why where it waits."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"waiting for another process making {target} (it holds {target.name}.lock)")
        fcntl.flock(handle, fcntl.LOCK_EX)


def partial(target: Path) -> Path:
    """A name of this process's own to write `target` under, beside it."""
    return target.with_name(f"{target.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")


def publish(written: Path, target: Path) -> None:
    """`written` renamed to `target` at once. A folder in the way is moved aside first (a folder
    cannot be renamed onto one that is not empty), then deleted."""
    if written.is_dir() and target.exists():
        old = partial(target)
        target.rename(old)
        written.rename(target)
        remove(old)
    else:
        os.replace(written, target)


def write_folder(target: Path, manifest: str, fill) -> None:
    """`target` made whole or not at all: `fill(folder)` writes its files into a folder of this
    process's own, their checksums are recorded, then it is renamed into place. An error or
    Ctrl-C leaves nothing half-written."""
    written = partial(target)
    written.mkdir(parents=True)
    try:
        fill(written)
        record(written, manifest)
        publish(written, target)
    except BaseException:
        remove(written)
        raise


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# The stamp of what was last found whole, beside a file or a folder's manifest.
CHECKED = ".checked"


def record(folder: Path, manifest: str) -> None:
    """Write `manifest` into `folder`: every other file's size and SHA-256 (last: a folder
    whose manifest is missing was not finished)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name not in (manifest, manifest + CHECKED))
    entries = {p.name: {"size": p.stat().st_size, "sha256": digest} for p, digest in zip(files, sha256s(files))}
    (folder / manifest).write_text(json.dumps(entries, indent=1) + "\n")


def damage(folder: Path, manifest: str) -> str | None:
    """What is wrong with `folder` (None: it is whole): no manifest, a file missing, of another
    size or of another SHA-256 than the manifest records."""
    try:
        entries = json.loads((folder / manifest).read_text())
        recorded = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in entries.items()}
    except FileNotFoundError:
        return "no manifest: it was not finished, or an older version made it"
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        return f"its manifest is unreadable or written by an older version ({type(error).__name__})"
    for name, (size, _) in recorded.items():
        if not (folder / name).is_file():
            return f"{name} is missing"
        if (folder / name).stat().st_size != size:
            return f"{name} has {(folder / name).stat().st_size} bytes, {size} were written"
    stamp, identity = folder / (manifest + CHECKED), _identity([folder / manifest, *map(folder.joinpath, recorded)])
    if _stamped(stamp, identity):
        return None
    names = list(recorded)
    for name, digest in zip(names, sha256s([folder / name for name in names])):
        if digest != recorded[name][1]:
            return f"{name} does not match the SHA-256 recorded when it was written"
    _stamp(stamp, identity)
    return None


def has_sha256(path: Path, digest: str) -> bool:
    """Whether the file `path` has the SHA-256 `digest` (hashed once, then once after each change)."""
    stamp, identity = path.with_name(path.name + CHECKED), _identity([path], digest)
    if _stamped(stamp, identity):
        return True
    if sha256(path) != digest:
        return False
    _stamp(stamp, identity)
    return True


def _identity(paths: list[Path], *also: str) -> str:
    """What changes when any of `paths` is written, replaced or touched (taken before hashing)."""
    stats = [os.stat(path) for path in paths]
    return json.dumps([*also, *([s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns] for s in stats)])


def _stamped(stamp: Path, identity: str) -> bool:
    try:
        return stamp.read_text() == identity
    except OSError:
        return False


def _stamp(stamp: Path, identity: str) -> None:
    written = partial(stamp)
    try:
        written.write_text(identity)
        os.replace(written, stamp)
    except OSError:  # a read-only cache: hashed in full at every load
        with suppress(OSError):
            written.unlink()


def record_file(path: Path) -> None:
    """Record `path`'s SHA-256 in PATH.sha256 beside it (after it: a file with no record is rebuilt)."""
    checksum = path.with_name(path.name + ".sha256")
    written = partial(checksum)
    written.write_text(sha256(path) + "\n")
    os.replace(written, checksum)


def file_damage(path: Path) -> str | None:
    """What is wrong with `path` (None: it is whole): no SHA-256 recorded, or another one."""
    try:
        recorded = path.with_name(path.name + ".sha256").read_text().strip()
    except OSError:
        return "no SHA-256 recorded: written by an older version, or interrupted"
    try:
        return None if sha256(path) == recorded else "it does not match the SHA-256 recorded when it was written"
    except OSError as error:
        return f"unreadable: {error.strerror}"


def adopt_older(folder: Path, manifest: str, unwritable: OSError | None) -> bool:
    """Whether `folder` was made whole by an older version, whose manifest recorded sizes only
    (every file has its size): its checksums are recorded now, or where the folder cannot be
    written it is taken as it is, said once. Making it again would take minutes."""
    try:
        sizes = json.loads((folder / manifest).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(sizes, dict) or not sizes or not all(type(size) is int for size in sizes.values()):
        return False
    if not all((folder / name).is_file() and (folder / name).stat().st_size == size for name, size in sizes.items()):
        return False
    if unwritable:
        say_once(f"{folder} was made by an older version, which recorded no checksums, and {folder.parent} cannot "
                 f"be written ({unwritable.strerror}): taken as it is")
    else:
        say(f"recording the SHA-256 of every file of {folder} (an older version recorded sizes only)")
        record(folder, manifest)
    return True

