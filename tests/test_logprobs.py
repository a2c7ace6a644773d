"""Log-probabilities: a token drafted and accepted gets the numbers plain decoding gives it.

Greedy requests are compared with the plain reference token for token and number for
number; sampled ones with the distribution a plain forward over the same text gives (their
tokens differ from the plain reference's, whose random stream is used differently). The
speculative numbers come from a forward over K + 1 positions and the plain ones from one
position per forward: float32 rounding differs, so they are compared to TOLERANCE.
"""

import math

import pytest
import torch

from speculative import Engine, NGramProposer, SamplingParams, SpeculativeConfig
from speculative.core.logprobs import log_distribution
from speculative.runtime.reference import plain_generate
from tests.test_penalties import pair, prompts  # noqa: F401 - a fixture

# Largest difference allowed between a speculative and a plain log-probability (float32 forwards).
TOLERANCE = 1e-4
BUDGET = 24


def run(engine: Engine, requests) -> dict:
    """Each request's tokens, logprobs and prompt logprobs."""
    got = {i: {"tokens": [], "logprobs": [], "prompt": None} for i in range(len(requests))}
    for i, (ids, params) in enumerate(requests):
        engine.add_request(ids, params, i)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id]["tokens"] += out.new_token_ids
            got[out.request_id]["logprobs"] += out.logprobs or []
            if out.prompt_logprobs is not None:
                assert got[out.request_id]["prompt"] is None, "prompt logprobs sent twice"
                got[out.request_id]["prompt"] = out.prompt_logprobs
    return got


def assert_close(ours, theirs):
    """Two lists of TokenLogprob (or None) agree: tokens exactly, numbers to TOLERANCE."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if a is None or b is None:
            assert a is b
            continue
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOLERANCE
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < TOLERANCE for (_, x), (_, y) in zip(a.top, b.top))


DRAFTS = {"draft model + lookup": lambda d: (d, None), "lookup": lambda d: (NGramProposer(max_ngram=3), None),
          "tree": lambda d: (NGramProposer(num_draft_tokens=6),
                             SpeculativeConfig(num_draft_tokens=6, tree_top_k=3, tree_max_tokens=12, adaptive=False))}


@pytest.mark.parametrize("drafts", list(DRAFTS))
def test_greedy_logprobs_equal_plain_decodings(pair, drafts):
    target, draft_model = pair
    prompts_ = prompts() + [prompts()[0]]
    params = [SamplingParams(BUDGET, logprobs=5, prompt_logprobs=3),
              SamplingParams(BUDGET, logprobs=0, frequency_penalty=1.0, logit_bias={13: 2.0}),
              SamplingParams(BUDGET)]  # beside rows without them
    plain = plain_generate(target, prompts_, params)
    draft, config = DRAFTS[drafts](draft_model)
    engine = Engine(target, draft, config, max_batch_size=3)
    got = run(engine, list(zip(prompts_, params)))
    assert engine.stats.accepted > 0  # some of the tokens were drafted
    for i, reference in enumerate(plain):
        assert got[i]["tokens"] == reference.token_ids
        if params[i].logprobs is None:
            assert got[i]["logprobs"] == [] and reference.logprobs is None
        else:
            assert_close(got[i]["logprobs"], reference.logprobs)
            assert all(len(lp.top) == params[i].logprobs for lp in got[i]["logprobs"])
    assert got[0]["prompt"][0] is None and len(got[0]["prompt"]) == len(prompts_[0])
    assert_close(got[0]["prompt"], plain[0].prompt_logprobs)
    assert got[1]["prompt"] is None and got[2]["prompt"] is None


def test_greedy_logprobs_are_the_softmax_at_temperature_1(pair):
    """What is reported, checked on a forward over the whole text: the chosen token is the
    most likely one, and the numbers are log_softmax of the logits."""
    target, _ = pair
    ids = prompts()[0]
    out = plain_generate(target, [ids], [SamplingParams(8, logprobs=2, prompt_logprobs=1)])[0]
    text = torch.tensor([ids + out.token_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(target.forward(text, target.new_state(1, text.shape[1]))[0].float(), -1)
    for j, lp in enumerate(out.logprobs):
        row = logp[len(ids) - 1 + j]
        assert lp.top[0][0] == lp.token_id == int(row.argmax())
        assert abs(lp.logprob - float(row[lp.token_id])) < TOLERANCE
    for j, lp in enumerate(out.prompt_logprobs[1:], 1):
        assert abs(lp.logprob - float(logp[j - 1, ids[j]])) < TOLERANCE


def test_sampled_logprobs_are_those_of_the_distribution_sampled(pair):
    target, draft = pair
    ids = prompts()[1]
    params = SamplingParams(BUDGET, temperature=0.7, top_k=3, top_p=0.9, seed=3, logprobs=4)
    got = run(Engine(target, draft, max_batch_size=1), [(ids, params)])[0]
    text = torch.tensor([ids + got["tokens"]])
    with torch.inference_mode():
        logits = target.forward(text, target.new_state(1, text.shape[1]))[0].float()
    logp = log_distribution(logits[len(ids) - 1:-1], params.sampler)  # (BUDGET, V)
    for j, lp in enumerate(got["logprobs"]):
        assert lp.token_id == got["tokens"][j] and math.isfinite(lp.logprob)
        assert abs(lp.logprob - float(logp[j, lp.token_id])) < TOLERANCE
        assert abs(sum(math.exp(v) for _, v in lp.top) - float(logp[j].topk(4).values.exp().sum())) < TOLERANCE
    assert any(v == float("-inf") for lp in got["logprobs"] for _, v in lp.top), "top-k / top-p removed none"
