"""Quality figures of trained models: held-out perplexity and speculative acceptance."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import SpeculativeConfig
from ..decoder import SpeculativeDecoder, autoregressive_generate


@torch.inference_mode()
def perplexity(model, data: torch.Tensor, seq_len: int = 512, max_tokens: int = 200_000) -> float:
    """exp(mean next-token cross-entropy) over consecutive windows of the held-out stream."""
    data = data[:max_tokens + 1].long()
    total, count = 0.0, 0
    for start in range(0, len(data) - 1, seq_len):
        window = data[start:start + seq_len + 1][None]
        if window.shape[1] < 2:
            break
        logits = model(window[:, :-1]).float()
        total += float(F.cross_entropy(logits[0], window[0, 1:], reduction="sum"))
        count += window.shape[1] - 1
    if count == 0:
        raise ValueError("no held-out tokens to measure perplexity on")
    return math.exp(total / count)


def acceptance(target, draft, prompts: list[list[int]], max_new_tokens: int = 64, k: int = 4) -> dict:
    """Greedy speculative decoding on the prompts: alpha, tau, and whether output matched."""
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=k, adaptive=False))
    identical = True
    for ids in prompts:
        out = decoder.generate(ids, max_new_tokens)
        identical &= out == autoregressive_generate(target, ids, max_new_tokens)
    stats = decoder.stats
    return {"acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_forward": round(stats.tokens_per_forward, 3), "k": k,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "identical_to_target": identical}
