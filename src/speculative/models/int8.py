"""int8 models: every linear layer width-invariant int8 (`kernels.Int8Linear`), activations,
attention and norms in float32, and the quantized weights cached on disk.

A model in int8 is a model of its own: its reference is itself decoding one token at a
time, and since its layers and attention give each token the same bits whatever the
width of the forward, speculative output is token-identical to that reference.

Checkpoints that the built-in decoder computes (Llama, Qwen2, Gemma 3: `native.py`) are quantized
one layer at a time while they are read, and the result is written to the cache
(`$SPECULATIVE_CACHE/int8/NAME-KEY/`, ~/.cache/speculative by default) as `core/disk_cache.py`
writes every cache: one safetensors file per block under a name of this process's own, then a
manifest of every file's SHA-256, then a rename into place, under a lock that a second process
making the same entry waits on. The key hashes the checkpoint's files (names, sizes,
modification times) and this format's version: a changed checkpoint gets a new entry. A later
start checks the files against the manifest (hashed in full the first time and after any
change; a damaged entry is quantized again, with a message), reads the int8 weights (a
quarter of float32's bytes) and packs them, in seconds. A cache folder that cannot be written
leaves the model in memory, said once. Delete the `int8` folder to clear it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


import torch
from torch import nn

from ..core import disk_cache
from .decoder_only import DecoderOnlyConfig, DecoderOnlyLM
from .gemma3 import Gemma3Config, Gemma3LM
from .int8_kernel import compiled_ops
from .kernels import Int8Embedding, Int8Linear, quantize_linears, quantize_rows

log = logging.getLogger("speculative")

FORMAT = 3  # 2: smoothed before quantizing (smoothing.py); 3: smoothing chosen per layer
MANIFEST = "int8-manifest.json"
# The model class each configuration builds (a subclass's before its base's).
MODEL_CLASSES = {Gemma3Config: Gemma3LM, DecoderOnlyConfig: DecoderOnlyLM}


def model_class(cfg: DecoderOnlyConfig) -> type[DecoderOnlyLM]:
    """The built-in decoder class that `cfg` configures (Gemma 3's or the plain one)."""
    return next(model for config, model in MODEL_CLASSES.items() if isinstance(cfg, config))


def quantize_model(model: nn.Module) -> int:
    """A float model in int8, in place: a built-in decoder fused (`DecoderOnlyLM.fuse`), its
    linear layers (the output layer included) and its input embeddings in int8 (Gemma 3
    scales what the int8 lookup gives, in float32: `Gemma3LM.embed`); other models' linear
    layers. Returns how many layers are int8."""
    if isinstance(model, DecoderOnlyLM):
        model.fuse()
        count = quantize_linears(model)
        model.embed_tokens = Int8Embedding(model.embed_tokens.weight)
        model.use_compiled_blocks(compiled_ops())
        return count + 1
    return quantize_linears(model)


def cache_directory(path: Path) -> Path:
    """Where the int8 weights of the checkpoint at `path` are cached."""
    from .presets import cache_root

    digest = hashlib.sha256(f"format {FORMAT}\n{path.resolve()}\n".encode())
    for file in sorted([*path.glob("*.safetensors"), path / "config.json"]):
        stat = file.stat()
        digest.update(f"{file.name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return cache_root() / "int8" / f"{path.resolve().name}-{digest.hexdigest()[:16]}"


def load_cached(path: Path, cfg: DecoderOnlyConfig, float_reader, progress: bool = True) -> DecoderOnlyLM:
    """The int8 model of a checkpoint: from the cache when it holds it whole, else quantized
    from `float_reader()(name)` (the float weights of the fused model's layers; made only
    when needed: smoothing tokenizes its calibration text) and cached."""
    directory = cache_directory(path)
    model, damage = _cached(directory, cfg)
    if model is None:
        with disk_cache.lock(directory) as unwritable:
            if not unwritable:  # another process may have made it while this one waited
                model, damage = _cached(directory, cfg)
            if model is None and disk_cache.adopt_older(directory, MANIFEST, unwritable):  # quantizing takes minutes
                model, damage = _cached(directory, cfg) if not unwritable else (_read(directory, cfg), None)
            if model is None:
                if damage:
                    disk_cache.say(f"the int8 cache {directory} is damaged ({damage}): quantizing {path.name} again")
                if unwritable:
                    disk_cache.say_once(f"the cache folder {directory.parent} cannot be written "
                                        f"({unwritable.strerror}): int8 weights are quantized in memory, again at "
                                        "every start; set SPECULATIVE_CACHE to a writable folder to keep them")
                model = _quantize_and_write(None if unwritable else directory, cfg, float_reader(), progress)
    model.use_compiled_blocks(compiled_ops())
    return model


def _cached(directory: Path, cfg: DecoderOnlyConfig) -> tuple[DecoderOnlyLM | None, str | None]:
    """(the model the cache holds, None), or (None, what is wrong with it; None where absent)."""
    from safetensors import SafetensorError

    if not directory.exists():
        return None, None
    damage = disk_cache.damage(directory, MANIFEST)
    if damage is None:
        try:
            return _read(directory, cfg), None
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:  # whole, yet not this model's
            damage = f"{type(error).__name__}: {error}"
    return None, damage


def _skeleton(cfg: DecoderOnlyConfig) -> DecoderOnlyLM:
    with torch.device("meta"):
        return model_class(cfg)(cfg).fuse()


def _groups(model: DecoderOnlyLM) -> list[tuple[str, list[str]]]:
    """(file stem, module names) for each file of the cache: one per block, one for the rest."""
    groups = [(f"layers.{i}", [f"layers.{i}.{name}" for name, _ in layer.named_modules() if name])
              for i, layer in enumerate(model.layers)]
    return groups + [("outer", ["embed_tokens", "norm", "lm_head"])]


def _quantize_and_write(directory: Path | None, cfg: DecoderOnlyConfig, read_float, progress: bool) -> DecoderOnlyLM:
    """The int8 model, quantized part by part while read, each part written to the cache
    (`directory`; None: in memory only)."""
    from tqdm import tqdm

    model = _skeleton(cfg)
    writer = _Writer(directory)
    for stem, names in tqdm(_groups(model), desc="quantizing to int8 (once; cached)", unit="part",
                            disable=not progress):
        tensors = {}
        for name in names:
            module = model.get_submodule(name)
            if type(module) is nn.Linear:
                qweight, scale = quantize_rows(read_float(f"{name}.weight"))
                bias = read_float(f"{name}.bias").float() if module.bias is not None else None
                tensors.update({f"{name}.qweight": qweight, f"{name}.scale": scale})
                if bias is not None:
                    tensors[f"{name}.bias"] = bias
                _replace(model, name, Int8Linear.from_int8(qweight, scale, bias))
            elif isinstance(module, nn.Embedding):
                embedding = Int8Embedding(read_float(f"{name}.weight"))
                tensors.update({f"{name}.qweight": embedding.qweight, f"{name}.scale": embedding.scale})
                _replace(model, name, embedding)
            else:
                for leaf, parameter in module.named_parameters(recurse=False):
                    tensor = read_float(f"{name}.{leaf}").float().contiguous()
                    tensors[f"{name}.{leaf}"] = tensor
                    setattr(module, leaf, nn.Parameter(tensor, requires_grad=False))
        writer.write(lambda folder: _save(tensors, folder / f"{stem}.safetensors"))
    writer.write(lambda folder: (folder / "config.json").write_text(
        json.dumps({"format": FORMAT, **model.options()}, indent=1) + "\n"))
    writer.write(lambda folder: disk_cache.record(folder, MANIFEST))
    writer.write(lambda folder: disk_cache.publish(folder, directory))
    return model.eval()


class _Writer:
    """A cache entry written under a partial name, step by step; where a step fails (a disk
    full), the entry is dropped and said so: the model being made is kept, in memory only."""

    def __init__(self, directory: Path | None):
        self.directory, self.folder = directory, None

    def write(self, step) -> None:
        if self.directory is None:
            return
        try:
            if self.folder is None:
                self.folder = disk_cache.partial(self.directory)
                self.folder.mkdir()
            step(self.folder)
        except OSError as error:
            if self.folder is not None:
                disk_cache.remove(self.folder)
            disk_cache.say_once(f"the int8 cache {self.directory} could not be written ({error}): the model stays "
                                "in memory only, and is quantized again at the next start")
            self.directory = None


def _read(directory: Path, cfg: DecoderOnlyConfig) -> DecoderOnlyLM:
    from safetensors import safe_open

    model = _skeleton(cfg)
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as packing:  # most of a start; in C++, in parallel
        for stem, names in _groups(model):
            with safe_open(str(directory / f"{stem}.safetensors"), "pt") as mapped:
                keys = set(mapped.keys())

                def stored(key):  # a copy: a view would keep the whole file mapped
                    return mapped.get_tensor(key).clone()

                def pack(name):  # (packing copies the weights out of the file)
                    bias = stored(f"{name}.bias") if f"{name}.bias" in keys else None
                    return Int8Linear.from_int8(mapped.get_tensor(f"{name}.qweight"), stored(f"{name}.scale"), bias)

                linears = [name for name in names if type(model.get_submodule(name)) is nn.Linear]
                for name, layer in zip(linears, packing.map(pack, linears)):
                    _replace(model, name, layer)
                for name in names:
                    module = model.get_submodule(name)
                    if isinstance(module, nn.Embedding):
                        table = _mapped(directory / f"{stem}.safetensors", f"{name}.qweight")
                        _replace(model, name, Int8Embedding(table, stored(f"{name}.scale")))
                    elif not isinstance(module, Int8Linear):
                        for leaf, _ in list(module.named_parameters(recurse=False)):
                            setattr(module, leaf, nn.Parameter(stored(f"{name}.{leaf}"), requires_grad=False))
    release_freed_memory()
    return model.eval()


def _mapped(file: Path, key: str) -> torch.Tensor:
    """A tensor that stays a view of the file: only the pages read become resident (an
    embedding table, of which a request reads a few rows). Its own mapping, so that pages
    other tensors of the file were read through are not kept."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as mapped:
        return mapped.get_tensor(key)


def release_freed_memory() -> None:
    """Give the memory that loading freed back to the system (glibc keeps it otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def _save(tensors: dict, file: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(file))
    except SafetensorError as error:  # how its failed writes (a disk full) come: as the OSError they are
        raise OSError(f"{file.name}: {error}") from None
