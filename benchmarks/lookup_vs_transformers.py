"""Our prompt lookup against transformers' `prompt_lookup_num_tokens` on the very same module.

Gemma 3 270M loads natively (models/gemma3.py) by default; transformers' generate needs its
own module, so both sides here run the transformers module that `load_model` would wrap
(HFModel over Gemma3ForCausalLM, the same packed layers and compiled norms): per forward they
pay the same, and what differs is drafting. Our native model runs beside them for reference.

Fairness: in bfloat16, near-ties (top two logits one bfloat16 step apart) can make a method's
text leave greedy decoding, and a different text is a different amount of work. Each method's
text is compared with plain greedy decoding of its module; speed ratios between ours and
transformers' are taken only over prompts where both texts are identical, and the prompts left
out are named. Rounds interleave every method prompt by prompt, each round starting at the
next method; figures are medians over rounds.

Speed ratios are also given paired: the median, over rounds and prompts, of the two methods'
seconds timed back to back (the machine's speed drifts within minutes).

The first-against-tenth check pairs a fresh process's first request with the tenth or a later
request of a process that has served the same prompt before, timed back to back (five pairs
by default); its ratio is the median over the pairs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder, autoregressive_generate, load_model
from speculative.core.config import LOOKUP_K as K  # our lookup's default K
from speculative.models.loading import _prepare, resolve
from speculative.models.transformers_loading import load_transformers

PEER_K = 10  # transformers' documented prompt_lookup_num_tokens


def hf_module(dtype: str):
    """Gemma 3 270M through transformers, prepared as load_model prepares a transformers model."""
    path = resolve("gemma-3-270m")
    torch_dtype = getattr(torch, dtype)
    model = load_transformers(path, "cpu", torch_dtype, lambda m: _prepare(m, "gemma-3-270m", None, False, True))
    return model


def transformers_lookup(hf, ids, n):
    inputs = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, prompt_lookup_num_tokens=PEER_K, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def methods(dtype: str) -> tuple[dict, dict]:
    """(methods by name, the plain method of each module) for one dtype."""
    hf = hf_module(dtype)
    native = load_model("gemma-3-270m", dtype=dtype)
    ours_hf = SpeculativeDecoder(hf, NGramProposer(num_draft_tokens=K), SpeculativeConfig(num_draft_tokens=K))
    ours_native = SpeculativeDecoder(native, NGramProposer(num_draft_tokens=K), SpeculativeConfig(num_draft_tokens=K))
    table = {
        "plain (transformers module)": lambda ids, n: autoregressive_generate(hf, ids, n),
        f"transformers prompt lookup ({PEER_K})": lambda ids, n: transformers_lookup(hf, ids, n),
        f"ours lookup, adaptive K<={K} (transformers module)": lambda ids, n: ours_hf.generate(ids, n),
        "plain (native module)": lambda ids, n: autoregressive_generate(native, ids, n),
        f"ours lookup, adaptive K<={K} (native module)": lambda ids, n: ours_native.generate(ids, n),
    }
    plain_of = {name: ("plain (native module)" if "native" in name else "plain (transformers module)")
                for name in table}
    return table, plain_of


def timed(run, ids, n):
    start = time.perf_counter()
    out = run(ids, n)
    return out, time.perf_counter() - start


def compare(dtype: str, prompts: list[list[int]], max_new: int = 128, runs: int = 3) -> dict:
    table, plain_of = methods(dtype)
    names = list(table)
    for name in names:  # warm-up: kernels, tables, the policy's first steps
        table[name](prompts[0][:200], 8)
    seconds = {name: [[] for _ in prompts] for name in names}
    texts = {name: [None] * len(prompts) for name in names}
    for round_ in range(runs):
        for i, ids in enumerate(prompts):
            start = (round_ * len(prompts) + i) % len(names)
            for name in names[start:] + names[:start]:
                out, secs = timed(table[name], ids, max_new)
                texts[name][i] = out
                seconds[name][i].append(secs)
                print(f"{dtype} round {round_} prompt {i} {name}: {secs:.2f} s", file=sys.stderr, flush=True)
    medians = {name: [statistics.median(s) for s in seconds[name]] for name in names}
    report = {"dtype": dtype, "prompts": len(prompts), "max_new": max_new, "runs": runs, "methods": {}}
    for name in names:
        plain = plain_of[name]
        same = [texts[name][i] == texts[plain][i] for i in range(len(prompts))]
        report["methods"][name] = {
            "tok_s": round(max_new * len(prompts) / sum(medians[name]), 2),
            "x_plain": round(sum(medians[plain]) / sum(medians[name]), 2),
            "identical_to_plain": same, "seconds": [round(s, 3) for s in medians[name]]}
    ours = f"ours lookup, adaptive K<={K} (transformers module)"
    peer = f"transformers prompt lookup ({PEER_K})"
    both = [i for i in range(len(prompts)) if texts[ours][i] == texts[peer][i]]
    native = f"ours lookup, adaptive K<={K} (native module)"
    report["ours_over_transformers"] = {
        "prompts_compared": both,
        "x": round(sum(medians[peer][i] for i in both) / sum(medians[ours][i] for i in both), 2) if both else None,
        "native_x": round(sum(medians[peer][i] for i in both) / sum(medians[native][i] for i in both), 2)
        if both else None,
        "x_paired": paired_ratio(seconds[peer], seconds[ours], both),
        "native_x_paired": paired_ratio(seconds[peer], seconds[native], both)}
    return report


def paired_ratio(peer: list[list[float]], ours: list[list[float]], prompts: list[int]) -> float | None:
    """The median over rounds and prompts of peer seconds / ours, each pair timed back to back:
    the machine's speed drifts by a third within minutes here, and a pair shares its moment."""
    ratios = [p / o for i in prompts for p, o in zip(peer[i], ours[i])]
    return round(statistics.median(ratios), 2) if ratios else None


def first_against_tenth(dtype: str, method: str, processes: int = 5, prompt_index: int = 0,
                        repeats: int = 10) -> dict:
    """A fresh process's first request against this process's `repeats`th and later ones,
    in pairs timed back to back (the machine's speed drifts by a third within minutes, so
    processes run one after another would compare different moments): this process serves
    `repeats` - 1 requests, then `processes` times a fresh process serves its first and this
    one its next. Ratios are medians over the pairs."""
    run = request(dtype, method, prompt_index)

    def warm_seconds() -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    for _ in range(repeats - 1):
        run()
    pairs = []
    for number in range(processes):  # which of the pair runs first alternates
        warm = warm_seconds() if number % 2 else None
        first = first_request_seconds(dtype, method, prompt_index)
        pairs.append((first, warm_seconds() if warm is None else warm))
    ratios = [first / warm for first, warm in pairs]
    return {"dtype": dtype, "method": method, "processes": processes,
            "seconds_first_and_warm": [[round(x, 3) for x in pair] for pair in pairs],
            "first_over_warm": round(statistics.median(ratios), 3), "per_pair": [round(r, 3) for r in ratios]}


def request(dtype: str, method: str, prompt_index: int):
    """A call that serves one request of the grounded-editing prompt, plain or by our lookup."""
    target = load_model("gemma-3-270m", dtype=dtype)
    ids = prompts_of(target.tokenizer)[prompt_index]
    if method == "plain":
        return lambda: autoregressive_generate(target, ids, 128)
    decoder = SpeculativeDecoder(target, NGramProposer(num_draft_tokens=K), SpeculativeConfig(num_draft_tokens=K))
    return lambda: decoder.generate(ids, 128)


def first_request_seconds(dtype: str, method: str, prompt_index: int) -> float:
    """Seconds of the first request of a fresh process."""
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from lookup_vs_transformers import request
run = request({dtype!r}, {method!r}, {prompt_index})
start = time.perf_counter(); run(); print(time.perf_counter() - start)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def prompts_of(tokenizer) -> list[list[int]]:
    path = Path(__file__).parent / "grounded_editing.jsonl"
    return [tokenizer.encode(json.loads(line)["prompt"]) for line in path.read_text().splitlines() if line.strip()]


def section(save_per_machine, runs: int = 2) -> None:
    """Both dtypes, then the first-against-tenth check (about 25 minutes on 2 cores)."""
    tokenizer = load_model("gemma-3-270m", dtype="float32").tokenizer
    prompts = prompts_of(tokenizer)
    entry = {"compare": [compare(dtype, prompts, runs=runs) for dtype in ("float32", "bfloat16")],
             "first_request": [first_against_tenth("bfloat16", method) for method in ("plain", "lookup")]}
    save_per_machine("lookup-transformers", entry)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "compare"
    if what == "compare":
        tokenizer = load_model("gemma-3-270m", dtype="float32").tokenizer
        count = int(sys.argv[3]) if len(sys.argv) > 3 else None
        print(json.dumps(compare(sys.argv[2], prompts_of(tokenizer)[:count], runs=int(sys.argv[4]) if len(sys.argv) > 4
                                 else 3)))
    else:
        print(json.dumps(first_against_tenth(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]))))
