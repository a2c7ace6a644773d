"""Export a built-in decoder_only model to transformers' Llama format, with the very same weights.

Our block is Llama's and our parameter names are Llama's, so the export is a renaming
(a `model.` prefix) plus a LlamaConfig. Other tools (transformers' assisted generation,
llama.cpp converters) can then run the same model, and comparisons mean something.

An export either completes or leaves the destination as it was: everything that could
stop it halfway (a symbolic link, a folder it cannot write or empty) is checked first, the
files are written into a new directory beside the destination and renamed into place, and
the files get the user's umask like those of any other tool.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger("speculative")


def check_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("export writes transformers' Llama format and needs transformers, which is not installed: "
                         "pip install 'speculative[hf]'") from None


def destination(out) -> Path:
    """The directory an export replaces: `out`, or the directory a symbolic link `out` points
    to (the link is kept, and points to the new files)."""
    out = Path(out)
    if not out.is_symlink():
        return out
    target = Path(os.path.realpath(out))
    if not target.exists():
        raise FileNotFoundError(f"{out} is a symbolic link to {target}, which does not exist; export writes a "
                                "directory: give a new or empty directory, or fix the link")
    return target


def check_destination(out: Path, force: bool, source: Path | None = None) -> Path:
    """Refuse to write over a file, over the model being exported, without `force` over a
    directory that holds anything, and anywhere the export could not complete. Returns the
    directory that will be written (a link's target)."""
    given, out = Path(out), destination(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{given} is a file; export writes a directory: give a new or empty directory")
    if source is not None and out.exists() and Path(source).resolve().is_relative_to(out.resolve()):
        raise ValueError(f"{given} holds the model being exported ({source}); export to another directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{given} is not empty; pass --force (force=True) to replace it, or give a new directory")
    if out.is_dir() and (os.path.ismount(out) or Path.cwd().resolve().is_relative_to(out.resolve())):
        what = "a mount point" if os.path.ismount(out) else "the current directory or one that holds it"
        raise ValueError(f"{given} is {what}, which export cannot replace; export to a directory inside it")
    parent = out.absolute().parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())  # the folder made, or the first one above
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is a file, so {given} cannot be made inside it")
    check = existing / f".speculative-export-check.{uuid.uuid4().hex[:8]}"
    try:  # os.access says yes to root even where nothing can be made (/proc, read-only mounts)
        check.mkdir()
        check.rmdir()
    except OSError as error:
        raise PermissionError(f"cannot write in {existing}, where the export of {given} is written first: "
                              f"{error.strerror or error}") from None
    if out.is_dir():
        for folder, dirs, _ in os.walk(out):
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(f"{folder} cannot be emptied (no write permission), so {given} cannot be "
                                      "replaced; fix its permissions or give another directory")
    return out


def export_llama(model, out, tokenizer_file: Path | None = None, force: bool = False,
                 source: Path | None = None) -> Path:
    """Write `model` (decoder_only) as a transformers LlamaForCausalLM directory.

    The files are written into a new directory beside `out` and renamed into place once
    complete, so that a failed export leaves `out` as it was. `source` (the model's own
    directory) is never replaced. A symbolic link `out` keeps pointing to the export."""
    check_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if getattr(model, "model_type", None) != "decoder_only":
        raise ValueError(f"only decoder_only models export to the Llama format, got "
                         f"{getattr(model, 'model_type', type(model).__name__)}")
    target = check_destination(out, force, source)
    cfg = model.cfg
    eos = None
    tokenizer = None
    if tokenizer_file is not None:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>")
        eos = tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
                         rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
                         attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=eos, pad_token_id=None)
    llama = LlamaForCausalLM(config).eval()
    state = {("lm_head.weight" if name == "lm_head.weight" else f"model.{name}"): tensor
             for name, tensor in model.state_dict().items()}
    missing, unexpected = llama.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"export mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    target.absolute().parent.mkdir(parents=True, exist_ok=True)
    staging = beside(target, "partial")
    staging.mkdir()  # the user's umask, as any new directory
    try:
        llama.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        if not (staging / "config.json").is_file() or not any(staging.glob("*.safetensors")):
            raise OSError(f"transformers wrote no config.json and safetensors weights into {staging}")
        apply_umask(staging)
        replace_directory(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Path(out)


def beside(path: Path, kind: str) -> Path:
    """A new hidden name in `path`'s folder, e.g. `.out.1f2e....partial`."""
    return path.absolute().parent / f".{path.name}.{uuid.uuid4().hex[:8]}.{kind}"


def apply_umask(directory: Path) -> None:
    """Give the files the mode the user's umask gives new files (transformers writes the
    weights through a private temporary file, mode 0600). The directory, made by mkdir,
    already has it."""
    mode = directory.stat().st_mode & 0o666
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def replace_directory(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an existing `out` is moved aside first and deleted only after.
    Should that deletion fail, the export is in place all the same and the old copy is named."""
    if not out.exists():
        new.rename(out)
        return
    old = beside(out, "old")
    out.rename(old)
    try:
        new.rename(out)
    except OSError:
        old.rename(out)  # put it back
        raise
    try:
        shutil.rmtree(old)
    except OSError as error:
        log.warning("exported to %s, but its previous contents, moved to %s, could not be removed: %s", out, old,
                    error)
