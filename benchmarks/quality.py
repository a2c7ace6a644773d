"""What int8 costs in quality: perplexity and greedy agreement, float32 / bfloat16 / int8.

    python benchmarks/run.py int8-quality     # Gemma 3 270M, Qwen2.5-Coder 0.5B and 1.5B (half an hour)

Perplexity on held-out text the models were not tuned on here: assistant replies of
held-out ShareGPT conversations (its own split, `train/sharegpt.py`) and Python standard
library source (the modules the shipped pair holds out), read as chunks of CHUNK tokens
scored in one forward each; the same tokens for every precision, so their perplexities
compare pair by pair. Greedy agreement: the tokens that a precision's greedy continuation
of a prompt shares with bfloat16's from the start, over 128 new tokens.
"""

from __future__ import annotations

import gc
import math
import sysconfig
import time
from pathlib import Path

import torch

from speculative import autoregressive_generate, load_model

CHUNK, CHUNKS, AGREEMENT_TOKENS, AGREEMENT_PROMPTS = 512, 4, 128, 1
MODELS = ("gemma-3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
PRECISIONS = ("float32", "bfloat16", "int8")
STDLIB_FILES = ("textwrap.py", "difflib.py", "fractions.py", "shlex.py")


def texts() -> dict[str, str]:
    from speculative.train.sharegpt import dataset_text, held_out, messages, records

    replies = []
    for record in records(dataset_text()):
        if held_out(record):
            replies += [m["content"] for m in messages(record) if m["role"] == "assistant" and len(m["content"]) > 200]
        if sum(map(len, replies)) > 60_000:
            break
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return {"sharegpt replies": "\n\n".join(replies), "stdlib source": "\n\n".join(
        (stdlib / name).read_text() for name in STDLIB_FILES)}


def chunks(tokenizer, text: str) -> list[list[int]]:
    ids = tokenizer.encode(text)
    return [ids[i:i + CHUNK] for i in range(0, CHUNKS * CHUNK, CHUNK) if len(ids) >= i + CHUNK]


def perplexity(model, pieces: list[list[int]]) -> float:
    total, count = 0.0, 0
    with torch.inference_mode():
        for piece in pieces:
            tokens = torch.tensor([piece], device=model.device)
            logits = model.forward(tokens, model.new_state(1, len(piece)))[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits.float(), tokens[0, 1:], reduction="sum"))
            count += len(piece) - 1
    return math.exp(total / count)


def agreement_prompts(tokenizer) -> list[list[int]]:
    import json

    here = Path(__file__).parent
    rows = [json.loads(line) for name in ("code_completion.jsonl", "chat.jsonl")
            for line in (here / name).read_text().splitlines()[:AGREEMENT_PROMPTS]]
    return [tokenizer.chat(r["prompt"]) if r.get("chat") and tokenizer.has_chat_template() else
            tokenizer.encode(r["prompt"]) for r in rows]


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def section(save_per_machine, log=print) -> None:
    corpus = texts()
    entry = {"date": time.strftime("%Y-%m-%d"), "chunk": CHUNK, "models": {}}
    for name in MODELS:
        rows, continuations = {}, {}
        for precision in PRECISIONS:
            model = load_model(name, dtype=precision)
            data = {source: chunks(model.tokenizer, text) for source, text in corpus.items()}
            prompts = agreement_prompts(model.tokenizer)
            started = time.perf_counter()
            rows[precision] = {source: perplexity(model, pieces) for source, pieces in data.items()}
            continuations[precision] = [autoregressive_generate(model, p, AGREEMENT_TOKENS) for p in prompts]
            rows[precision]["tokens"] = {source: sum(map(len, pieces)) for source, pieces in data.items()}
            log(f"  {name} {precision}: " + ", ".join(f"{s} {rows[precision][s]:.3f}" for s in corpus) +
                f" ({time.perf_counter() - started:.0f} s)")
            del model
            gc.collect()
        for precision in PRECISIONS:
            rows[precision]["agreement_with_bfloat16"] = [
                shared(a, b) for a, b in zip(continuations[precision], continuations["bfloat16"])]
            rows[precision]["vs_bfloat16"] = {s: rows[precision][s] / rows["bfloat16"][s] - 1 for s in corpus}
        entry["models"][name] = rows
        save_per_machine("int8-quality", entry, title="int8 quality: perplexity and greedy agreement with bfloat16")


def render(report: dict, legend) -> list[str]:
    parts = [f"### {report['title']}\n",
             f"Perplexity on chunks of {CHUNK} tokens (held-out ShareGPT replies; Python stdlib source), and the "
             "difference to bfloat16's; greedy agreement: tokens shared with bfloat16's continuation from the start, "
             f"of {AGREEMENT_TOKENS}, for {AGREEMENT_PROMPTS} code and {AGREEMENT_PROMPTS} chat prompt(s).\n"]
    machines = report["machines"]
    parts += legend(machines)
    parts += ["| machine | model | precision | ShareGPT ppl | vs bf16 | stdlib ppl | vs bf16 | agreement |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for number, entry in enumerate(machines.values(), 1):
        for model, rows in entry["models"].items():
            for precision, row in rows.items():
                share, stdlib = row["sharegpt replies"], row["stdlib source"]
                vs = row["vs_bfloat16"]
                parts.append(f"| ({number}) | {model} | {precision} | {share:.3f} | {vs['sharegpt replies']:+.2%} | "
                             f"{stdlib:.3f} | {vs['stdlib source']:+.2%} | "
                             f"{', '.join(map(str, row['agreement_with_bfloat16']))} |")
    parts.append("")
    return parts
