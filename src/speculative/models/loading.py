"""Where models come from: local directories, GGUF files, and named presets. Never a hub.

- a directory written by `save_model` (config.json with a built-in model_type) loads
  as a built-in model; any other directory with config.json and safetensors weights
  loads through transformers (pickled .bin weights are refused);
- a .gguf file of a Llama, Qwen2 or Gemma 3 model loads on the built-in decoder, read by
  `gguf_source.py` (its own blocks where int8 runs fast); another architecture's through
  transformers, dequantized (`transformers_loading.py`);
- presets: `default` (the shipped verifier), `default-draft` and `default-s4d` (its
  drafts), `default-head` (its draft head, `models/head.py`), `gemma-3-270m`,
  `qwen2.5-coder-1.5b` and `qwen2.5-coder-0.5b` (GGUF files that PyPI packages carry, made
  into local safetensors once: `presets.py`), and `gemma-3-270m-head` (Gemma's draft head).

Every model loads in an execution dtype (`precision.py`: `auto` picks what the device runs
fast), and float32 models on CPUs get oneDNN linear layers (`kernels.py`).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path

import torch

from ..core.inputs import check_device
from . import MODEL_TYPES, DecoderOnlyLM, build_model, load_builtin, precision, presets
from .argmax_screen import prepare_screen
from .gemma3 import compile_transformers_norms
from .gguf_source import ARCHITECTURES as GGUF_ARCHITECTURES, architecture as gguf_architecture, load_gguf
from .gguf_source import read_metadata
from .gguf_tokenizer import gguf_tokenizer
from .head import HEAD_TYPE, load_head
from .int8 import quantize_model
from .int8_kernel import compiled_ops
from .kernels import int8_available, pack_linears, packing_available
from .kquant import auto_reason, load_preset
from .native import generation_eos, load_native, native_config
from .precision import GGUF, INT8, resolve_precision
from .text import TextTokenizer
from .transformers_loading import TOKENIZER_FILES, has_tokenizer, hf_tokenizer, load_gguf_file, load_transformers

log = logging.getLogger("speculative")

ASSETS = Path(__file__).parents[1] / "assets" / "default"  # speculative/assets: package data
# The draft head shipped for a target preset: target -> (head preset, its directory, the
# data `train-head --ship` makes it from).
HEADS = {"default": ("default-head", ASSETS / "head", "stdlib"),
         presets.GEMMA: ("gemma-3-270m-head", ASSETS.parent / "gemma-3-270m" / "head", "sharegpt")}
BUILTIN_PRESETS = {"default": ASSETS / "verifier", "default-draft": ASSETS / "draft",
                   "default-s4d": ASSETS / "draft_s4d", **{name: path for name, path, _ in HEADS.values()}}
PRESETS = [*BUILTIN_PRESETS, presets.GEMMA, *presets.CHUNKED]
# The draft each preset pairs with when none is named.
PARTNERS = {"default": "default-draft+ngram", "default-draft": "default-draft", "default-s4d": "default-s4d",
            "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b+ngram"}


def resolve(name_or_path) -> Path:
    """The local path behind a preset or a path; clear errors for anything else."""
    text = str(name_or_path)
    if text in BUILTIN_PRESETS:
        path = BUILTIN_PRESETS[text]
        if not (path / "config.json").is_file():
            heads = {name: (target, data) for target, (name, _, data) in HEADS.items()}
            command = (f"train-head --target {heads[text][0]} --data {heads[text][1]} --ship" if text in heads
                       else "train")
            raise FileNotFoundError(f"preset {text!r} is missing from this installation ({path}); "
                                    f"run `speculative {command}` to make it")
        return path
    made = presets.directory(text)
    if made is not None:
        return made
    path = Path(text).expanduser()
    if path.is_dir() and not (path / "config.json").exists():  # a folder holding one GGUF file (LM Studio's)
        files = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        if len(files) > 1:
            raise ValueError(f"{path} holds {len(files)} GGUF files ({', '.join(p.name for p in files[:4])}): "
                             "pass the one to load")
        return files[0] if files else path
    if path.exists():
        return path
    if "/" in text and not text.startswith((".", "/", "~")) and text.count("/") == 1:
        raise ValueError(f"{text!r} looks like a hub model name, but nothing is downloaded here: pass a local "
                         f"directory (config.json + safetensors), a .gguf file, or a preset ({', '.join(PRESETS)})")
    raise FileNotFoundError(f"{text} does not exist, and it is not a preset ({', '.join(PRESETS)})")


def load_model(name_or_path, device="cpu", dtype="auto", pack: bool | None = None):
    """A model that serves as target or draft, with its tokenizer attached when one is found.

    `dtype`: "auto" (what this device runs fast, logged with why on the "speculative" logger),
    "gguf", "int8" (`models/int8.py`), "float32", "bfloat16", "float16" or a torch dtype. Llama and Qwen2
    checkpoints run on the built-in decoder (`models/native.py`), other transformers
    models through transformers. `pack`: oneDNN linear layers for float32 and bfloat16 on CPUs, fused
    projections in the built-in decoder and transformers' Gemma 3 norms compiled (None: wherever
    available); a packed model is for inference only (as a GGUF's blocks are, which auto then never
    picks), so pass False to save, export or train with it. A packed model's large output layer gets
    its argmax screen now (`argmax_screen.py`; 0.2-0.4 s for Gemma 3 270M), not in its first request."""
    return _load(name_or_path, device, dtype, pack, screen=True)


def _load(name_or_path, device, dtype, pack: bool | None, screen: bool):  # screen: for targets only
    device = check_device(device)
    if dtype != GGUF:  # a bad name, before loading
        resolve_precision(dtype if dtype != "auto" else "float32", device, int8_runs=True)
    path = resolve(name_or_path)
    if not path.is_dir() and not path.is_file():  # a device, pipe or socket
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    if path.is_file():
        return _load_file(path, name_or_path, device, dtype, pack, screen)
    config = _checked_directory(path)
    if dtype == GGUF:
        return _load_kquant(path, config, device)
    weights = matrix_weights(path) if dtype == "auto" and path.is_dir() else None
    if weights is not None and pack is not False and (reason := auto_reason(path, device, weights)) is not None:
        return _load_kquant(path, config, device, reason)
    int8, torch_dtype, reason = resolve_precision(dtype, device, weights=weights, int8_runs=int8_available(device))
    log.info("%s: %s", name_or_path, reason)
    prepare = lambda m: _prepare(m, name_or_path, pack, int8, screen)  # noqa: E731
    if config.get("model_type") == HEAD_TYPE:  # drafts from a target's features: bound to it by the engine
        model = load_head(path, device, torch_dtype)
        if int8:
            log.info("%s: %d linear layers in int8", name_or_path, model.quantize())
        return model
    if config.get("model_type") in MODEL_TYPES:
        model = _load_builtin(path, config, device, torch_dtype)
        prepare(model)
        tokenizer_path = next((p / "tokenizer.json" for p in (path, path.parent)
                               if (p / "tokenizer.json").is_file()), None)
        model.tokenizer = _builtin_tokenizer(tokenizer_path) if tokenizer_path else None
        return model
    try:
        native = native_config(config)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path / 'config.json'}: {'no entry ' if isinstance(error, KeyError) else ''}{error}"
                         ) from None
    if native is not None:
        model = load_native(path, native, device, torch_dtype, int8)
        if not int8:
            prepare(model)
        model.tokenizer = _checkpoint_tokenizer(path, generation_eos(path)) if has_tokenizer(path) else None
        return model
    return load_transformers(path, device, torch_dtype, prepare)


def _load_file(path: Path, name, device, dtype, pack: bool | None, screen: bool):
    """A GGUF file: Llama, Qwen2 and Gemma 3 on the built-in decoder, read by `gguf_source.py`
    (`auto`: the file's own blocks where the kernels run fast, else decoded to a float dtype);
    other architectures through transformers, dequantized, where a float dtype is asked for."""
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf file; pass a model directory or a .gguf file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        metadata = read_metadata(path)
    except (struct.error, ValueError, IndexError, KeyError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} cannot be read as a GGUF file (is it truncated or corrupt? {path.stat().st_size} "
                         f"bytes): {type(error).__name__}: {error}") from None
    native = metadata.get("general.architecture") in GGUF_ARCHITECTURES
    if dtype == GGUF or (dtype == "auto" and native and torch.device(device).type == "cpu"
                         and precision.int8_runs_fast() and compiled_ops() is not None):
        reason = ("gguf, as asked" if dtype == GGUF else f"auto: gguf, the file's own blocks, since this CPU "
                  f"multiplies 8-bit integers {precision.int8_units()}") + " (int8 activations per block)"
        return load_gguf(path, device, GGUF, reason)
    if dtype == "auto" and not native:
        gguf_architecture(metadata, path)  # raises: what runs it
    int8, torch_dtype, reason = resolve_precision(dtype, device, int8_runs=int8_available(device))
    prepare = lambda m: _prepare(m, name, pack, int8, screen)  # noqa: E731
    if not native:
        log.info("%s: %s, through transformers", name, reason)
        return load_gguf_file(path, device, torch_dtype, prepare)
    model = load_gguf(path, device, torch_dtype, reason)
    prepare(model)
    return model


def _load_kquant(path: Path, config: dict, device, reason: str | None = None):
    """A GGUF preset on its file's own k-quant blocks (`kquant.py`); `reason`: auto's."""
    model = load_preset(path, config, device, reason)
    model.tokenizer = _checkpoint_tokenizer(path, generation_eos(path)) if has_tokenizer(path) else None
    return model


def _checked_directory(path: Path) -> dict:
    """A model directory's config, after its config and weight files are checked."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} holds no config.json: not a model directory")
    config = read_config(config_path)
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights)
    return config


def _load_builtin(path: Path, config: dict, device, dtype):
    """A built-in model, with config problems named with their file."""
    config_path = path / "config.json"
    try:
        _check_weight_count(path, config)
        return load_builtin(path, device=device, dtype=dtype)
    except KeyError as error:
        raise ValueError(f"{config_path} has no {error} entry, which a {config['model_type']} model needs") from None
    except (TypeError, ValueError) as error:
        if str(path) in str(error):
            raise
        raise ValueError(f"{config_path}: {error}") from None


def _check_weight_count(path: Path, config: dict) -> None:
    """Build the model on the meta device (no memory) and refuse a config that describes
    more weights than the directory's files hold, before anything is allocated (a
    config.json saying vocab_size 4M would otherwise allocate its tensors first)."""
    opts = {k: v for k, v in config.items() if k not in ("model_type", "dtype", "vocab_size")}
    with torch.device("meta"):
        needed = sum(p.numel() for p in build_model(config["model_type"], config["vocab_size"], opts).parameters())
    held = weight_elements(path)
    if needed > held:
        raise ValueError(f"{path / 'config.json'} describes a {config['model_type']} model of {needed:,} weights, but "
                         f"the safetensors files of {path} hold {held:,}: the config and the weights do not match")


def weight_elements(path: Path, matrices: bool = False) -> int:
    """Elements of the tensors (`matrices`: the 2-D ones) in a directory's safetensors files,
    read from their headers."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors(file)  # a corrupt file is named, not left to a reader's error
        with safe_open(str(file), "pt") as weights:
            shapes = [weights.get_slice(name).get_shape() for name in weights.keys()]
        total += sum(math.prod(shape) for shape in shapes if len(shape) == 2 or not matrices)
    return total


# Models with fewer linear weights than this run faster on PyTorch's own float32 layers:
# oneDNN's and int8's per-call overhead outweighs reading the weights (measured: the
# shipped 0.9M draft, 1.1 ms a token unpacked against 1.6 packed and 1.5 in int8; the
# 15.7M verifier, 8.3 against 8.0 and 5.9, and 13.5 against 9.5 for 5 tokens).
SMALL_MODEL = 4_000_000


def linear_weights(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if type(m) is torch.nn.Linear)


def _prepare(module: torch.nn.Module, name, pack: bool | None, int8: bool, screen: bool = False) -> None:
    """For inference: int8 layers, or fused projections (built-in decoder), oneDNN linear layers and
    transformers' Gemma 3 norms compiled, before any wrapper sees the layers (the output layer keeps its
    float weight: a reduced draft vocabulary takes rows from it), and with `screen` the output layer's
    argmax screen where one pays."""
    dtype, device = next(module.parameters()).dtype, next(module.parameters()).device
    if int8:
        log.info("%s: %d layers in int8", name, quantize_model(module))
        return
    if pack is not False and isinstance(module, DecoderOnlyLM):
        module.fuse()
    head = lambda: (module.get_output_embeddings() if hasattr(module, "get_output_embeddings")  # noqa: E731
                    else module.lm_head)
    if pack or pack is None and linear_weights(module) >= SMALL_MODEL and packing_available(dtype, device):
        log.info("%s: %d %s linear layers on oneDNN", name, pack_linears(module, keep_weight=head()),
                 str(dtype).removeprefix("torch."))
    if pack is not False and (norms := compile_transformers_norms(module)):
        log.info("%s: %d norms compiled", name, norms)
    if screen and pack is not False and prepare_screen(head()):
        log.info("%s: output layer screened for greedy rows", name)


def load_draft(name_or_path, device="cpu", dtype="auto"):
    """A draft model. `auto`: int8 on CPUs that run it, for drafts of at least SMALL_MODEL
    matrix weights and for draft heads, whatever their size (a head's weights are read
    anew after every target forward, which evicts them from the caches), or a GGUF preset's
    own blocks where `kquant.auto_reason` takes them; else as load_model's auto. A draft's
    precision changes its proposals, never the output."""
    path = resolve(name_or_path)
    if dtype == "auto" and path.is_dir() and int8_available(device) and (
            is_head(path) or matrix_weights(path) >= SMALL_MODEL):
        if (reason := auto_reason(path, device, 0, draft=True)) is not None:  # (a head is made from no GGUF)
            return _load_kquant(path, _checked_directory(path), device, reason)
        dtype = INT8
    return _load(name_or_path, device, dtype, None, screen=False)


def is_head(path: Path) -> bool:
    """Whether `path` is a draft head's directory."""
    config = path / "config.json"
    return path.is_dir() and config.is_file() and read_config(config).get("model_type") == HEAD_TYPE


def matrix_weights(path: Path) -> int:
    """Elements of the 2-D tensors in a model's safetensors files (a GGUF file counts as large)."""
    return SMALL_MODEL if path.is_file() else weight_elements(path, matrices=True)


def load_tokenizer(name_or_path) -> TextTokenizer:
    """The tokenizer of a model directory, GGUF file or preset."""
    path = resolve(name_or_path)
    if path.is_dir():
        for folder in (path, path.parent):
            config = folder / "config.json"
            builtin = config.is_file() and read_config(config).get("model_type") in MODEL_TYPES
            if (folder / "tokenizer.json").is_file() and (builtin or folder == path.parent):
                return _builtin_tokenizer(folder / "tokenizer.json")
            if folder == path and not builtin and config.is_file():
                if not has_tokenizer(path):
                    raise FileNotFoundError(f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): the model "
                                            "works on token ids without one, but text in or out needs one; add the "
                                            "tokenizer's files to that directory")
                try:  # the tokenizer the model loads with (load_model)
                    native = native_config(read_config(config)) is not None
                except (KeyError, TypeError, ValueError):
                    native = False
                return _checkpoint_tokenizer(path, generation_eos(path)) if native else hf_tokenizer(path)
        raise FileNotFoundError(f"no tokenizer found in {path} or its parent")
    metadata = read_metadata(path) if path.suffix == ".gguf" else {}
    if metadata.get("general.architecture") in GGUF_ARCHITECTURES:
        if "tokenizer.ggml.model" not in metadata:
            raise FileNotFoundError(f"{path} holds no tokenizer (no tokenizer.* entries): the model works on token ids "
                                    "without one, but text in or out needs one")
        return gguf_tokenizer(path)
    return hf_tokenizer(path)


def read_config(path: Path) -> dict:
    """A model's config.json as a dict; errors name the file and what is wrong with it."""
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text, so not a model config") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    except (ValueError, RecursionError) as error:  # an integer of thousands of digits, deep nesting
        raise ValueError(f"{path} is not a model config: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object (a model config), got {type(config).__name__}")
    return config


def check_safetensors(path: Path) -> None:
    """Refuse a truncated or corrupt safetensors file before a reader fails without naming it.

    The format: 8 bytes of header length n (little-endian), n bytes of JSON giving each
    tensor's byte range, then the data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            raise ValueError(f"{path} is truncated or not a safetensors file: its {size} bytes hold no header")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
            end = max([0] + [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"])
        except (UnicodeDecodeError, AttributeError, KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"{path} is not a safetensors file: its header is not the JSON of a tensor list") from None
    if 8 + length + end > size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {8 + length + end}, the file has {size} bytes")
    from safetensors import SafetensorError, safe_open

    try:  # the reader's own checks: dtypes, shapes against byte ranges
        with safe_open(str(path), "pt"):
            pass
    except SafetensorError as error:
        raise ValueError(f"{path} is not a valid safetensors file: {error}") from None


def _builtin_tokenizer(path: Path) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer file tokenizers can read: {error}") from None
    return TextTokenizer(backend, name=str(path))


def _checkpoint_tokenizer(path: Path, eos: list[int] | None = None) -> TextTokenizer:
    """A checkpoint's tokenizer: from tokenizer.json without transformers where there is one."""
    return TextTokenizer.from_checkpoint(path, eos) if (path / "tokenizer.json").is_file() else hf_tokenizer(path, eos)
