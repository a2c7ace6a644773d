"""`speculative batch`, one job per OUTPUT, and a resumed job whose INPUT changed (issue 62,
item 7), on real processes: a second job on an OUTPUT in use is refused at once, naming the
holder's pid, and no id is written twice; a killed holder leaves no lock behind; a record
whose request was edited after it was answered is named on resume, and answered again with
--redo-changed, one line per id."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from speculative.entrypoints.batch import ModelSpec, request_hash
from speculative.entrypoints.batch_files import OutputFile, OutputInUse
from speculative.models.loading import ASSETS
from tests.test_batch_job import alone, pair, read_output, records, write_jsonl  # noqa: F401
from tests.test_cache_faults import read_only
from tests.test_cli_errors import command, environment

pytestmark = pytest.mark.skipif(not (ASSETS / "verifier" / "config.json").is_file(),
                                reason="the shipped models are not in this checkout")


def complete_ids(path) -> list:
    """The ids of OUTPUT's complete lines, in order."""
    text = path.read_text()
    return [json.loads(line)["id"] for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


def wait_for(condition, process, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"the job ended first: {process.stderr.read().decode()}"
        assert time.monotonic() < deadline, "the job did not get there in time"
        time.sleep(0.02)


def stop(process) -> None:
    process.kill()
    process.wait()
    process.stderr.close()


def test_a_second_job_on_the_same_output_is_refused_naming_the_holder(tmp_path):
    rows = records(16, max_tokens=32)
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    job = ["batch", tmp_path / "in.jsonl", out, "--max-batch-size", "1", "--no-progress"]
    first = subprocess.Popen(command(*job), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment())
    try:
        wait_for(out.exists, first)  # the first job has started on OUTPUT (its models still loading)
        started = time.monotonic()
        # Today's code let this one run the whole job beside the first: time out rather than wait for it.
        second = subprocess.run(command(*job), capture_output=True, env=environment(), timeout=120)
        err = second.stderr.decode()
        assert first.poll() is None, "the first job ended before the second one was refused"
        assert second.returncode == 2, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"in use by another batch job (pid {first.pid}" in err and "give another OUTPUT" in err, err
        assert time.monotonic() - started < 60  # refused at once, not after loading the models
        wait_for(lambda: len(complete_ids(out)) >= 2, first)
    finally:
        stop(first)
    ids = complete_ids(out)
    assert len(ids) == len(set(ids)) and set(ids) <= {row["id"] for row in rows}


def test_a_killed_holder_leaves_the_output_free(tmp_path):
    rows = records(6, max_tokens=8)
    write_jsonl(tmp_path / "in.jsonl", rows)
    out, lock = tmp_path / "out.jsonl", tmp_path / "out.jsonl.lock"
    job = ["batch", tmp_path / "in.jsonl", out, "--max-batch-size", "1", "--no-progress"]
    process = subprocess.Popen(command(*job), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment())
    try:
        wait_for(lambda: len(complete_ids(out)) >= 1 if out.exists() else False, process)
        holder = json.loads(lock.read_text())  # the lock names its holder while it runs
        assert holder["pid"] == process.pid and holder["host"]
        os.kill(process.pid, signal.SIGKILL)
    finally:
        stop(process)
    written = len(complete_ids(out))
    assert 1 <= written < len(rows), "the job was not killed midway"
    assert lock.exists()  # left behind by the killed job, but no longer locked: the kernel let go
    again = subprocess.run(command(*job), capture_output=True, env=environment(), timeout=300)
    assert again.returncode == 0, again.stderr.decode()
    assert f"{written} already done" in again.stderr.decode() and "in use" not in again.stderr.decode()
    assert sorted(complete_ids(out)) == sorted(row["id"] for row in rows)  # each once, none missing
    assert not lock.exists()  # a job that ends removes its lock


def test_sigterm_ends_a_job_with_a_line_and_whole_records_and_it_resumes(tmp_path):
    """SIGTERM (a `kill`, a container stopping) killed a job in silence (exit -15); it now ends as on Ctrl-C."""
    rows = records(6, max_tokens=8)
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    job = ["batch", tmp_path / "in.jsonl", out, "--max-batch-size", "1", "--no-progress"]
    process = subprocess.Popen(command(*job), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment())
    try:
        wait_for(lambda: len(complete_ids(out)) >= 1 if out.exists() else False, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 143
        assert process.stderr.read().decode().splitlines()[-1] == "terminated (SIGTERM)"
    finally:
        stop(process)
    written = len(complete_ids(out))
    assert 1 <= written < len(rows), "the job was not stopped midway"
    assert out.read_text().endswith("\n")  # no record cut
    again = subprocess.run(command(*job), capture_output=True, env=environment(), timeout=300)
    assert again.returncode == 0, again.stderr.decode()
    assert sorted(complete_ids(out)) == sorted(row["id"] for row in rows)


def test_an_output_in_a_folder_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", records(2, max_tokens=4))
    with read_only(tmp_path / "ro") as folder:  # it said only errno's words, after a warning about the lock
        done = subprocess.run(command("batch", tmp_path / "in.jsonl", folder / "out.jsonl", "--no-progress"),
                              capture_output=True, env=environment(), timeout=300)
    err = done.stderr.decode()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: OUTPUT {folder / 'out.jsonl'} cannot be written (") and \
        err.endswith("give OUTPUT in a folder this job can write\n"), err


def test_a_resumed_job_names_edited_and_removed_records_and_redoes_the_edited_ones(tmp_path, pair):
    rows = records(4, max_tokens=6)
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    job = ["batch", tmp_path / "in.jsonl", out, "--no-progress"]
    first = subprocess.run(command(*job), capture_output=True, env=environment(), timeout=300)
    assert first.returncode == 0, first.stderr.decode()
    before = {row["id"]: row for row in read_output(out)}
    assert len(before) == 4
    assert all(before[row["id"]]["request_hash"] == request_hash(row, ModelSpec()) for row in rows)

    edited = {**rows[1], "prompt": "def edited(x):\n    "}
    write_jsonl(tmp_path / "in.jsonl", [rows[0], edited, rows[3]])  # r1 edited, r2 removed
    resumed = subprocess.run(command(*job), capture_output=True, env=environment(), timeout=300)
    err = resumed.stderr.decode()
    assert resumed.returncode == 0, err
    assert "warning: 1 id of" in err and '"r1"' in err and "--redo-changed" in err, err
    assert "no longer in" in err and '"r2"' in err, err
    assert read_output(out) == list(before.values())  # warned, nothing changed

    redone = subprocess.run(command(*job, "--redo-changed"), capture_output=True, env=environment(), timeout=300)
    err = redone.stderr.decode()
    assert redone.returncode == 0, err
    assert "redoing 1 id of" in err and '"r1"' in err and "1 records (0 with errors, 2 already done)" in err, err
    after = read_output(out)
    assert sorted(row["id"] for row in after) == ["r0", "r1", "r2", "r3"]  # one line per id; r2's kept
    by_id = {row["id"]: row for row in after}
    assert by_id["r1"]["token_ids"] == alone(pair, edited) != before["r1"]["token_ids"]
    assert by_id["r1"]["request_hash"] == request_hash(edited, ModelSpec())
    assert {i: by_id[i] for i in ("r0", "r2", "r3")} == {i: before[i] for i in ("r0", "r2", "r3")}
    assert not list(tmp_path.glob(".out.jsonl.*"))  # the temporary file was renamed into place

    quiet = subprocess.run(command(*job), capture_output=True, env=environment(), timeout=300)
    assert "changed" not in quiet.stderr.decode() and '"r1"' not in quiet.stderr.decode()


def test_the_request_hash_follows_what_decides_the_answer():
    spec = ModelSpec(max_new_tokens=16)
    row = {"id": 1, "prompt": "x", "max_tokens": 16, "temperature": 0, "stop": "\n"}
    same = [{"id": 2, "prompt": "x", "stop": ["\n"], "label": "ignored"},  # defaults, another id, dataset keys
            {"id": 1, "prompt": "x", "max_tokens": 16, "temperature": 0.0, "seed": None, "stop": ["\n"],
             "messages": None}]  # Parquet's form: every column, null where left out
    other = [{**row, "prompt": "y"}, {**row, "max_tokens": 17}, {**row, "temperature": 0.5},
             {**row, "seed": 3}, {**row, "stop": None}, {"id": 1, "messages": [{"role": "user", "content": "x"}]}]
    assert all(request_hash(r, spec) == request_hash(row, spec) for r in same)
    assert len({request_hash(r, spec) for r in [row, *other]}) == 1 + len(other)
    assert request_hash({"id": 1, "prompt": "x"}, spec) != request_hash({"id": 1, "prompt": "x"},
                                                                        ModelSpec(max_new_tokens=8))


def test_the_lock_is_held_until_close_and_refused_meanwhile(tmp_path):
    out = tmp_path / "out.jsonl"
    held = OutputFile(out)
    with pytest.raises(OutputInUse, match=f"in use by another batch job \\(pid {os.getpid()}, started"):
        OutputFile(out)
    held.close()
    assert not (tmp_path / "out.jsonl.lock").exists()
    OutputFile(out).close()


def test_a_disk_that_fills_leaves_whole_lines_and_says_how_to_go_on(tmp_path):
    """A full disk cut OUTPUT's last line in half (a file-size limit stands in for the disk)."""
    code = f"""
import resource, signal, sys
from speculative.entrypoints.batch_files import OutputFile
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, a write fails with EFBIG
out = OutputFile({str(tmp_path / "out.jsonl")!r})
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
try:
    for i in range(100):
        out.write({{"id": i, "text": "x" * 150}})
except OSError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "out.jsonl").read_text()
    assert text.endswith("\n") and 0 < len(text) <= 1000
    lines = text.splitlines()
    assert [json.loads(line)["id"] for line in lines] == list(range(len(lines)))
    assert f"OUTPUT {tmp_path / 'out.jsonl'} cannot take another record" in done.stdout
    assert f"the {len(lines)} it holds are whole: make room, then run the same command to go on" in done.stdout
