"""Regenerates every benchmark and the results section of BENCHMARKS.md.

    python benchmarks/run.py            # all sections (about an hour on 2 CPU cores)
    python benchmarks/run.py default    # only some: default, llama, gemma, mixed, batch

Each section runs in this one process, on the same models and prompts for every method,
and writes benchmarks/results/<section>.json (and a PNG where it helps); the tables in
BENCHMARKS.md between the result markers are rebuilt from all the JSON files present.
"""

import json
import sys
import time
from pathlib import Path

import torch

from speculative import load_model, load_tokenizer
from speculative.bench import batch_throughput, machine, plot, run_bench, table

import qwen

HERE = Path(__file__).parent
RESULTS = HERE / "results"
ROOT = HERE.parent


def prompts(name, tokenizer, limit=None, max_tokens=None):
    """Token ids of a workload's prompts (chat rows through the chat template), the end of
    each kept when `max_tokens` is given."""
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    ids = [tokenizer.chat(r["prompt"]) if r.get("chat") else tokenizer.encode(r["prompt"]) for r in rows][:limit]
    return [row[-max_tokens:] for row in ids] if max_tokens else ids


def save(name, report):
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")


def section_default(dtype="auto"):
    target, tokenizer = load_model("default", dtype=dtype), load_tokenizer("default")
    draft = load_model("default-draft", dtype=dtype)
    drafts = {"draft": draft, "draft_s4d": load_model("default-s4d", dtype=dtype), "draft+lookup": draft}
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - 128 - 9)
    report = run_bench(target, drafts, ids, max_new=128, runs=3, ks=(1, 2, 4, 8), eos=None, lookup=("draft+lookup",))
    name = "default" if dtype == "auto" else f"default-{dtype}"
    report["title"] = (f"Shipped pair, code completion on held-out stdlib functions (greedy, 128 new tokens), "
                       f"{dtype_words(target)}")
    save(name, report)
    plot(report, RESULTS / f"{name}.png")


def dtype_words(model) -> str:
    from speculative.precision import model_dtype

    return str(model_dtype(model)).removeprefix("torch.")


def section_mixed():
    target, tokenizer = load_model("default"), load_tokenizer("default")
    ids = prompts("mixed.jsonl", tokenizer, max_tokens=512 - 96 - 9)
    report = run_bench(target, {"draft+lookup": load_model("default-draft")}, ids, max_new=96, runs=3,
                       ks=(1, 2, 3, 4, 6, 8), eos=None, ngram=True, lookup=("draft+lookup",))
    report["title"] = "Mixed workload: easy (self-repeating code) and hard (English prose) prompts alternate"
    save("mixed", report)


def section_llama():
    from speculative.export import export_llama
    from speculative.loading import ASSETS

    out = ROOT / "runs" / "exported"
    for name, preset in (("verifier", "default"), ("draft", "default-draft")):
        if not (out / name / "config.json").is_file():
            export_llama(load_model(preset), out / name, ASSETS / "tokenizer.json")
    target, draft = load_model(out / "verifier"), load_model(out / "draft")
    ids = prompts("code_completion.jsonl", target.tokenizer, max_tokens=512 - 128 - 9)
    report = run_bench(target, {"draft (Llama export)": draft}, ids, max_new=128, runs=3, ks=(2, 4, 6), eos=None)
    report["title"] = ("Shipped pair exported to transformers' Llama format: ours and transformers' assisted "
                       "generation on the very same weights")
    save("llama", report)


def section_gemma(dtype="auto"):
    target = load_model("gemma-3-270m", dtype=dtype)
    ids = prompts("grounded_editing.jsonl", target.tokenizer)
    report = run_bench(target, {}, ids, max_new=128, runs=3, ks=(4, 10), eos=None)
    report["title"] = (f"Gemma 3 270M, input-grounded prompts (edit, quote, answer), n-gram drafts, 128 new tokens, "
                       f"{dtype_words(target)}")
    report["prompt_tokens"] = [len(p) for p in ids]
    save("gemma" if dtype == "auto" else f"gemma-{dtype}", report)


def section_batch():
    target, tokenizer = load_model("default"), load_tokenizer("default")
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - 64 - 9)
    report = {"default": batch_throughput(target, load_model("default-draft"), ids, max_new=64, k=4, runs=5,
                                          prompt_lookup=True)}
    gemma = load_model("gemma-3-270m")
    from speculative import NGramProposer

    gemma_ids = prompts("grounded_editing.jsonl", gemma.tokenizer)
    report["gemma"] = batch_throughput(gemma, NGramProposer(num_draft_tokens=10), gemma_ids,
                                       batch_sizes=(1, 2, 4, 8), max_new=64, runs=1, k=10)
    save("batch", report)


SECTIONS = {"default": section_default, "llama": section_llama, "gemma": section_gemma, "mixed": section_mixed,
            "batch": section_batch, "qwen": lambda: qwen.section(save),
            "default-bfloat16": lambda: section_default("bfloat16"),
            "gemma-bfloat16": lambda: section_gemma("bfloat16"),
            "divergence": lambda: qwen.divergence_section(save, prompts)}
TABLES = ("default", "default-bfloat16", "mixed", "llama", "gemma", "gemma-bfloat16", "qwen", "qwen-transformers",
          "qwen-bfloat16")


def render() -> str:
    """Markdown for every result file present."""
    parts = [f"_Generated by `python benchmarks/run.py` on {time.strftime('%Y-%m-%d')}; machine: {machine()}._\n"]
    for name in TABLES:
        path = RESULTS / f"{name}.json"
        if path.is_file():
            report = json.loads(path.read_text())
            parts.append(f"### {report.get('title', name)}\n\n```\n{table(report).rstrip()}\n```\n")
            if (RESULTS / f"{name}.png").is_file():
                parts.append(f"![{name}](results/{name}.png)\n")
    path = RESULTS / "divergence.json"
    if path.is_file():
        parts.append("### Greedy divergence: speculative against autoregressive output of the same model and dtype\n")
        parts.append("| model, dtype | prompts | tokens | outputs that differ | first differences at | all near-ties |")
        parts.append("| --- | --- | --- | --- | --- | --- |")
        for name, row in json.loads(path.read_text()).items():
            if isinstance(row, dict):
                where = ", ".join(str(d["position"]) for d in row["divergences"]) or "-"
                parts.append(f"| {name} | {row['prompts']} | {row['tokens']} | {row['diverged']} | {where} | "
                             f"{'yes' if row['all_near_ties'] else 'NO'} |")
        parts.append("")
    path = RESULTS / "batch.json"
    if path.is_file():
        for setting, report in json.loads(path.read_text()).items():
            parts.append(f"### Batch throughput, {setting} (total tokens/s across the batch, "
                         f"{report['max_new_tokens']} new tokens per row, K={report['k']})\n")
            parts.append("| batch | autoregressive | speculative K | speedup | adaptive | speedup "
                         "| adaptive drafted/step | identical |")
            parts.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for row in report["rows"]:
                fixed = row[f"speculative K={report['k']}"]
                adaptive = row["speculative adaptive"]
                parts.append(f"| {row['batch_size']} | {row['autoregressive']['tokens_per_second']:.1f} | "
                             f"{fixed['tokens_per_second']:.1f} | {fixed['speedup']:.2f}x | "
                             f"{adaptive['tokens_per_second']:.1f} | {adaptive['speedup']:.2f}x | "
                             f"{adaptive['drafted_per_step']:.2f} | "
                             f"{'yes' if fixed['identical'] and adaptive['identical'] else 'NO'} |")
            parts.append("")
    return "\n".join(parts)


def update_markdown() -> None:
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    path.write_text(f"{head}{start}\n{render()}\n{end}{tail}")


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    RESULTS.mkdir(exist_ok=True)
    chosen = sys.argv[1:] or list(SECTIONS)
    unknown = [c for c in chosen if c not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    for name in chosen:
        print(f"== {name}")
        SECTIONS[name]()
    update_markdown()
    print("BENCHMARKS.md updated")
