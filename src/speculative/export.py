"""Export a built-in decoder_only model to transformers' Llama format, with the very same weights.

Our block is Llama's and our parameter names are Llama's, so the export is a renaming
(a `model.` prefix) plus a LlamaConfig. Other tools (transformers' assisted generation,
llama.cpp converters) can then run the same model, and comparisons mean something.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def check_destination(out: Path, force: bool, source: Path | None = None) -> None:
    """Refuse to write over a file, over the model being exported, or, without `force`,
    over a directory that holds anything."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; export writes a directory: give a new or empty directory")
    if source is not None and out.exists() and Path(source).resolve().is_relative_to(out.resolve()):
        raise ValueError(f"{out} holds the model being exported ({source}); export to another directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; pass --force (force=True) to replace it, or give a new directory")


def export_llama(model, out, tokenizer_file: Path | None = None, force: bool = False,
                 source: Path | None = None) -> Path:
    """Write `model` (decoder_only) as a transformers LlamaForCausalLM directory.

    The files are written into a new directory beside `out` and renamed into place once
    complete, so that a failed export leaves `out` as it was. `source` (the model's own
    directory) is never replaced."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if getattr(model, "model_type", None) != "decoder_only":
        raise ValueError(f"only decoder_only models export to the Llama format, got "
                         f"{getattr(model, 'model_type', type(model).__name__)}")
    out = Path(out)
    check_destination(out, force, source)
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
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.absolute().parent))
    try:
        llama.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        if not (staging / "config.json").is_file() or not any(staging.glob("*.safetensors")):
            raise OSError(f"transformers wrote no config.json and safetensors weights into {staging}")
        replace_directory(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def replace_directory(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an existing `out` is moved aside first and deleted only after."""
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.absolute().parent))
    old.rmdir()
    out.rename(old)
    try:
        new.rename(out)
    except OSError:
        old.rename(out)  # put it back
        raise
    shutil.rmtree(old)
