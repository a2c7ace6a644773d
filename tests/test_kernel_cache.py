"""The compiled kernels' cache heals itself (issue 62): a cached library that no longer matches
the checksum recorded when it was built (truncated, bits flipped) is compiled again, with a
message, and never loaded (loading it killed every run with SIGBUS or SIGILL and no word); a
compiler that fails or never finishes is named in the error, not fbgemm; two processes building
at once compile once, and a build killed midway leaves nothing that loads."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from speculative.models import int8_kernel

LOAD = ("from speculative.models.int8_kernel import compiled_ops; import torch; ops = compiled_ops(required=True); "
        "x = torch.ones(1, 64); print(ops.isa(), float(ops.block_rms_norm(x, x[0], 1e-6, 'auto').sum()))")


def python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "SPECULATIVE_INT8_KERNEL": "compiled", **env})


@pytest.fixture
def cache(tmp_path):
    """A copy of this machine's built library, as a cache of its own."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None or int8_kernel.compiled_ops() is None:
        pytest.skip("no C++ compiler here")
    built = int8_kernel.library_path(compiler)
    copy = tmp_path / "kernels" / built.parent.name
    shutil.copytree(built.parent, copy)
    return copy / built.name


@pytest.mark.slow  # two real builds
def test_a_damaged_library_is_compiled_again_with_a_message_and_never_loaded(cache):
    env = {"SPECULATIVE_KERNEL_CACHE": str(cache.parent.parent)}
    assert cache.with_suffix(".sha256").read_text().strip() == int8_kernel.file_sha256(cache)
    first = python(LOAD, **env)
    assert first.returncode == 0 and "compiling" not in first.stderr, first.stderr  # intact: loaded as it is
    data = cache.read_bytes()
    for damage in (data[:len(data) // 2], data[:len(data) // 2] + bytes(255 - b for b in data[len(data) // 2:])):
        cache.write_bytes(damage)  # truncated; then its second half's bits flipped, still an ELF file
        healed = python(LOAD, **env)
        assert healed.returncode == 0, healed.stderr
        assert "does not match the checksum recorded" in healed.stderr and "compiling the int8 kernel" in healed.stderr
        assert healed.stdout.split()[1] == first.stdout.split()[1]
        assert cache.with_suffix(".sha256").read_text().strip() == int8_kernel.file_sha256(cache)
    assert not list(cache.parent.glob("*.partial*"))


def test_a_failing_or_hanging_compiler_is_named_in_the_error(tmp_path):
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    env = {"SPECULATIVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    failing = python(LOAD, CXX="false", **env)
    assert failing.returncode != 0 and "false " in failing.stderr and "failed" in failing.stderr
    hanging = python(LOAD, CXX=str(hang), SPECULATIVE_KERNEL_BUILD_TIMEOUT="2", **env)
    assert hanging.returncode != 0 and "did not finish within 2 s" in hanging.stderr
    int8 = python("from speculative import load_model; load_model('default', dtype='int8')", CXX="false", **env)
    assert int8.returncode != 0 and "failed" in int8.stderr and "fbgemm" not in int8.stderr, int8.stderr
    bad = python(LOAD, SPECULATIVE_KERNEL_BUILD_TIMEOUT="soon", **env)
    assert "SPECULATIVE_KERNEL_BUILD_TIMEOUT='soon'" in bad.stderr and "above 0" in bad.stderr
    assert not list((tmp_path / "kernels").rglob("*.partial*"))


def start(code: str, **env) -> subprocess.Popen:
    """`python -c code` in a process group of its own (its compiler with it)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "SPECULATIVE_INT8_KERNEL": "compiled", **env})


def needs_compiler():
    if shutil.which(os.environ.get("CXX", "c++")) is None or int8_kernel.compiled_ops() is None:
        pytest.skip("no C++ compiler here")


@pytest.mark.slow  # one real build
def test_two_processes_building_at_once_both_load_the_library_and_compile_it_once(tmp_path):
    needs_compiler()
    env = {"SPECULATIVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    runs = [start(LOAD, **env) for _ in range(2)]
    done = [run.communicate(timeout=1200) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in done]
    assert done[0][0] == done[1][0]
    assert sum(err.count("compiling the int8 kernel") for _, err in done) == 1, [err for _, err in done]
    assert any("waiting for another process" in err for _, err in done)
    assert not list((tmp_path / "kernels").rglob("*partial*"))


@pytest.mark.slow  # a build killed, then a whole one
def test_a_build_killed_midway_leaves_nothing_that_loads_and_the_next_run_builds_it(tmp_path):
    needs_compiler()
    env = {"SPECULATIVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    killed = start(LOAD, **env)
    said = next((line for line in killed.stderr if "compiling the int8 kernel" in line), "")
    assert said, killed.stderr.read()
    time.sleep(5)  # the compiler is at work
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    assert not [path for path in (tmp_path / "kernels").rglob("*") if path.suffix in (".so", ".sha256")]
    after = python(LOAD, **env)
    assert after.returncode == 0 and "compiling the int8 kernel" in after.stderr, after.stderr
    assert after.stdout == python(LOAD).stdout  # this machine's own cache
    assert not list((tmp_path / "kernels").rglob("*partial*"))


@pytest.mark.slow  # one real build
def test_a_cache_that_cannot_be_written_gets_a_build_for_the_process_alone_said_once(tmp_path):
    from tests.test_cache_faults import read_only

    needs_compiler()
    (tmp_path / "tmp").mkdir()
    with read_only(tmp_path / "kernels") as folder:  # it gave an OSError, or silently fbgemm
        done = python(LOAD, SPECULATIVE_KERNEL_CACHE=str(folder), TMPDIR=str(tmp_path / "tmp"))
        assert not list(folder.iterdir())
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("cannot be written") == 1 and "for this process alone" in done.stderr, done.stderr
    assert done.stdout == python(LOAD).stdout
    assert not list((tmp_path / "tmp").iterdir())  # the build was removed once loaded
