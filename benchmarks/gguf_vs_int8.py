"""`--dtype gguf` (the GGUF's own Q4_K/Q6_K blocks, what `auto` picks on CPUs with VNNI) against
int8 and llama.cpp, Qwen2.5-Coder 1.5B, plain and speculative: the default (lookup first, the
0.5B draft else, up to 4 tokens, on its own file's blocks, mostly Q5_0, as `auto` loads it,
scoring 32k tokens as `--draft-vocab auto`), the default with lookup matches drafting up to 24
(`--lookup-draft-tokens 24`), and int8 with lookup alone (K = 16).

    python benchmarks/gguf_vs_int8.py [PROMPTS_PER_WORKLOAD]   # default 2; needs llama-cpp-python

One process, 2 threads, the llama-cpp section's workloads and methods (vs_llama_cpp.py), 2
interleaved rounds after a warm-up; ratios to llama.cpp's plain decoding in the same round,
medians. Checks every speculative output against its own target's plain decoding.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import vs_llama_cpp as V  # noqa: E402
from run import qwen_workloads  # noqa: E402

from speculative import NGramProposer, SpeculativeConfig, load_model  # noqa: E402
from speculative.models.loading import load_draft  # noqa: E402
from speculative.models.presets import QWEN_CODER_15B, assemble, cache_root  # noqa: E402


def main(limit: int) -> None:
    torch.set_num_threads(V.THREADS)
    gguf = str(assemble(QWEN_CODER_15B, cache_root() / "gguf" / f"{QWEN_CODER_15B.name}.gguf"))
    int8, kquant = load_model("qwen2.5-coder-1.5b", dtype="int8"), load_model("qwen2.5-coder-1.5b", dtype="gguf")
    gguf_draft = load_draft("qwen2.5-coder-0.5b", dtype="gguf")
    vocab, reach = V.default_vocab(kquant.tokenizer), SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True,
                                                                        lookup_draft_tokens=24)
    methods = {"llama.cpp plain": V.llama_method(gguf, False),
               "ours int8 plain": V.engine_method(int8), "ours gguf plain": V.engine_method(kquant),
               "ours int8 + lookup (K = 16)": V.engine_method(int8, NGramProposer(num_draft_tokens=16),
                                                              SpeculativeConfig(num_draft_tokens=16)),
               "ours default, lookup drafts up to 24": V.engine_method(kquant, gguf_draft, reach, vocab),
               "ours default (gguf, gguf draft, 32k)": V.engine_method(kquant, gguf_draft, V.DEFAULT, vocab)}
    eos = set(kquant.tokenizer.eos_token_ids)
    for workload, prompts in qwen_workloads(kquant.tokenizer, limit=limit).items():
        print(f"{workload}: prompts of {[len(p) for p in prompts]} tokens", flush=True)
        for method in methods.values():
            method(prompts[0], 8, eos)  # warm-up
        rounds = []
        for number in range(2):
            names = list(methods)[number:] + list(methods)[:number]
            rounds.append({name: [methods[name](ids, V.MAX_NEW, eos) for ids in prompts] for name in names})
        for name in methods:
            ratio = [statistics.median(V.speeds(r[name])[i] / V.speeds(r["llama.cpp plain"])[i] for r in rounds)
                     for i in (0, 1)]
            rate = statistics.median(V.speeds(r[name])[0] for r in rounds)
            print(f"  {name:20s} {ratio[0]:.2f}x / {ratio[1]:.2f}x ({rate:.1f} tok/s)", flush=True)
        outputs = {name: [out for out, _, _ in rounds[-1][name]] for name in methods}
        for name in methods:
            if name.startswith("ours") and "plain" not in name:
                plain = "ours int8 plain" if name.startswith("ours int8") else "ours gguf plain"
                same = sum(a == b for a, b in zip(outputs[name], outputs[plain]))
                print(f"  {name} identical to {plain}: {same}/{len(prompts)}")
        print("  tokens shared by gguf plain and llama.cpp plain:",
              [V.shared(a, b) for a, b in zip(outputs["ours gguf plain"], outputs["llama.cpp plain"])], flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
