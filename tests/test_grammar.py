"""Structured output (core/grammar.py): greedy speculative output under a grammar is
constrained plain decoding's, token for token, whatever drafts it (forced tokens, lookup, a
draft model) and whatever runs beside it; sampled output follows the constrained
distribution (a G-test with a negative control); every output matches its grammar."""

import json
import re

import pytest
import torch

from speculative import Engine, Grammar, NGramProposer, SamplingParams, SpeculativeConfig, load_model
from speculative.core.grammar import GrammarTokenizer
from speculative.core.sampling import probabilities
from speculative.models.loading import load_tokenizer
from speculative.runtime.reference import plain_generate
from tests.helpers import sharpen, tiny
from tests.test_lossless import DRAWS, LENGTH, P_MIN, PROMPT, VOCAB, g_test_pvalue
from tests.test_penalties import run_engine

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "lines"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "kind": {"enum": ["function", "class", "constant"]},
                         "lines": {"type": "integer"}}}


@pytest.fixture(scope="module")
def default_pair():
    """The shipped default target and its draft, with the target's tokenizer."""
    target, tokenizer = load_model("default"), load_tokenizer("default")
    return target, load_model("default-draft"), tokenizer


def json_grammar(target, tokenizer, schema=SCHEMA) -> Grammar:
    return Grammar.json_schema(schema, tokenizer.grammar_tokenizer(target.vocab_size))


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == set(SCHEMA["required"]) and isinstance(value["name"], str) and len(value["name"]) <= 12
            and value["kind"] in SCHEMA["properties"]["kind"]["enum"] and isinstance(value["lines"], int))


DRAFTS = {
    "forced tokens alone": lambda draft: (NGramProposer(max_ngram=3), SpeculativeConfig(prompt_lookup=True)),
    "draft model + lookup": lambda draft: (draft, None),
    "draft model, fixed K": lambda draft: (draft, SpeculativeConfig(adaptive=False, num_draft_tokens=4)),
}


@pytest.mark.parametrize("drafts", list(DRAFTS))
def test_greedy_under_a_grammar_is_constrained_plain_greedy(default_pair, drafts):
    target, draft_model, tokenizer = default_pair
    grammar = json_grammar(target, tokenizer)
    prompts = [tokenizer.encode(text) for text in ("def parse(text):\n    return", "class Reader:\n    \"\"\"",
                                                   "MAX_SIZE = 4096\n")]
    requests = [(ids, SamplingParams(40, grammar=grammar)) for ids in prompts]
    requests.insert(1, (prompts[0], SamplingParams(40)))  # a row without a grammar beside them
    expected = [out.token_ids for out in plain_generate(target, *zip(*requests))]
    draft, config = DRAFTS[drafts](draft_model)
    engine = Engine(target, draft, config, max_batch_size=len(requests))
    assert run_engine(engine, requests) == expected
    end = grammar.end_token
    for (ids, params), tokens in zip(requests, expected):
        if params.grammar is not None:
            assert tokens[-1] == end, tokenizer.decode(tokens)  # the grammar ended it, within the budget
            assert matches_schema(tokenizer.decode(tokens[:-1]))
    assert engine.stats.accepted > 0


def test_forced_tokens_are_drafted_for_free(default_pair):
    """With no draft model and nothing to look up, only the grammar drafts: most tokens of the
    output (keys, quotes, separators) are accepted drafts."""
    target, _, tokenizer = default_pair
    grammar = json_grammar(target, tokenizer)
    ids = tokenizer.encode("x = 1\n")
    engine = Engine(target, NGramProposer(max_ngram=3), SpeculativeConfig(prompt_lookup=True, adaptive=False),
                    max_batch_size=1)
    engine.add_request(ids, SamplingParams(40, grammar=grammar))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == plain_generate(target, [ids], [SamplingParams(40, grammar=grammar)])[0].token_ids
    assert engine.stats.accepted >= len(tokens) // 3, (engine.stats.accepted, len(tokens))
    assert engine.stats.target_forwards < len(tokens)


def test_a_grammar_row_refuses_trees_and_other_vocabularies(default_pair):
    target, _, tokenizer = default_pair
    grammar = json_grammar(target, tokenizer)
    trees = Engine(target, NGramProposer(num_draft_tokens=4), SpeculativeConfig(num_draft_tokens=4, tree_top_k=2))
    with pytest.raises(ValueError, match="chain drafts"):
        trees.add_request([1, 2, 3], SamplingParams(8, grammar=grammar))
    other = Grammar.json_schema(SCHEMA, tokenizer.grammar_tokenizer(target.vocab_size + 64))
    with pytest.raises(ValueError, match="vocabulary of 4160 tokens"):
        Engine(target, NGramProposer()).add_request([1, 2, 3], SamplingParams(8, grammar=other))


def test_bad_grammars_and_settings_say_what_is_wrong(default_pair):
    target, _, tokenizer = default_pair
    grammar_tokenizer = tokenizer.grammar_tokenizer(target.vocab_size)
    with pytest.raises(ValueError, match="not valid JSON"):
        Grammar("json_schema", "{oops", grammar_tokenizer)
    with pytest.raises(ValueError, match="kind must be one of json_schema, regex, lark"):
        Grammar("xml", "<a/>", grammar_tokenizer)
    with pytest.raises(ValueError, match="regex cannot be used"):
        Grammar("regex", "(unclosed", grammar_tokenizer)
    with pytest.raises(ValueError, match="min_tokens cannot be combined with a grammar"):
        SamplingParams(8, min_tokens=2, grammar=json_grammar(target, tokenizer))
    with pytest.raises(ValueError, match="grammar must be None or a speculative Grammar"):
        SamplingParams(8, grammar="{}")
    grammar = json_grammar(target, tokenizer)
    assert SamplingParams(8, stop_token_ids=[5], grammar=grammar).stop_token_ids == (5, grammar.end_token)


# --- sampled: a G-test over the first three tokens, under a grammar on a tiny vocabulary -------

class TinyTokenizer:
    """Eight tokens for the G-test's vocabulary; token 6 ends the text."""

    tokens = [b"a", b"b", b"c", b"ab", b"ba", b"cc", b"<end>", b"x"]
    eos_token_id, bos_token_id, special_token_ids = 6, None, [6]

    def __call__(self, text):
        text = text.encode() if isinstance(text, str) else text
        ids, i = [], 0
        while i < len(text):
            piece = text[i:i + 2] if text[i:i + 2] in self.tokens[:6] else text[i:i + 1]
            ids.append(self.tokens.index(piece) if piece in self.tokens[:6] else 7)
            i += len(piece)
        return ids


PATTERN = "[ab]{1,3}c"  # what the G-test's grammar allows: 1-3 of a and b, then c


def allowed_by_hand(output: list[int]) -> torch.Tensor:
    """The tokens PATTERN allows after `output`, worked out with Python's re (independent of llguidance)."""
    text = b"".join(TinyTokenizer.tokens[t] for t in output).decode()
    complete = re.fullmatch(PATTERN, text) is not None
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    for token in range(VOCAB):
        if token == 6:
            allowed[token] = complete
        else:
            longer = text + TinyTokenizer.tokens[token].decode()
            allowed[token] = re.fullmatch(r"[ab]{0,3}|[ab]{1,3}c", longer) is not None
    return allowed


def exact_constrained_joint(model, allowed=allowed_by_hand) -> torch.Tensor:
    """P(t1, t2, t3) of plain sampling under PATTERN, by enumerating every continuation (a row
    ended by token 6 repeats nothing: its later tokens are counted as 6)."""
    rows = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    tokens = torch.cat([torch.tensor(PROMPT).repeat(len(rows), 1), rows], 1)
    with torch.inference_mode():
        logits = model.forward(tokens, model.new_state(len(rows), tokens.shape[1]))[:, len(PROMPT) - 1:]

    def step(logits_row, output):
        if output and output[-1] == 6:
            return torch.nn.functional.one_hot(torch.tensor(6), VOCAB).double()
        masked = logits_row.masked_fill(~allowed(output), float("-inf"))
        return probabilities(masked, 1.0).double()

    joint = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    first = step(logits[0, 0], [])
    for t1 in range(VOCAB):
        second = step(logits[t1 * VOCAB, 1], [t1])
        for t2 in range(VOCAB):
            joint[t1, t2] = first[t1] * second[t2] * step(logits[t1 * VOCAB + t2, 2], [t1, t2])
    return joint


def padded_index(outputs: list[list[int]]) -> torch.Tensor:
    padded = [(o + [6, 6, 6])[:LENGTH] for o in outputs]
    return torch.tensor([a * VOCAB ** 2 + b * VOCAB + c for a, b, c in padded])


@pytest.fixture(scope="module")
def tiny_grammar():
    return Grammar("regex", PATTERN, GrammarTokenizer(TinyTokenizer(), VOCAB, 6))


@pytest.fixture(scope="module")
def tiny_pair():
    return sharpen(tiny("decoder_only", vocab=VOCAB, seed=11), 3.0), sharpen(tiny("decoder_only", vocab=VOCAB,
                                                                                  seed=12), 3.0)


def test_the_tiny_grammar_allows_what_the_pattern_allows(tiny_grammar):
    """llguidance's masks equal the hand-made ones on every prefix the G-test reaches."""
    constraint = tiny_grammar.constraint()
    for t1 in range(VOCAB):
        for t2 in [None, *range(VOCAB)]:
            output = [t1] if t2 is None else [t1, t2]
            if not all(allowed_by_hand(output[:i])[t] for i, t in enumerate(output)) or 6 in output[:-1]:
                continue
            constraint.advance(output)
            assert torch.equal(constraint.allowed(VOCAB, "cpu"), allowed_by_hand(output)), output
            constraint.matcher.rollback(len(output))


def engine_counts(target, draft, config, grammar, n=DRAWS, chunk=5_000) -> torch.Tensor:
    counts = torch.zeros(VOCAB ** LENGTH)
    for start in range(0, n, chunk):
        engine = Engine(target, draft, config, max_batch_size=chunk)
        for seed in range(start, start + chunk):
            engine.add_request(PROMPT, SamplingParams(LENGTH, temperature=1.0, seed=seed, grammar=grammar), seed)
        outs = {seed: [] for seed in range(start, start + chunk)}
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] += out.new_token_ids
        counts += torch.bincount(padded_index(list(outs.values())), minlength=VOCAB ** LENGTH)
    return counts


FIXED = dict(adaptive=False, prompt_lookup=False, num_draft_tokens=2, draft_temperature=1.0)
SAMPLED_PATHS = {
    "plain": None,
    "draft model": lambda draft: (draft, SpeculativeConfig(**FIXED)),
    "forced tokens and lookup": lambda draft: (NGramProposer(max_ngram=2, num_draft_tokens=3), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("path", list(SAMPLED_PATHS))
def test_sampling_under_a_grammar_is_lossless(tiny_pair, tiny_grammar, path):
    target, draft_model = tiny_pair
    if path == "plain":  # in chunks: 20,000 rows at once would hold gigabytes of cache
        chunks = [[SamplingParams(LENGTH, temperature=1.0, seed=s, grammar=tiny_grammar)
                   for s in range(start, start + 5_000)] for start in range(0, DRAWS, 5_000)]
        outputs = [o.token_ids for params in chunks for o in plain_generate(target, [PROMPT] * len(params), params)]
        counts = torch.bincount(padded_index(outputs), minlength=VOCAB ** LENGTH)
    else:
        counts = engine_counts(target, *SAMPLED_PATHS[path](draft_model), tiny_grammar)
    assert g_test_pvalue(counts, exact_constrained_joint(target)) > P_MIN


@pytest.mark.slow
def test_the_grammar_g_test_detects_a_wrong_mask(tiny_pair, tiny_grammar):
    """Negative control: the engine's draws against the joint of sampling whose third token
    is left unconstrained fail the test."""
    target, draft_model = tiny_pair
    counts = engine_counts(target, *SAMPLED_PATHS["draft model"](draft_model), tiny_grammar)

    def third_free(output):
        return torch.ones(VOCAB, dtype=torch.bool) if len(output) == 2 else allowed_by_hand(output)

    assert g_test_pvalue(counts, exact_constrained_joint(target, third_free)) < P_MIN
