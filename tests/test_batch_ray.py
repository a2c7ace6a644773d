"""`speculative batch --ray` on real Ray clusters started by the tests: a local one of 2 CPUs
(one per module), and a two-node one started with `ray start`. Every record exactly once,
the same tokens as in one process, through actor deaths and resumed jobs."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from speculative.entrypoints.batch import ModelSpec, run_local  # noqa: E402
from speculative.entrypoints.batch_ray import run_ray  # noqa: E402
from tests.test_batch_job import alone, pair, read_output, records, write_jsonl  # noqa: E402,F401
from tests.test_cli_errors import command, environment  # noqa: E402

RAY = Path(sys.executable).with_name("ray")
# Real Ray clusters take many seconds to start; test_batch_job.py checks the same records in one process.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs for this module, shut down at its end."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def actor_pids() -> list[int]:
    """Processes of this module's batch actors: descendants of this process (the cluster
    it started), never another cluster's."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "GenerateBatch" in " ".join(process.cmdline()):
                found.append(process.pid)
        except psutil.Error:
            pass
    return found


def test_forty_records_on_two_actors_equal_one_process(tmp_path, cluster, pair):
    """40 records (30 greedy, 10 seeded sampled) and 2 bad ones on 2 actors, resuming from an
    output that holds 4 records and a partly written line: every id once; greedy records
    equal to their prompt decoded alone, sampled ones to one process with other batches."""
    rows = records(40, max_tokens=16, sampled_every=4)
    bad = [{"id": "wrong-type", "prompt": {"text": "x"}}, {"id": "out-of-range", "prompt": [5, 70000]}]
    write_jsonl(tmp_path / "in.jsonl", rows + bad)
    run_local(tmp_path / "in.jsonl", tmp_path / "local.jsonl", ModelSpec(max_batch_size=8), show_progress=False)
    local = {row["id"]: row for row in read_output(tmp_path / "local.jsonl")}
    out = tmp_path / "out.jsonl"
    earlier = [local[f"r{i}"] for i in (3, 10, 17, 33)]
    out.write_text("".join(json.dumps(row) + "\n" for row in earlier) + '{"id": "r5", "te')
    summary = run_ray(tmp_path / "in.jsonl", out, ModelSpec(max_batch_size=4), actors=2, threads=1,
                      show_progress=False)
    assert summary.workers == 2 and summary.skipped == 4 and summary.records == 38 and summary.errors == 2
    written = read_output(out)
    assert written[:4] == earlier
    assert sorted(row["id"] for row in written) == sorted(row["id"] for row in rows + bad)
    by_id = {row["id"]: row for row in written}
    output = lambda row: (row.get("text"), row.get("token_ids"), row.get("finish_reason"), row.get("error"))  # noqa
    # (drafted, accepted and target_forwards follow adaptive K, which follows timings)
    assert {i: output(row) for i, row in by_id.items()} == {i: output(row) for i, row in local.items()}
    for row in rows:
        if "temperature" not in row:
            assert by_id[row["id"]]["token_ids"] == alone(pair, row), row["id"]
    assert "token id 70000, outside the vocabulary" in by_id["out-of-range"]["error"]
    assert "\"prompt\" must be a string" in by_id["wrong-type"]["error"]
    assert 0 < summary.first_record_seconds < summary.seconds and 0 < summary.step_seconds
    assert 0 < summary.ready_seconds < summary.first_record_seconds  # the actors' clocks: one machine


def test_an_actor_killed_midway_costs_nothing(tmp_path, cluster, pair):
    """SIGKILL to one actor's process after the first records arrive: Ray restarts it and
    retries its batch; the output still holds every record exactly once, and right."""
    rows = records(24, max_tokens=24)
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    killed: list = []

    def kill_one_actor():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pids = actor_pids()
            if len(pids) == 2 and out.exists() and out.read_text().count("\n") >= 1:
                written = out.read_text().count("\n")
                os.kill(pids[0], signal.SIGKILL)
                killed.append((pids[0], written))
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_one_actor, daemon=True)
    watcher.start()
    summary = run_ray(tmp_path / "in.jsonl", out, ModelSpec(max_batch_size=4), actors=2, threads=1,
                      show_progress=False)
    watcher.join(timeout=5)
    assert killed, "no actor was killed"
    pid, written_then = killed[0]
    assert written_then < len(rows), "the job was over before the kill"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    written = read_output(out)
    assert sorted(row["id"] for row in written) == sorted(row["id"] for row in rows)  # once each
    assert summary.records == len(rows) and summary.errors == 0
    for row in written:
        assert row["token_ids"] == alone(pair, next(r for r in rows if r["id"] == row["id"]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """End a `ray start --block` node and every process it started, by their ids: SIGTERM
    first (Ray's processes shut down on it), SIGKILL for what is left after 20 s."""
    try:
        family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.Error:
        family = []
    for member in family:
        try:
            member.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(family, timeout=20)
    for member in alive:
        member.kill()
    psutil.wait_procs(alive, timeout=10)
    process.wait(timeout=10)


def test_two_nodes_on_one_machine(tmp_path, pair):
    """`ray start --head` and a second `ray start --address`, one CPU each: a job of 2 actors
    joins that cluster (--ray ADDRESS) and runs across both nodes."""
    rows = records(8, max_tokens=12)
    write_jsonl(tmp_path / "in.jsonl", rows)
    port = free_port()
    temps = [tempfile.mkdtemp(prefix="rt", dir="/tmp") for _ in range(2)]  # short: socket paths fit 107 bytes
    # Token authentication off: a ~/.ray/auth_token left by another tool would turn it on
    # for `ray start` but not for `ray status`, which then cannot see the head node.
    env = {**environment(), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    nodes = []
    try:
        nodes.append(subprocess.Popen([str(RAY), "start", "--head", "--block", "--num-cpus", "1", "--port", str(port),
                                       "--include-dashboard", "false", "--temp-dir", temps[0], "--disable-usage-stats"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        address = f"127.0.0.1:{port}"
        wait_for(lambda: subprocess.run([str(RAY), "status", "--address", address], capture_output=True,
                                        env=env).returncode == 0, "the head node")
        nodes.append(subprocess.Popen([str(RAY), "start", "--address", address, "--block", "--num-cpus", "1",
                                       "--temp-dir", temps[1]],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
        wait_for(lambda: status_nodes(address, env) == 2, "the second node")
        result = subprocess.run(command("batch", tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--ray", address,
                                        "--actors", "2", "--max-batch-size", "2", "--no-progress"),
                                capture_output=True, env=env, timeout=300)
        err = result.stderr.decode()
        assert result.returncode == 0, err
        assert f"{len(rows)} records (0 with errors" in err and "on 2 actors across 2 nodes" in err, err
        written = read_output(tmp_path / "out.jsonl")
        assert sorted(row["id"] for row in written) == sorted(row["id"] for row in rows)
        for row in written:
            assert row["token_ids"] == alone(pair, next(r for r in rows if r["id"] == row["id"]))
    finally:
        for node in reversed(nodes):
            stop(node)
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)


def status_nodes(address: str, env: dict) -> int:
    """Active nodes as `ray status` lists them."""
    text = subprocess.run([str(RAY), "status", "--address", address], capture_output=True, env=env).stdout.decode()
    active = text.split("Active:")[-1].split("Pending:")[0] if "Active:" in text else ""
    return sum(1 for line in active.splitlines() if "node_" in line)


def wait_for(ready, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not start within {seconds} s")
        time.sleep(0.5)
