"""Export a built-in decoder_only model to transformers' Llama format, with the very same weights.

Our block is Llama's and our parameter names are Llama's, so the export is a renaming
(a `model.` prefix) plus a LlamaConfig. Other tools (transformers' assisted generation,
llama.cpp converters) can then run the same model, and comparisons mean something.
"""

from __future__ import annotations

from pathlib import Path


def export_llama(model, out, tokenizer_file: Path | None = None) -> Path:
    """Write `model` (decoder_only) as a transformers LlamaForCausalLM directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if getattr(model, "model_type", None) != "decoder_only":
        raise ValueError(f"only decoder_only models export to the Llama format, got "
                         f"{getattr(model, 'model_type', type(model).__name__)}")
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
    out = Path(out)
    llama.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
