"""Benchmark sections for a real pair: Qwen2.5-Coder 1.5B (target) and 0.5B (draft).

Three parts (the third its own section, `qwen-bfloat16`), each in this one process with
its own baseline run interleaved with its methods (a machine that drifts slows all methods
of a part alike); each part frees its models before the next, since two float32 copies
of the 1.5B model and its draft would not fit this machine's memory beside a third:

- float32, what `--dtype auto` gives on CPUs without native bfloat16: our plain decoding
  (oneDNN linear layers), the draft in int8 and in float32, fixed K and adaptive, with and
  without a reduced vocabulary, n-gram lookup, lookup in front of the draft;
- transformers: its plain `generate` and assisted generation on the unpacked float32
  models (what a user gets from transformers today), against our plain float32 decoding;
- bfloat16: our plain decoding in bfloat16 and float32, the draft in bfloat16 and int8.

Plus `divergence`: how often greedy speculative output leaves the same-dtype
autoregressive output, and whether every such place is a near-tie (precision.py).

Workload: 3 held-out code-completion prompts and 2 free-form chat prompts, 128 new tokens
(a chat answer may end earlier at the end-of-turn token), 2 rounds for float32 and 1 for
the transformers and bfloat16 parts.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path


from speculative import NGramProposer, SpeculativeConfig, load_model
from speculative.entrypoints.bench import Method, Result, hf_generate, plain_method, run_methods, speculative_method
from speculative.models.loading import load_draft
from speculative.models.precision import first_divergence
from speculative.proposers.vocab import corpus_vocab

HERE = Path(__file__).parent
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
MAX_NEW, RUNS, VOCAB = 128, 2, 32768


def workload(tokenizer) -> list[list[int]]:
    rows = [json.loads(line) for name in ("code_completion.jsonl", "chat.jsonl")
            for line in (HERE / name).read_text().splitlines()[:3 if name.startswith("code") else 2]]
    return [tokenizer.chat(r["prompt"]) if r.get("chat") else tokenizer.encode(r["prompt"]) for r in rows]


def config(k: int, adaptive: bool = False, lookup: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(num_draft_tokens=k, adaptive=adaptive, prompt_lookup=lookup)


def finish(report: dict, title: str, ids) -> dict:
    report["title"] = title
    report["prompt_tokens"] = [len(p) for p in ids]
    gc.collect()
    return report


def part_float32(log=print) -> dict:
    target = load_model(TARGET, dtype="float32")
    ids, eos = workload(target.tokenizer), target.tokenizer.eos_token_ids
    vocab = corpus_vocab(target.tokenizer, VOCAB)
    int8, fp32 = load_draft(DRAFT, dtype="int8"), load_draft(DRAFT, dtype="float32")
    methods = [plain_method("ours plain, float32", target)]
    for k in (2, 4, 6):
        methods.append(speculative_method(f"draft-int8 K={k}", target, int8, config(k)))
    methods += [
        speculative_method("draft-int8 adaptive (K<=6)", target, int8, config(6, adaptive=True)),
        speculative_method(f"draft-int8 vocab {VOCAB // 1024}k K=4", target, int8, config(4), draft_vocab=vocab),
        speculative_method("draft-float32 K=4", target, fp32, config(4)),
        speculative_method("ngram adaptive (K<=10)", target, NGramProposer(num_draft_tokens=10),
                           config(10, adaptive=True)),
        speculative_method("draft-int8+lookup adaptive (K<=6)", target, int8, config(6, adaptive=True, lookup=True)),
    ]
    report = run_methods(methods, ids, MAX_NEW, RUNS, eos, log)
    return finish(report, "Qwen2.5-Coder 1.5B + 0.5B, float32 target (oneDNN layers), 3 code + 2 chat prompts, "
                          "128 new tokens", ids)


def part_transformers(log=print) -> dict:
    target = load_model(TARGET, dtype="float32")
    plain_target = load_model(TARGET, dtype="float32", pack=False)
    plain_draft = load_model(DRAFT, dtype="float32", pack=False)
    ids, eos = workload(target.tokenizer), target.tokenizer.eos_token_ids
    methods = [plain_method("ours plain, float32", target),
               Method(Result("transformers generate, float32"), hf_generate(plain_target, {})),
               Method(Result("transformers assisted (0.5B), float32", draft="0.5B"),
                      hf_generate(plain_target, {"assistant_model": plain_draft.model, "num_assistant_tokens": 5,
                                                 "num_assistant_tokens_schedule": "heuristic",
                                                 "assistant_confidence_threshold": 0.0}))]
    report = run_methods(methods, ids, MAX_NEW, 1, eos, log)  # one round: slow, and far apart
    return finish(report, "Qwen2.5-Coder 1.5B: transformers' own generate on the plain float32 model (what a user "
                          "gets today) against our plain float32 decoding", ids)


def part_bfloat16(log=print) -> dict:
    target = load_model(TARGET, dtype="bfloat16")
    fp32 = load_model(TARGET, dtype="float32")
    ids, eos = workload(target.tokenizer), target.tokenizer.eos_token_ids
    bf16_draft, int8 = load_draft(DRAFT, dtype="bfloat16"), load_draft(DRAFT, dtype="int8")
    base = plain_method("ours plain, bfloat16", target)
    methods = [base, plain_method("ours plain, float32", fp32)]
    methods[1].compare = False  # float32 output differs from bfloat16 output in places: no reference
    methods += [
        speculative_method("draft-bfloat16 K=4", target, bf16_draft, config(4)),
        speculative_method("draft-int8 K=4", target, int8, config(4)),
        speculative_method("draft-int8+lookup adaptive (K<=6)", target, int8, config(6, adaptive=True, lookup=True)),
    ]
    report = run_methods(methods, ids, MAX_NEW, 1, eos, log)  # one round: a session's time
    return finish(report, "Qwen2.5-Coder 1.5B + 0.5B, bfloat16 target, 3 code + 2 chat prompts, 128 new tokens "
                          "(identical: to our bfloat16 plain decoding)", ids)


def section(save, log=print) -> None:
    """The float32 and transformers parts; the bfloat16 part is a section of its own
    (`qwen-bfloat16`), worth running apart on CPUs with native bfloat16."""
    for name, part in (("qwen", part_float32), ("qwen-transformers", part_transformers)):
        log(f"== {name}")
        save(name, part(log))
        gc.collect()


def divergence(target, draft, ids: list[list[int]], max_new: int, k: int = 4) -> dict:
    """Greedy speculative against autoregressive decoding of the same model, prompt by
    prompt: how many outputs differ, where, and whether each first difference is a
    near-tie of the reference (its top two logits within 4 units in the last place)."""
    from speculative import SpeculativeDecoder, autoregressive_generate

    decoder = SpeculativeDecoder(target, draft, config(k))
    rows, tokens = [], 0
    for prompt in ids:
        ref, out = autoregressive_generate(target, prompt, max_new), decoder.generate(prompt, max_new)
        tokens += len(ref)
        found = first_divergence(target, prompt, ref, out)
        if found is not None:
            at, gap, tolerance = found
            rows.append({"prompt_tokens": len(prompt), "position": at, "gap": gap, "tolerance": tolerance,
                         "near_tie": gap <= tolerance})
    return {"prompts": len(ids), "tokens": tokens, "max_new_tokens": max_new, "k": k, "diverged": len(rows),
            "all_near_ties": all(r["near_tie"] for r in rows), "divergences": rows,
            "per_token": len(rows) / tokens if tokens else 0.0}


def divergence_section(save, prompts, log=print) -> None:
    """Divergence in bfloat16 and float32: the shipped pair (20 held-out functions, 64
    tokens), Gemma 3 270M with n-gram drafts (the grounded prompts), and the Qwen pair
    (the benchmark's 5 prompts). One entry per machine: kernels, so ties, differ by CPU."""
    from speculative.train import corpus

    report = {"date": time.strftime("%Y-%m-%d")}
    _, held_out = corpus.split_files()
    for dtype in ("bfloat16", "float32"):
        target = load_model("default", dtype=dtype)
        code = [target.tokenizer.encode(p)[-(512 - 64 - 9):] for p in corpus.function_prompts(held_out, 20)]
        report[f"default {dtype}"] = divergence(target, load_model("default-draft", dtype=dtype), code, 64)
        gemma = load_model("gemma-3-270m", dtype=dtype)
        report[f"gemma-3-270m {dtype}"] = divergence(gemma, NGramProposer(num_draft_tokens=10),
                                                    prompts("grounded_editing.jsonl", gemma.tokenizer), 128, k=10)
        qwen = load_model(TARGET, dtype=dtype)
        report[f"qwen {dtype}"] = divergence(qwen, load_draft(DRAFT, dtype="int8"), workload(qwen.tokenizer), 64)
        del target, gemma, qwen
        gc.collect()
        log(", ".join(f"{name}: {r['diverged']}/{r['prompts']}" for name, r in report.items() if name != "date"))
    save("divergence", report)  # this machine's entry (`save_per_machine`)
