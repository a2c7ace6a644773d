"""Structured output on Qwen2.5-Coder 1.5B: JSON extraction from a paragraph (20 prompts,
benchmarks/structured.jsonl), against our unconstrained plain decoding and llama.cpp's
grammar-constrained decoding (`LlamaGrammar.from_json_schema` of the same schema, same file).

    python benchmarks/run.py structured

Ours: plain decoding with and without the grammar (`load_model(preset)`, `auto`), the grammar's
forced tokens as the only drafts (no draft model), and what `speculative serve` runs for a
`response_format` request (`EngineArgs(target=preset)`'s engine: its default drafting, plus
the forced tokens as free drafts). Greedy, 128 new
tokens at most, chat template, rounds interleaved as in vs_llama_cpp.py. Every constrained
output of ours is compared with our constrained plain decoding, token for token, and parsed
against the schema. The grammar's own time (masks, forced tokens, advancing) is timed per
generated token, against a one-token forward of the target.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from speculative import Grammar, load_model
from speculative.core import grammar as grammar_module
from speculative.core.rows import SamplingParams
from speculative.entrypoints.bench_report import cpu_flags_words
from speculative.entrypoints.engine_args import EngineArgs
from speculative.runtime.engine import Engine
from vs_llama_cpp import THREADS, llama_method, plain_method, precision_of, run_rounds, speeds, timed

PRESET = "qwen2.5-coder-1.5b"
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "language", "first_release", "license", "maintainers", "purpose"],
          "properties": {"name": {"type": "string"},
                         "language": {"enum": ["Python", "Rust", "C++", "Go", "JavaScript", "Java"]},
                         "first_release": {"type": "integer"},
                         "license": {"enum": ["MIT", "Apache-2.0", "BSD-3-Clause", "GPL-3.0", "MPL-2.0"]},
                         "maintainers": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                         "purpose": {"type": "string"}}}
ASK = ("Extract the facts about the software library described below as a JSON object with the keys name, "
       "language, first_release (a year), license, maintainers (a list of names) and purpose (one short "
       "sentence).\n\n")


def valid(text: str) -> bool:
    """JSON of SCHEMA (checked by hand: every key, enum and type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    props = SCHEMA["properties"]
    return (isinstance(value, dict) and set(value) == set(SCHEMA["required"]) and isinstance(value["name"], str)
            and value["language"] in props["language"]["enum"] and isinstance(value["first_release"], int)
            and value["license"] in props["license"]["enum"] and isinstance(value["maintainers"], list)
            and len(value["maintainers"]) <= 4 and all(isinstance(m, str) for m in value["maintainers"])
            and isinstance(value["purpose"], str))


class FreeDrafts:
    """Switches the grammar's forced drafts off (for constrained plain decoding through the
    engine: with no draft model and no forced drafts, one forward per token)."""

    on = True

    def __init__(self):
        cls = grammar_module.Constraint
        forced = cls.forced
        cls.forced = lambda constraint: forced(constraint) if FreeDrafts.on else []


class GrammarClock:
    """Seconds spent in the grammar (Constraint's methods), counted while installed."""

    def __init__(self):
        self.seconds = 0.0
        cls = grammar_module.Constraint
        for name in ("forced", "valid_prefix", "mask", "advance"):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return run


def engine_method(engine: Engine, grammar: Grammar | None, reference: str | None, clock: GrammarClock | None = None,
                  free_drafts: bool = True):
    """One request at a time through `engine` (kept across prompts, as a server keeps it)."""
    def run(ids, max_new, eos):
        engine.add_request(ids, SamplingParams(max_new, stop_token_ids=sorted(eos), grammar=grammar))
        stream = (token for _ in iter(engine.has_unfinished, False) for output in engine.step()
                  for token in output.new_token_ids)
        before = clock.seconds if clock else 0.0
        FreeDrafts.on = free_drafts
        try:
            out = timed(stream)
        finally:
            FreeDrafts.on = True
        if clock:
            run.grammar_seconds.append(clock.seconds - before)
            run.tokens.append(len(out[0]))
        return out
    run.reference, run.grammar_seconds, run.tokens = reference, [], []
    return run


def llama_grammar_method(path: str):
    """llama.cpp's greedy decoding under its grammar made from SCHEMA."""
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=path, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=4096, n_batch=512, verbose=False)
    grammar = LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)

    def run(ids, max_new, eos):
        llm.reset()
        out, first, start = [], None, time.perf_counter()
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True, grammar=grammar):
            first = first or time.perf_counter()
            out.append(token)
            if token in eos or len(out) == max_new:
                break
        return out, first - start, time.perf_counter() - start
    run.reference = None
    return run


def section(save_per_machine, runs: int = 2, limit: int | None = None, log=print) -> None:
    from speculative.models.presets import QWEN_CODER_15B, assemble, cache_root

    gguf = str(assemble(QWEN_CODER_15B, cache_root() / "gguf" / f"{QWEN_CODER_15B.name}.gguf"))
    target = load_model(PRESET)
    tokenizer = target.tokenizer
    rows = [json.loads(line) for line in (Path(__file__).parent / "structured.jsonl").read_text().splitlines()]
    prompts = [tokenizer.chat(ASK + row["paragraph"]) for row in rows][:limit]
    grammar = Grammar.json_schema(SCHEMA, tokenizer.grammar_tokenizer(target.vocab_size))
    FreeDrafts()
    clock = GrammarClock()
    served = EngineArgs(target=PRESET).build().engine()
    precision = precision_of(target)
    constrained = f"ours plain + grammar ({precision})"
    methods = {"llama.cpp + grammar": llama_grammar_method(gguf),
               constrained: engine_method(Engine(target, None, max_batch_size=1), grammar, None, free_drafts=False),
               f"ours plain, no grammar ({precision})": plain_method(target),
               f"ours + grammar, its forced drafts only ({precision})": engine_method(
                   Engine(target, None, max_batch_size=1), grammar, constrained),
               "ours default + grammar (serve)": engine_method(served, grammar, constrained, clock),
               "llama.cpp plain, no grammar": llama_method(gguf, False)}
    methods[constrained].reference = constrained
    eos = set(tokenizer.eos_token_ids)
    log(f"  {len(prompts)} prompts; CPU flags: {cpu_flags_words()}")
    rounds = []
    report = run_rounds(methods, prompts, eos, runs, log, rounds=rounds)
    unconstrained = next(name for name in methods if name.startswith("ours plain, no"))
    for name, row in report.items():
        outputs = [out for out, _, _ in rounds[-1][name]]
        texts = [tokenizer.decode([t for t in out if t not in eos]) for out in outputs]
        row["valid_json"] = sum(map(valid, texts))
        row["vs_ours_unconstrained"] = statistics.median(speeds(r[name])[0] / speeds(r[unconstrained])[0]
                                                         for r in rounds)
        row["example"] = texts[0]
    served_run = methods["ours default + grammar (serve)"]
    forward = plain_seconds_per_token(rounds, unconstrained)
    grammar_per_token = sum(served_run.grammar_seconds) / max(1, sum(served_run.tokens))
    entry = {"date": time.strftime("%Y-%m-%d"), "runs": runs, "prompts": len(prompts), "threads": THREADS,
             "cpu_flags": cpu_flags_words(), "prompt_tokens": [len(p) for p in prompts], "methods": report,
             "grammar_ms_per_token": grammar_per_token * 1e3, "forward_ms": forward * 1e3,
             "grammar_share_of_forward": grammar_per_token / forward}
    save_per_machine("structured", entry, title="Structured output: JSON extraction on Qwen2.5-Coder 1.5B")
    log(f"  grammar {grammar_per_token * 1e3:.2f} ms per token, {grammar_per_token / forward:.1%} of a forward")


def plain_seconds_per_token(rounds: list[dict], name: str) -> float:
    """Our unconstrained plain decoding's seconds per token after the first (one forward each)."""
    return statistics.median(1 / speeds(r[name])[1] for r in rounds)
