"""Quality figures of trained models: held-out perplexity and speculative acceptance."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from ..core.config import SpeculativeConfig
from ..runtime.decoder import SpeculativeDecoder, autoregressive_generate


@torch.inference_mode()
def perplexity(model, data: torch.Tensor, seq_len: int = 512, max_tokens: int = 200_000,
               deadline: float | None = None) -> float:
    """exp(mean next-token cross-entropy) over consecutive windows of the held-out stream
    (those measured before `deadline`, a time.perf_counter(), and at least one)."""
    data = data[:max_tokens + 1].long()
    total, count = 0.0, 0
    for start in range(0, len(data) - 1, seq_len):
        if count and deadline is not None and time.perf_counter() > deadline:
            break
        window = data[start:start + seq_len + 1][None]
        if window.shape[1] < 2:
            break
        logits = model(window[:, :-1]).float()
        total += float(F.cross_entropy(logits[0], window[0, 1:], reduction="sum"))
        count += window.shape[1] - 1
    if count == 0:
        raise ValueError("no held-out tokens to measure perplexity on")
    return math.exp(total / count)


def acceptance(target, draft, prompts: list[list[int]], max_new_tokens: int = 64, k: int = 4,
               deadline: float | None = None) -> dict:
    """Greedy speculative decoding on the prompts: alpha, tau, and whether the output
    matched the target's own. Past `deadline` (a time.perf_counter()) generation stops at
    the next token, after at least one prompt's first step."""
    decoder = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=k, adaptive=False,
                                                                  prompt_lookup=False))
    past = (lambda: False) if deadline is None else (lambda: time.perf_counter() > deadline)  # noqa: E731
    identical, done = True, 0
    for ids in prompts:
        if done and past():
            break
        out = []
        for token in decoder.stream(ids, max_new_tokens):
            out.append(token)
            if past():
                break
        done += 1
        identical &= out == autoregressive_generate(target, ids, len(out))
    stats = decoder.stats
    return {"acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_forward": round(stats.tokens_per_forward, 3), "k": k,
            "prompts": done, "max_new_tokens": max_new_tokens, "identical_to_target": identical}
