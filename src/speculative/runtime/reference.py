"""The plain reference for requests: one target forward per token, no drafting.

Every request setting the engine serves (temperature, top-k, top-p, seed, stop tokens,
penalties, logit bias, min_tokens, grammars, logprobs, prompt logprobs) is applied here the plain
way, by the same functions, so that every fast path can be compared with it token for
token (greedy), in distribution (sampled), and number for number (log-probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.inputs import check_length, check_model, check_token_range
from ..core.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
from ..core.rows import SamplingParams
from ..core.sampling import NonFiniteLogits, argmax, make_generators, non_finite_rows, row_probabilities, sample
from ..models.base import prefill, screens_argmax


@dataclass
class PlainOutput:
    """What plain decoding gave one request."""

    token_ids: list[int] = field(default_factory=list)
    # With params.logprobs: one per token; with params.prompt_logprobs: one per prompt token.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def plain_generate(model, prompts: list[list[int]], params: list[SamplingParams]) -> list[PlainOutput]:
    """Decode each prompt with its own SamplingParams (row b's random stream seeded
    params[b].seed, as the engine seeds a request's target stream)."""
    check_model(model, "model")
    if len(prompts) != len(params):
        raise ValueError(f"plain_generate got {len(prompts)} prompts and {len(params)} SamplingParams; give one each")
    check_token_range(prompts, model.vocab_size)
    budgets = [p.max_new_tokens for p in params]
    check_length(prompts, budgets, model, "target")
    samplers = [p.sampler for p in params]
    generators = [None if s.greedy else make_generators([p.seed], model.device)[0] for s, p in zip(samplers, params)]
    outputs = [PlainOutput(logprobs=None if p.logprobs is None else []) for p in params]
    constraints = [None if p.grammar is None else p.grammar.constraint() for p in params]
    with torch.inference_mode():
        wanted = any(p.prompt_logprobs is not None for p in params)
        read = [] if wanted else None
        state = prefill(model, prompts, max(len(p) + m for p, m in zip(prompts, budgets)) + 1, logits=read)
        for out, p, prompt, logits in zip(outputs, params, prompts, read or [None] * len(params)):
            if p.prompt_logprobs is not None:
                out.prompt_logprobs = prompt_logprobs(logits, prompt, p.prompt_logprobs)
        active = list(range(len(prompts)))  # rows still generating; finished rows leave the batch
        last = [p[-1] for p in prompts]
        while True:
            keep = [i for i, row in enumerate(active) if not finished(outputs[row].token_ids, params[row])]
            if not keep:
                break
            if len(keep) < len(active):
                model.select_rows(state, keep)
                active, last = [active[i] for i in keep], [last[i] for i in keep]
            screen = {"argmax_rows": [params[r].reads_argmax_only for r in active]} if screens_argmax(model) else {}
            logits = model.forward(torch.tensor(last, device=model.device)[:, None], state, **screen)[:, -1]  # (B, V)
            bad = non_finite_rows(logits)
            if bad:
                raise NonFiniteLogits("target", [active[i] for i in bad])  # named as prompts
            logits = logits.float()
            for i, row in enumerate(active):
                penalties = params[row].penalties
                if penalties is not None:
                    penalties.apply(logits[i:i + 1], prompts[row], outputs[row].token_ids, [[]])
                if constraints[row] is not None:
                    constraints[row].mask(logits[i:i + 1], [])
            last = choose(logits, [samplers[r] for r in active], [generators[r] for r in active])
            for i, (row, token) in enumerate(zip(active, last)):
                outputs[row].token_ids.append(token)
                if constraints[row] is not None:
                    constraints[row].advance([token])
                if params[row].logprobs is not None:
                    outputs[row].logprobs += token_logprobs(logits[i:i + 1], [token], samplers[row],
                                                            params[row].logprobs)
    return outputs


def finished(tokens: list[int], params: SamplingParams) -> bool:
    return len(tokens) >= params.max_new_tokens or bool(tokens and tokens[-1] in (params.stop_token_ids or ()))


def choose(logits: torch.Tensor, samplers: list, generators: list) -> list[int]:
    """One token per row of logits (B, V): greedy rows the argmax, sampled rows a draw."""
    tokens = argmax(logits).tolist()
    sampled = [i for i, s in enumerate(samplers) if not s.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        probs = row_probabilities(logits[index], [samplers[i] for i in sampled])
        for i, token in zip(sampled, sample(probs, [generators[i] for i in sampled]).tolist()):
            tokens[i] = token
    return tokens
