"""Log-probabilities of returned tokens and their most likely alternatives.

What is reported: the log of the distribution the token was chosen from, after the
request's penalties and logit bias. A sampled request's is the target's p as sampled
(temperature, then top-k and top-p: tokens they remove have -inf); a greedy request's
(temperature 0) is the target's softmax at temperature 1, whose argmax greedy emits.
Prompt tokens (`prompt_logprobs`, the server's `echo`) were not chosen by any setting:
theirs is the target's plain softmax at temperature 1. The numbers come from the verify
forward that scored the position, so a drafted-and-accepted token gets what plain
decoding would report for it, up to the float rounding of a wider forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import Sampler

# Most alternatives a request may ask for per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token, its log-probability, and the `top` most likely tokens with
    theirs, most likely first (as many as were asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_distribution(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """log p (..., V) of the distribution a token is chosen from (the module docstring)."""
    if sampler.greedy:
        return torch.log_softmax(logits.float(), -1)
    return torch.log(sampler.probabilities(logits))


def token_logprobs(logits: torch.Tensor, tokens: list[int], sampler: Sampler, top: int) -> list[TokenLogprob]:
    """Position t of logits (T, V) chose tokens[t]: its log-probability and `top` alternatives."""
    logp = log_distribution(logits[:len(tokens)], sampler)  # (T, V)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None]).squeeze(1).tolist()
    if top > 0:
        values, ids = logp.topk(min(top, logp.shape[-1]), -1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return [TokenLogprob(token, value, alt) for token, value, alt in zip(tokens, chosen, alternatives)]


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], top: int) -> list[TokenLogprob | None]:
    """The prompt's tokens under the target (temperature 1): logits (L - 1, V) from reading
    prompt[:-1]; the first token has none (nothing precedes it), as in OpenAI's echo."""
    return [None, *token_logprobs(logits, prompt[1:], Sampler(1.0), top)]
