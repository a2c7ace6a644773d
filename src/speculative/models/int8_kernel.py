"""The compiled kernels (`csrc/`): the int8 product (int8_matmul.cpp), the GGUF blocks' products
(kquant_matmul.cpp, q32_matmul.cpp) and a quantized decoder's norms, attention and SwiGLU's
gate (block_ops.cpp), built once with the system's C++ compiler into one library, cached, and
loaded into PyTorch as `torch.ops.speculative_kernels`.

Why a kernel of our own: fbgemm's dynamic int8 linear needs its weights repacked by a slow
single-threaded routine at every start (150-250 MB/s: 5-7 s for Qwen2.5-Coder 1.5B) and
quantizes a call's whole input with one scale, which `kernels.Int8Linear` has to work around
with extra operations. This kernel quantizes each row on its own (width-invariant by
construction), packs weights at 1.5-2 GB/s, reads them in one stream, and gives the same bits
on AMX, AVX512-VNNI, AVX2 and plain C++ (exact int32 sums, then the same float operations).

Where it lives: `$SPECULATIVE_KERNEL_CACHE`, else the cache root's `kernels/` folder
(~/.cache/speculative/kernels), one folder per source, PyTorch and compiler version, with the
checksum the library had when built (a file that no longer matches it is compiled again, with a
message); one process builds it while others wait for it, and a cache that cannot be written
gets a build in a temporary folder, said once; delete it to rebuild. A build that takes more
than SPECULATIVE_KERNEL_BUILD_TIMEOUT seconds (600) is given up with an error.
`SPECULATIVE_INT8_KERNEL=fbgemm` keeps fbgemm; `compiled` makes a failed build an error
instead of a fallback to fbgemm.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..core import disk_cache
from . import isa

log = logging.getLogger("speculative")

CSRC = Path(__file__).parent / "csrc"
# One library; csrc/*.h shared.
SOURCES = [CSRC / name for name in ("int8_matmul.cpp", "kquant_matmul.cpp", "q32_matmul.cpp", "block_ops.cpp",
                                     "attention.cpp", "argmax_screen.cpp")]
CHOICES = ("auto", "compiled", "fbgemm")
PRIVATE = "speculative-kernels-"  # the temporary folder of a build where the cache cannot be written


def kernel_choice() -> str:
    """SPECULATIVE_INT8_KERNEL: auto (compiled where it builds), compiled, or fbgemm."""
    choice = os.environ.get("SPECULATIVE_INT8_KERNEL", "auto")
    if choice not in CHOICES:
        raise ValueError(f"SPECULATIVE_INT8_KERNEL={choice!r}; allowed: {', '.join(CHOICES)}")
    return choice


def compiled_ops(required: bool = False):
    """torch.ops.speculative_kernels, or None where the kernel is not wanted or cannot be built
    (no compiler; the reason is logged). Raises when it cannot be built and SPECULATIVE_INT8_KERNEL
    is `compiled` or it is `required` (the k-quant layers of `kquant.py`, which have no fallback)."""
    choice = kernel_choice()
    if choice == "fbgemm" and not required:
        return None
    ops, reason = _load()
    if ops is None and (choice == "compiled" or required):
        raise RuntimeError(f"the compiled kernels (models/csrc) cannot be built here: {reason}")
    if ops is None:
        _fall_back(reason)
    return ops


@functools.lru_cache(maxsize=1)
def _fall_back(reason: str) -> None:
    """Says once that int8 layers run fbgemm, and why."""
    log.warning("the compiled kernels did not build, so int8 layers run fbgemm: %s", reason)


@functools.lru_cache(maxsize=1)
def _load():
    """(ops, None) or (None, why not); once per process (a library loads only once)."""
    if sys.platform != "linux" and sys.platform != "darwin":
        return None, f"not built on {sys.platform}"
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return None, "no C++ compiler (set CXX, or install g++)"
    try:
        library = _build(compiler)
        torch.ops.load_library(str(library))
        if library.parent.name.startswith(PRIVATE):  # this process's own build, loaded: nothing left in /tmp
            shutil.rmtree(library.parent, ignore_errors=True)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        return None, f"{type(error).__name__}: {str(error)[-2000:]}"
    ops = torch.ops.speculative_kernels
    isa.apply(ops)
    return ops, None


def _flags() -> list[str]:
    include = Path(torch.__file__).parent / "include"  # (torch.utils.cpp_extension would import setuptools)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # No -march: each instruction set is a function of its own, chosen at run time, so the
    # library runs on any x86 CPU (and the cache may be shared between machines). No fused
    # multiply-adds (-ffp-contract=off): every instruction set rounds alike. -fno-trapping-math
    # (results unchanged; floating-point exceptions are never read) lets AVX2 code vectorize
    # loops with a clamp or a select, e.g. SwiGLU's gate and the softmax's exp: without it they
    # ran one float at a time there (AVX512's masks need no such leave).
    return ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-w", f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]


def _build(compiler: str) -> Path:
    """The library for this source, PyTorch and compiler, compiled if not yet cached, or
    compiled again (once, saying so) where the cached file does not match the checksum recorded
    when it was built: a truncated or damaged file would kill the process at load (SIGBUS,
    SIGILL) with no message, on every run. One process builds while the others wait for its
    result; where the cache cannot be written, it is built in a temporary folder (said once).
    The library holds every instruction set's code and picks one at run time, so a cache shared
    between machines of other CPUs is safe."""
    timeout = build_timeout()
    library = library_path(compiler, timeout)
    if _whole(library):
        return library
    with disk_cache.lock(library) as unwritable:  # (removes what a killed build left)
        if unwritable:
            private = Path(tempfile.mkdtemp(prefix=PRIVATE)) / library.name
            disk_cache.say_once(f"the kernel cache {library.parent} cannot be written ({unwritable.strerror}): "
                                "compiling it for this process alone, again at every start; set "
                                "SPECULATIVE_KERNEL_CACHE to a writable folder to keep it")
            _compile(compiler, timeout, private)
            return private
        if _whole(library):  # built by another process while this one waited
            return library
        if library.exists():
            disk_cache.say(f"the cached kernel library {library} does not match the checksum recorded when it was "
                           "built (damaged, or built by an older version): compiling it again")
        _compile(compiler, timeout, library)
    return library


def _whole(library: Path) -> bool:
    recorded = library.with_suffix(".sha256")
    return library.is_file() and recorded.is_file() and recorded.read_text().strip() == file_sha256(library)


def _compile(compiler: str, timeout: float, library: Path) -> None:
    """Compiles into a name of this process's own, then renames: whole or absent, never half-written."""
    partial = disk_cache.partial(library)
    torch_lib = Path(torch.__file__).parent / "lib"
    command = [compiler, *_flags(), *map(str, SOURCES), "-o", str(partial), f"-L{torch_lib}", "-lc10", "-ltorch_cpu"]
    cached = "" if library.parent.name.startswith(PRIVATE) else f"; once: cached in {library.parent}"
    disk_cache.say(f"compiling the int8 kernel (about a minute{cached})")
    written = disk_cache.partial(library)
    try:
        done = _run(command, timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:2])} ... failed:\n{done.stderr}")
        written.write_text(file_sha256(partial) + "\n")
        os.replace(partial, library)
        os.replace(written, library.with_suffix(".sha256"))  # after the library: a kill between leaves it rebuilt
    except BaseException:  # a failure, a timeout, a disk full or Ctrl-C: nothing half-written is left
        partial.unlink(missing_ok=True)
        written.unlink(missing_ok=True)
        raise


def library_path(compiler: str, timeout: float = 60) -> Path:
    """Where the library for this source, PyTorch and compiler is cached."""
    from .presets import cache_root

    version = _run([compiler, "--version"], min(60, timeout)).stdout
    texts = [file.read_text() for file in [*SOURCES, *sorted(CSRC.glob("*.h"))]]
    digest = hashlib.sha256("\n".join([*texts, torch.__version__, version, *_flags()]).encode())
    root = Path(os.environ.get("SPECULATIVE_KERNEL_CACHE") or cache_root() / "kernels")
    return root / f"int8_matmul-{digest.hexdigest()[:16]}" / "int8_matmul.so"


def build_timeout() -> float:
    """SPECULATIVE_KERNEL_BUILD_TIMEOUT: seconds a build may take (default 600) before it is
    given up, with an error that says so (a compiler that never finishes must not hang a run)."""
    text = os.environ.get("SPECULATIVE_KERNEL_BUILD_TIMEOUT", "600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"SPECULATIVE_KERNEL_BUILD_TIMEOUT={text!r}; allowed: a number of seconds above 0")
    return seconds


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{command[0]} did not finish within {timeout:g} s (SPECULATIVE_KERNEL_BUILD_TIMEOUT); "
                           "the kernel is not built") from None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
