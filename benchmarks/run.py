"""Regenerates every benchmark and its full tables, benchmarks/results/TABLES.md.

    python benchmarks/run.py            # all sections (about an hour and a half on 2 CPU cores)
    python benchmarks/run.py default    # only some: default, heads, llama, gemma, mixed, batch, qwen, engine, ...
    python benchmarks/run.py engine-smoke   # a reduced engine run (results/engine-smoke.json only)
    python benchmarks/run.py engine-batch1  # only the engine's batch-1 comparison with the code before it
    python benchmarks/run.py serve-smoke    # a reduced server run (results/serve-smoke.json only)
    python benchmarks/run.py batch-ray-smoke   # a reduced Ray batch run (results/batch-ray-smoke.json only)
    python benchmarks/run.py trees      # token trees against chains and plain decoding (a few minutes)
    python benchmarks/run.py heads-128     # default-head on the default section's workload (128 new tokens)
    python benchmarks/run.py heads-gemma   # Gemma 3 270M with its draft head: chat and grounded editing
    python benchmarks/run.py heads-gemma-chat   # only its chat part (or heads-gemma-grounded; -float32: in float32)
    python benchmarks/run.py prefill-gemma # Gemma 3 270M reading long prompts: key blocks read, norms compiled
    python benchmarks/run.py verify-cost-gemma  # Gemma's forward cost by width, float32 against bfloat16 (or -qwen)
    python benchmarks/run.py trees-gemma-float32  # trees-gemma in float32 (auto picks bfloat16 on CPUs with it)
    python benchmarks/run.py trees-tau  # model trees' tau against chains of the same width, 40 prompts, untimed
    python benchmarks/run.py llama-cpp  # against llama.cpp on Qwen 1.5B's GGUF (llama-cpp-gemma: Gemma 3 270M)
    python benchmarks/run.py structured  # JSON extraction under a schema, against llama.cpp's grammar (structured.py)
    python benchmarks/run.py int8-quality  # perplexity and agreement of float32, bfloat16 and int8 (an hour)

Threads: 2, or SPECULATIVE_BENCH_THREADS. On a machine shared with other busy processes,
two threads can run ten times slower than one (each waits for the other to be scheduled).

Each section runs in this one process, on the same models and prompts for every method,
and writes benchmarks/results/<section>.json (and a PNG where it helps); the tables in
results/TABLES.md between the result markers are rebuilt from all the JSON files present
(BENCHMARKS.md, the results per CPU, is kept by hand from them).
"""

import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from speculative import load_model, load_tokenizer
from speculative.entrypoints.bench import batch_throughput, machine, plot, run_bench, table

import batch_ray
import lookup_vs_transformers
import vs_llama_cpp
import quality
import qwen
import serve_bench
import structured
import trees

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


def save_per_machine(name, entry, **shared):
    """Save `entry` as this machine's, beside other machines' entries in the same file (for
    figures that depend on the CPU's kernels: costs by width, where ties fall)."""
    path = RESULTS / f"{name}.json"
    machines = json.loads(path.read_text()).get("machines", {}) if path.is_file() else {}
    machines[machine()] = entry
    save(name, {**shared, "machines": machines})


def machine_legend(machines: dict, details=lambda entry: "") -> list[str]:
    """'(n) machine, date...' lines naming the machines of a per-machine table."""
    return [f"({number}) {name}, {entry['date']}{details(entry)}.\n"
            for number, (name, entry) in enumerate(machines.items(), 1)]


def qwen_workloads(tokenizer, limit=3):
    """The llama-cpp section's workloads: the first prompts of each file."""
    return {"code completion": prompts("code_completion.jsonl", tokenizer, limit),
            "grounded editing": prompts("grounded_editing.jsonl", tokenizer, limit),
            "chat": prompts("chat.jsonl", tokenizer, limit)}


def gemma_workloads(tokenizer, limit=3):
    """Gemma's (its GGUF has no chat template): held-out ShareGPT first turns, as the
    heads-gemma-chat section reads them, for chat."""
    from speculative.train.sharegpt import sharegpt_data

    return {"code completion": prompts("code_completion.jsonl", tokenizer, limit),
            "grounded editing": prompts("grounded_editing.jsonl", tokenizer, limit),
            "chat (ShareGPT first turns)": sharegpt_data(tokenizer, 1, limit)[1]}


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
    from speculative.models.precision import model_dtype

    return str(model_dtype(model)).removeprefix("torch.")


def section_mixed():
    target, tokenizer = load_model("default"), load_tokenizer("default")
    ids = prompts("mixed.jsonl", tokenizer, max_tokens=512 - 96 - 9)
    report = run_bench(target, {"draft+lookup": load_model("default-draft")}, ids, max_new=96, runs=3,
                       ks=(1, 2, 3, 4, 6, 8), eos=None, ngram=True, lookup=("draft+lookup",))
    report["title"] = "Mixed workload: easy (self-repeating code) and hard (English prose) prompts alternate"
    save("mixed", report)


def section_llama():
    from speculative.entrypoints.export import export_llama
    from speculative.models.loading import ASSETS

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


PREFILL_WAYS = ("whole span, PyTorch's norms", "seen key blocks, PyTorch's norms", "seen key blocks, compiled norms")


def section_prefill_gemma(runs=3):
    """Gemma 3 270M (the built-in decoder) reading the grounded-editing prompts (636-1,538
    tokens), in float32 and bfloat16: each block of queries over every key slot, as before
    2026-12-06 (PyTorch's fused kernel, which bfloat16 ran, splits queries so itself), against
    each over the key blocks it sees (`attention.seen_blocks`), without and with the compiled
    norms; after each prompt, forwards of 1 and 16 tokens (greedy rows: the output layer's
    screen), rolled back. The same model, switched between timings, rounds interleaved,
    medians; the logits after every prompt compared with the whole span's."""
    import speculative.models.attention as attention
    from speculative.models.base import prefill
    from speculative.models.gemma3 import GemmaRMSNorm

    def steps(target, state, p, times):
        for width, repeat in ((1, 4), (16, 2)):
            for r in range(repeat):
                length = state.lengths[0]
                started = time.perf_counter()
                target.forward(torch.tensor([p[16 * r:16 * r + width]]), state, argmax_rows=[True])
                times[width].append(time.perf_counter() - started)
                target.rollback(state, [length])

    trimmed = attention.seen_blocks
    report = {"title": "Gemma 3 270M reading the grounded-editing prompts: key blocks and norms",
              "machine": machine(), "date": time.strftime("%Y-%m-%d"), "runs": runs, "dtypes": {}}
    for dtype in ("float32", "bfloat16"):
        target = load_model("gemma-3-270m", dtype=dtype)
        norms = [m for m in target.modules() if isinstance(m, GemmaRMSNorm)]
        ops = norms[0].compiled
        ids = prompts("grounded_editing.jsonl", target.tokenizer)
        seconds, logits = {way: [] for way in PREFILL_WAYS}, {}
        forwards = {way: {1: [], 16: []} for way in PREFILL_WAYS}
        for round_ in range(runs + 1):  # the first round warms up
            for way in PREFILL_WAYS[round_ % 3:] + PREFILL_WAYS[:round_ % 3]:
                attention.seen_blocks = trimmed if "seen" in way else (lambda seen: (0, seen.shape[-1]))
                for norm in norms:
                    norm.compiled = ops if "compiled" in way else None
                elapsed, last = 0.0, []
                with torch.inference_mode():
                    for p in ids:
                        started = time.perf_counter()
                        state = prefill(target, [p], len(p) + 32)
                        last.append(target.forward(torch.tensor([p[-1:]]), state)[0, -1])
                        elapsed += time.perf_counter() - started
                        steps(target, state, p, forwards[way] if round_ else {1: [], 16: []})
                seconds[way].append(elapsed)
                logits[way] = last
        attention.seen_blocks = trimmed
        for norm in norms:
            norm.compiled = ops
        median = {way: sorted(v[1:])[len(v[1:]) // 2] for way, v in seconds.items()}
        before = PREFILL_WAYS[0]
        report["prompt_tokens"] = [len(p) for p in ids]
        report["dtypes"][dtype] = {
            "seconds": seconds, "median_seconds": median,
            "speedup": {way: median[before] / median[way] for way in PREFILL_WAYS},
            "forward_ms": {way: {width: 1000 * statistics.median(times) for width, times in forwards[way].items()}
                           for way in PREFILL_WAYS},
            "same_logits": {way: all(torch.equal(a, b) for a, b in zip(logits[before], logits[way]))
                            for way in PREFILL_WAYS},
            "same_next_token": {way: all(bool(a.argmax() == b.argmax()) for a, b in zip(logits[before], logits[way]))
                                for way in PREFILL_WAYS},
            "largest_logit_difference": {way: max(float((a - b).abs().max()) for a, b in zip(logits[before],
                                                                                              logits[way]))
                                         for way in PREFILL_WAYS}}
        print(dtype, json.dumps(report["dtypes"][dtype]["speedup"]), json.dumps(report["dtypes"][dtype]["forward_ms"]),
              flush=True)
    save("prefill-gemma", report)


WIDTHS = (1, 2, 5, 11, 17, 25)


def section_verify_cost(preset="gemma-3-270m", repeats=7):
    """What a verify forward costs by width, float32, bfloat16 and int8: the model after the
    prompt of median length of its workload (Gemma: the grounded prompts; Qwen: its
    section's five), a forward of each width then rolled back (medians of `repeats`); and
    the time to read all the prompts. Where the CPU multiplies bfloat16 natively, wide
    forwards cost little more than one token, which is what long drafts need."""
    from speculative.models.base import prefill

    name = "gemma" if preset.startswith("gemma") else "qwen"
    # One entry per machine: whether a wide forward is cheap depends on the CPU's matrix units.
    report = {"date": time.strftime("%Y-%m-%d"), "dtypes": {}}
    for dtype in ("float32", "bfloat16", "int8"):
        target = load_model(preset, dtype=dtype)
        tokenizer = target.tokenizer
        ids = prompts("grounded_editing.jsonl", tokenizer) if name == "gemma" else qwen.workload(tokenizer)
        context = sorted(ids, key=len)[len(ids) // 2]
        generator = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            reading = []
            for _ in range(2):
                started = time.perf_counter()
                for p in ids:
                    prefill(target, [p], len(p) + 1)
                reading.append(time.perf_counter() - started)
            state = prefill(target, [context], len(context) + max(WIDTHS))
            ms = {}
            for width in WIDTHS:
                times = []
                for _ in range(repeats):
                    tokens = torch.randint(100, 20000, (1, width), generator=generator)
                    started = time.perf_counter()
                    target.forward(tokens, state)
                    times.append(time.perf_counter() - started)
                    target.rollback(state, [len(context)])
                ms[width] = 1000 * sorted(times)[repeats // 2]
        report["context_tokens"] = len(context)
        report["prompts"] = len(ids)
        report["dtypes"][dtype] = {"ms": ms, "reading_seconds": min(reading)}
        print(dtype, {w: f"{t:.1f} ms ({t / ms[1]:.2f}x)" for w, t in ms.items()}, f"reading {min(reading):.2f} s")
        del target, state
    save_per_machine(f"verify-cost-{name}", report, widths=list(WIDTHS),
                     title=f"{preset}: a forward's cost by width after a prompt, and reading the prompts")


def verify_cost_words(report: dict) -> list[str]:
    """One table: a column per machine and dtype, each cell the forward's time and its ratio to one token."""
    columns = [(m, dtype, figures) for m, entry in report["machines"].items()
               for dtype, figures in entry["dtypes"].items()]
    lines = [f"### {report['title']}\n"]
    lines += machine_legend(report["machines"], lambda entry: f"; context {entry['context_tokens']} tokens, medians")
    numbers = {m: n for n, m in enumerate(report["machines"], 1)}
    lines += ["| width | " + " | ".join(f"({numbers[m]}) {dtype}" for m, dtype, _ in columns) + " |",
              "| --- |" + " --- |" * len(columns)]
    for width in report["widths"]:
        cells = [f"{d['ms'][str(width)]:.1f} ms ({d['ms'][str(width)] / d['ms']['1']:.2f}x)" for _, _, d in columns]
        lines.append(f"| {width} | " + " | ".join(cells) + " |")
    prompts_read = next(iter(report["machines"].values())).get("prompts", 6)
    reading = " | ".join(f"{d['reading_seconds']:.2f} s" for _, _, d in columns)
    lines.append(f"| reading the {prompts_read} prompts | {reading} |\n")
    return lines


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


def section_heads():
    """The shipped verifier with its draft head (default-head), against the distilled draft at the
    same K (4 and 8, adaptive up to 8, as in `default`), with and without prompt lookup in
    front; c, alpha per position and tau apart."""
    from speculative.models.loading import load_draft

    target, tokenizer = load_model("default"), load_tokenizer("default")
    # The head as --draft-dtype auto loads it (int8 on CPUs that run it), and in float32.
    head, float_head = load_draft("default-head"), load_model("default-head", dtype="float32")
    draft = load_model("default-draft")
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - 64 - 9)
    drafts = {"head": head, "head+lookup": head, "head float32": float_head, "draft": draft, "draft+lookup": draft}
    report = run_bench(target, drafts, ids, max_new=64, runs=3, ks=(4, 8), eos=None, ngram=False, peers=False,
                       lookup=("head+lookup", "draft+lookup"))
    report["heads"] = head_figures(target, {"head": head, "head float32": float_head, "draft": draft}, ids, 64,
                                   "default-head")
    report["title"] = "Shipped verifier with its draft head (default-head), code completion, greedy, 64 new tokens"
    save("heads", report)


def section_heads_128():
    """default-head on the `default` section's own workload (the same prompts, 128 new tokens,
    K up to 8), beside the shipped draft behind lookup that the issue's 2.33x was measured
    with: longer outputs repeat more of themselves, so lookup drafts more than in `heads`."""
    from speculative.models.loading import load_draft

    target, tokenizer = load_model("default"), load_tokenizer("default")
    head, draft = load_draft("default-head"), load_model("default-draft")
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - 128 - 9)  # as section_default
    report = run_bench(target, {"head": head, "head+lookup": head, "draft+lookup": draft}, ids, max_new=128, runs=3,
                       ks=(4, 8), eos=None, ngram=False, peers=False, lookup=("head+lookup", "draft+lookup"))
    report["title"] = ("Shipped verifier with its draft head (default-head) on the shipped pair's workload (code "
                       "completion, greedy, 128 new tokens)")
    save("heads-128", report)


def section_heads_gemma():
    """Gemma 3 270M with its head (gemma-3-270m-head): free-form chat, then the grounded-editing
    prompts with lookup in front; n-gram drafting beside them."""
    section_heads_gemma_chat()
    section_heads_gemma_grounded()


def section_heads_gemma_chat(dtype="auto"):
    """The first user turns of held-out ShareGPT conversations (the head's training split):
    free-form text, where lookup finds little. Chains of K = 2 and 4 (past the second token
    the head's drafts are rarely kept) and a small tree, top-2 children, 5 nodes, depth 3:
    where a verify forward of 6 tokens costs about one of 1 (float32 on a Zen 4), a second
    guess at each of the first positions is worth more than a fourth position."""
    from speculative import NGramProposer, SpeculativeConfig
    from speculative.entrypoints.bench import plain_method, run_methods, speculative_method
    from speculative.models.loading import load_draft
    from speculative.train.sharegpt import sharegpt_data

    target, head = load_model("gemma-3-270m", dtype=dtype), load_draft("gemma-3-270m-head")  # as --draft-dtype auto
    _, chat = sharegpt_data(target.tokenizer, 1, 10)  # held-out prompts (and one training token)
    shapes = {"head K=2": (head, dict(num_draft_tokens=2, adaptive=False, prompt_lookup=False)),
              "head K=4": (head, dict(num_draft_tokens=4, adaptive=False, prompt_lookup=False)),
              "head adaptive (K<=4)": (head, dict(num_draft_tokens=4, prompt_lookup=False)),
              "head tree top-2 5 nodes": (head, dict(num_draft_tokens=3, tree_top_k=2, tree_max_tokens=5,
                                                     adaptive=False, prompt_lookup=False)),
              "head+lookup K=4": (head, dict(num_draft_tokens=4, adaptive=False, prompt_lookup=True)),
              "head+lookup adaptive (K<=4)": (head, dict(num_draft_tokens=4, prompt_lookup=True)),
              "ngram K=4": (NGramProposer(num_draft_tokens=4), dict(num_draft_tokens=4, adaptive=False)),
              "ngram adaptive (K<=4)": (NGramProposer(num_draft_tokens=4), dict(num_draft_tokens=4))}
    methods = [plain_method("autoregressive", target)]
    methods += [speculative_method(name, target, draft, SpeculativeConfig(**config))
                for name, (draft, config) in shapes.items()]
    report = run_methods(methods, chat, 64, 2)
    report["heads"] = head_figures(target, {"head": head}, chat, 64, "gemma-3-270m-head")
    report["title"] = ("Gemma 3 270M with its draft head (gemma-3-270m-head), free-form chat (held-out ShareGPT "
                       f"first turns), greedy, 64 new tokens, {dtype_words(target)}")
    save("heads-gemma-chat" if dtype == "auto" else f"heads-gemma-chat-{dtype}", report)


def section_heads_gemma_grounded(dtype="auto"):
    """The grounded-editing prompts, the head behind lookup, chains of K = 10 and 24 (the
    trees-gemma section's best) and adaptive up to 24."""
    from speculative.models.loading import load_draft

    target, head = load_model("gemma-3-270m", dtype=dtype), load_draft("gemma-3-270m-head")
    grounded = prompts("grounded_editing.jsonl", target.tokenizer)
    report = run_bench(target, {"head+lookup": head}, grounded, max_new=128, runs=2, ks=(10, 24), eos=None,
                       peers=False, lookup=("head+lookup",))
    report["title"] = ("Gemma 3 270M with its draft head behind prompt lookup, grounded editing, greedy, 128 new "
                       f"tokens, {dtype_words(target)}")
    save("heads-gemma-grounded" if dtype == "auto" else f"heads-gemma-grounded-{dtype}", report)


def head_figures(target, models: dict, ids, max_new: int, head_preset: str) -> dict:
    """Greedy at fixed K = 4 without lookup: alpha, alpha per position and tau of each model;
    c (a head step against a one-token target forward, batch 1); and the head's training."""
    from speculative import SpeculativeConfig, SpeculativeDecoder
    from speculative.policy.costs import measure
    from speculative.models.loading import resolve
    from speculative.models.base import prefill
    from speculative.proposers import HeadProposer

    judged = {}
    for name, model in models.items():
        decoder = SpeculativeDecoder(target, model, SpeculativeConfig(num_draft_tokens=4, adaptive=False,
                                                                      prompt_lookup=False))
        for row in ids:
            decoder.generate(row, max_new)
        stats = decoder.stats
        judged[name] = {"alpha": round(stats.acceptance_rate, 4), "tau": round(stats.tokens_per_forward, 3),
                        "alpha_at": [round(a / d, 4) for a, d in zip(stats.accepted_at, stats.drafted_at)]}
    c = {}  # per head: one drafting step against a one-token target forward, batch 1
    for name in (n for n in models if n.startswith("head")):
        with torch.inference_mode():
            proposer = HeadProposer(models[name], target)
            capacity = len(ids[0]) + 16
            proposer.add_rows(ids[:1], capacity, [None], [None])
            state = prefill(target, ids[:1], capacity)
            ratios = []
            for _ in range(5):
                costs = measure(target, state, ids[:1], proposer, 4)
                ratios.append(costs.draft / costs.v1)
        c[name] = round(sorted(ratios)[len(ratios) // 2], 3)
    trained = json.loads((resolve(head_preset) / "report.json").read_text())
    return {"judged": judged, "c": c.pop("head"), "c_others": c, "int8": models["head"].int8,
            "training": trained["training"],
            "head_parameters": trained["head_parameters"], "unroll": trained["unroll"], "vocab": trained["vocab"],
            "data": trained["data"], "init": trained.get("init"), "total_training": trained.get("total_training")}


# The last landed commit before the step engine: its decoder is the batch-1 baseline.
BEFORE_ENGINE = "3f53885"


def load_git_package(ref: str, name: str):
    """The package as committed at `ref`, imported as `name`: today's code and the code at
    `ref` then run side by side in one process, on the same machine state."""
    root = Path(tempfile.mkdtemp(prefix=f"speculative-{ref}-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src/speculative"], check=True,
                             capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(root)
    package = root / "src" / "speculative"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def section_engine(smoke: bool = False):
    """Continuous batching: the shipped pair with its default draft (lookup + draft model,
    adaptive) against plain continuous batching and static batches; then batch-1 generate
    of this code against the decoder before the engine (BEFORE_ENGINE), in the same process."""
    from speculative import SpeculativeConfig
    from speculative.entrypoints.bench_engine import compare, workload

    count, max_new, sizes, runs = (8, 32, (1, 4), 1) if smoke else (32, 128, (1, 4, 8, 16), 3)
    target, tokenizer, draft = load_model("default"), load_tokenizer("default"), load_model("default-draft")
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - max_new - 9)
    config = SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True)
    report = compare(target, draft, config, workload(ids, count, max_new), sizes, runs)
    report["batch1"] = engine_batch_one(target, draft, ids, max_new, runs)
    report.update(title=("Continuous batching: the shipped pair (lookup + draft model, adaptive, K <= 4), "
                         f"{count} requests of code completion, {max_new} new tokens each"),
                  machine=machine(), date=time.strftime("%Y-%m-%d"), requests=count, max_new_tokens=max_new,
                  runs=runs, smoke=smoke)
    save("engine-smoke" if smoke else "engine", report)


def engine_batch_one(target, draft, ids, max_new: int, runs: int) -> dict:
    """Batch-1 `generate` of this code against the decoder before the engine (BEFORE_ENGINE),
    on the same model objects: what differs is the decoding loop, not the kernels."""
    from speculative import SpeculativeConfig, SpeculativeDecoder
    from speculative.entrypoints.bench_engine import batch_one

    before = load_git_package(BEFORE_ENGINE, "speculative_before")
    old = before.SpeculativeDecoder(target, draft, before.SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True))
    new = SpeculativeDecoder(target, draft, SpeculativeConfig(num_draft_tokens=4, prompt_lookup=True))
    result = batch_one({"before": old, "this": new}, ids, max_new, runs)
    result["before_commit"] = BEFORE_ENGINE
    print(f"  batch 1 generate: this {result['this']['tokens_per_second']:.1f} tok/s, before the engine "
          f"{result['before']['tokens_per_second']:.1f} tok/s: {result['this']['vs_before']:.3f}x")
    return result


def section_engine_batch_one():
    """Only the engine section's batch-1 comparison (two minutes), as results/engine-batch1.json."""
    target, tokenizer, draft = load_model("default"), load_tokenizer("default"), load_model("default-draft")
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - 128 - 9)
    result = engine_batch_one(target, draft, ids, 128, 3)
    result.update(machine=machine(), date=time.strftime("%Y-%m-%d"))
    save("engine-batch1", result)


def section_serve(smoke: bool = False):
    """`speculative serve` under N concurrent openai clients, against the same server without a
    draft (benchmarks/serve_bench.py): the shipped pair on code completion, and Gemma 3 270M
    with n-gram drafts on grounded prompts. Gemma's plain decoding runs ~7.5 tokens/s here, so
    its workload is smaller (16 requests of 64 tokens, one round): about 7 minutes."""
    clients = (1, 4) if smoke else (1, 4, 16)
    threads = torch.get_num_threads()
    tokenizer = load_tokenizer("default")
    # (setting, prompts, requests, new tokens, rounds, peer: a transformers directory and text prompts)
    shipped = (8, 32, 1) if smoke else (32, 128, 3)
    settings = [({"name": f"shipped pair (default-draft+ngram), code completion, {shipped[0]} requests of "
                          f"{shipped[1]} tokens", "target": "default", "draft": "default-draft+ngram"},
                 prompts("code_completion.jsonl", tokenizer, max_tokens=512 - shipped[1] - 9), *shipped, None)]
    if not smoke:
        from speculative.models.presets import directory

        gemma = load_tokenizer("gemma-3-270m")
        texts = [json.loads(line)["prompt"] for line in (HERE / "grounded_editing.jsonl").read_text().splitlines()
                 if line.strip()]
        settings.append(({"name": "Gemma 3 270M (ngram), grounded prompts, 16 requests of 64 tokens",
                          "target": "gemma-3-270m", "draft": "ngram"},
                         prompts("grounded_editing.jsonl", gemma), 16, 64, 1, (str(directory("gemma-3-270m")), texts)))
    report = {"settings": {}, "rounds": {}}
    for setting, ids, requests, max_new, runs, peer in settings:
        report["settings"][setting["name"]] = serve_bench.compare(setting, ids, clients, requests, max_new, runs,
                                                                  threads, peer)
        report["rounds"][setting["name"]] = runs
    report.update(title=(f"speculative serve: greedy streaming requests from N concurrent openai clients, batch up "
                         f"to 16, {threads} torch threads"),
                  machine=machine(), date=time.strftime("%Y-%m-%d"), runs=max(s[4] for s in settings), smoke=smoke,
                  peers=("`transformers serve` (transformers 5.24, `--continuous-batching`, float32, CPU) serves "
                         "Gemma from the same local directory, offline, on the same text prompts; the shipped pair "
                         "is not a transformers model, so it has no peer row."))
    save("serve-smoke" if smoke else "serve", report)


SECTIONS = {"default": section_default, "llama": section_llama, "gemma": section_gemma, "mixed": section_mixed,
            "batch": section_batch, "heads": section_heads, "heads-128": section_heads_128,
            "heads-gemma": section_heads_gemma,
            "heads-gemma-chat": section_heads_gemma_chat, "heads-gemma-grounded": section_heads_gemma_grounded,
            "heads-gemma-chat-float32": lambda: section_heads_gemma_chat("float32"),
            "heads-gemma-grounded-float32": lambda: section_heads_gemma_grounded("float32"),
            "qwen": lambda: qwen.section(save),
            "default-bfloat16": lambda: section_default("bfloat16"),
            "qwen-bfloat16": lambda: save("qwen-bfloat16", qwen.part_bfloat16()),
            "qwen-transformers": lambda: save("qwen-transformers", qwen.part_transformers()),
            "gemma-bfloat16": lambda: section_gemma("bfloat16"),
            "divergence": lambda: qwen.divergence_section(save_per_machine, prompts),
            "engine": section_engine, "engine-smoke": lambda: section_engine(smoke=True),
            "engine-batch1": section_engine_batch_one,
            "serve": section_serve, "serve-smoke": lambda: section_serve(smoke=True),
            "batch-ray": lambda: batch_ray.section(save, prompts),
            "batch-ray-smoke": lambda: batch_ray.section(save, prompts, smoke=True),
            "trees": lambda: trees.section(save, prompts), "trees-smoke": lambda: trees.section(save, prompts, True),
            "trees-gemma": lambda: trees.gemma_section(save, prompts),
            "trees-gemma-float32": lambda: trees.gemma_section(save, prompts, "float32"),
            "prefill-gemma": section_prefill_gemma, "verify-cost-gemma": section_verify_cost,
            "verify-cost-qwen": lambda: section_verify_cost("qwen2.5-coder-1.5b"),
            "trees-models": lambda: trees.models_section(save, prompts),
            "trees-tau": lambda: trees.tau_section(save),
            "llama-cpp": lambda: vs_llama_cpp.qwen_section(save_per_machine, qwen_workloads),
            "llama-cpp-gemma": lambda: vs_llama_cpp.gemma_section(save_per_machine, gemma_workloads),
            "structured": lambda: structured.section(save_per_machine),
            "structured-smoke": lambda: structured.section(save_per_machine, runs=1, limit=2),
            "int8-quality": lambda: quality.section(save_per_machine),
            "lookup-transformers": lambda: lookup_vs_transformers.section(save_per_machine)}
TABLES = ("default", "default-bfloat16", "heads", "heads-128", "heads-gemma-chat", "heads-gemma-chat-float32",
          "heads-gemma-grounded",
          "heads-gemma-grounded-float32", "mixed", "llama", "gemma", "gemma-bfloat16", "qwen",
          "qwen-transformers", "qwen-bfloat16", "trees-gemma", "trees-gemma-float32", "trees-models")


def heads_words(heads: dict) -> str:
    """The head section's figures beside its table: judged acceptance, c, training."""
    judged, training = heads["judged"], heads["training"]
    rows = "; ".join(f"{name}: alpha {j['alpha']:.3f}, tau {j['tau']:.2f}, alpha per position "
                     f"{', '.join(f'{a:.2f}' for a in j['alpha_at'])}" for name, j in judged.items())
    vocab = f", a reduced vocabulary of {heads['vocab']:,} tokens" if heads.get("vocab") else ""
    others = "".join(f" ({name}: {c:.3f})" for name, c in heads.get("c_others", {}).items())
    return (f"Greedy, fixed K = 4, no lookup: {rows}. The head's cost per drafted token c = {heads['c']:.3f}"
            f"{' in int8' if heads.get('int8') else ''}{others} of a one-token target forward. "
            f"Head: {heads['head_parameters']:,} weights of its own (the target's embedding and output layer are "
            f"borrowed), trained {training['seconds'] / 60:.0f} min"
            f"{' more (continuing ' + heads['init'] + ')' if heads.get('init') else ''} on "
            f"{training['tokens']:,} tokens of {heads['data']} ({training['steps']} steps, "
            f"unroll {heads['unroll']}{vocab}){total_words(heads.get('total_training'))}.\n")


def total_words(total: dict | None) -> str:
    """A head trained in several runs: all of its training."""
    if not total:
        return ""
    return f"; {total['seconds'] / 60:.0f} min on {total['tokens']:,} tokens in all ({total['steps']} steps)"


def render() -> str:
    """Markdown for every result file present."""
    parts = [f"_Generated by `python benchmarks/run.py` on {time.strftime('%Y-%m-%d')}; each table names the machine "
             f"it ran on (this one: {machine()})._\n"]
    for name in TABLES:
        path = RESULTS / f"{name}.json"
        if path.is_file():
            report = json.loads(path.read_text())
            parts.append(f"### {report.get('title', name)}\n\n```\n{table(report).rstrip()}\n```\n")
            if "heads" in report:
                parts.append(heads_words(report["heads"]))
            if name.startswith("trees-"):
                parts.append(depth_words(report))
            if (RESULTS / f"{name}.png").is_file():
                parts.append(f"![{name}]({name}.png)\n")
    path = RESULTS / "divergence.json"
    if path.is_file():
        parts.append("### Greedy divergence: speculative against autoregressive output of the same model and dtype\n")
        machines = json.loads(path.read_text())["machines"]
        parts += machine_legend(machines)
        parts.append("| machine | model, dtype | prompts | tokens | outputs that differ | first differences at | "
                     "all near-ties |")
        parts.append("| --- | --- | --- | --- | --- | --- | --- |")
        for number, entry in enumerate(machines.values(), 1):
            for name, row in entry.items():
                if isinstance(row, dict):
                    where = ", ".join(str(d["position"]) for d in row["divergences"]) or "-"
                    parts.append(f"| ({number}) | {name} | {row['prompts']} | {row['tokens']} | {row['diverged']} | "
                                 f"{where} | {'yes' if row['all_near_ties'] else 'NO'} |")
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
    path = RESULTS / "prefill-gemma.json"
    if path.is_file():
        p = json.loads(path.read_text())
        tokens = p["prompt_tokens"]
        parts.append(f"### {p['title']}\n\n{p['machine']}, {p['date']}: {len(tokens)} prompts of {min(tokens):,}-"
                     f"{max(tokens):,} tokens read one by one, medians of {p['runs']} interleaved rounds; logits "
                     f"after each prompt compared with the whole span's.\n")
        parts.append("| dtype | way | prompts (s) | speedup | forward of 1 / 16 tokens after (ms) | the same logits "
                     "| the same next token |")
        parts.append("| --- | --- | --- | --- | --- | --- | --- |")
        for dtype, entry in p["dtypes"].items():
            for way, secs in entry["median_seconds"].items():
                same = "bit for bit" if entry["same_logits"][way] else \
                    f"no (largest difference {entry['largest_logit_difference'][way]:.1e})"
                step = entry["forward_ms"][way]
                parts.append(f"| {dtype} | {way} | {secs:.2f} | {entry['speedup'][way]:.2f}x | {step['1']:.1f} / "
                             f"{step['16']:.1f} | {same} | {'yes' if entry['same_next_token'][way] else 'NO'} |")
        parts.append("")
    for name in ("verify-cost-gemma", "verify-cost-qwen"):
        path = RESULTS / f"{name}.json"
        if path.is_file():
            parts += verify_cost_words(json.loads(path.read_text()))
    for name in ("llama-cpp", "llama-cpp-gemma"):
        path = RESULTS / f"{name}.json"
        if path.is_file():
            parts += vs_llama_cpp.render(json.loads(path.read_text()), machine_legend)
    path = RESULTS / "int8-quality.json"
    if path.is_file():
        parts += quality.render(json.loads(path.read_text()), machine_legend)
    path = RESULTS / "trees.json"
    if path.is_file():
        parts += render_trees(json.loads(path.read_text()))
    path = RESULTS / "trees-tau.json"
    if path.is_file():
        parts += trees.render_tau(json.loads(path.read_text()))
    path = RESULTS / "engine.json"
    if path.is_file():
        parts += render_engine(json.loads(path.read_text()))
    path = RESULTS / "serve.json"
    if path.is_file():
        parts += serve_bench.render(json.loads(path.read_text()))
    path = RESULTS / "batch-ray.json"
    if path.is_file():
        parts += batch_ray.render(json.loads(path.read_text()))
    return "\n".join(parts)


def depth_words(report: dict) -> str:
    return "Acceptance per depth (kept / drafted at that depth): " + "; ".join(
        f"{m['name']}: {', '.join(f'{a:.2f}' for a in m['acceptance_per_depth'])}"
        for m in report["methods"] if m.get("acceptance_per_depth")) + "\n"


def render_trees(report: dict) -> list[str]:
    lookup = report["lookup"]
    parts = [f"### {lookup['title']}\n", f"```\n{table(lookup).rstrip()}\n```\n",
             depth_words(lookup),
             f"### Repeated tasks: {report['prompts']} prompts twice through one engine per method (batch 1, greedy, "
             f"{report['max_new_tokens']} new tokens; trees of {report['nodes']} nodes, depth {report['depth']}, "
             f"top-{report['top_k']})\n",
             "| pass | method | tokens/s | speedup | median prompt speedup | tau | identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in report["repeated"].items():
        if name.startswith("pass"):
            for method, row in rows.items():
                parts.append(f"| {name} | {method} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f}x | "
                             f"{row['median_prompt_speedup']:.2f}x | {row['tau']:.2f} | "
                             f"{'yes' if row['identical'] else 'NO'} |")
    parts.append("")
    return parts


def render_engine(report: dict) -> list[str]:
    parts = [f"### {report['title']}\n",
             "Total tokens/s (speedup over plain continuous batching), time to first token p50 and latency "
             "p50 / p99 in seconds, medians of "
             f"{report['runs']} rounds. `engine`: continuous batching with the default draft; `plain`: the same "
             "engine without a draft; `static`: SpeculativeDecoder.generate on fixed batches in arrival order.\n"]
    for name, label in (("queued", "all requests queued at once"),
                        ("spread", "arrivals spread at random over 75% of the time plain batching takes")):
        parts += [f"{label.capitalize()}:\n",
                  "| batch | engine tok/s | plain tok/s | static tok/s | engine TTFT | plain TTFT | static TTFT "
                  "| engine latency p50 / p99 | plain latency p50 / p99 | static latency p50 / p99 | identical |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for size, entry in report[name].items():
            e, p, s = entry["engine"], entry["plain"], entry["static"]
            ok = all(x["identical"] for x in (e, p, s))
            cells = [f"{e['tokens_per_second']:.1f} ({e['vs_plain']:.2f}x)", f"{p['tokens_per_second']:.1f}",
                     f"{s['tokens_per_second']:.1f} ({s['vs_plain']:.2f}x)"]
            cells += [f"{x['ttft_p50']:.2f}" for x in (e, p, s)]
            cells += [f"{x['latency_p50']:.2f} / {x['latency_p99']:.2f}" for x in (e, p, s)]
            parts.append(f"| {size} | " + " | ".join(cells) + f" | {'yes' if ok else 'NO'} |")
        parts.append("")
    runs = [("in this run", report["batch1"])]
    path = RESULTS / "engine-batch1.json"
    if path.is_file():  # `run.py engine-batch1`: the same comparison alone
        alone = json.loads(path.read_text())
        runs.append((f"run alone on {alone['date']} (`run.py engine-batch1`)", alone))
    for when, one in runs:
        parts.append(f"Batch-1 `generate`, this code against the decoder before the engine (commit "
                     f"{one['before_commit']}, loaded from git into the same process, same models, prompts in turn), "
                     f"{when}: {one['this']['tokens_per_second']:.1f} against "
                     f"{one['before']['tokens_per_second']:.1f} tokens/s, {one['this']['vs_before']:.3f}x; identical "
                     f"outputs: {'yes' if one['this']['identical'] else 'NO'}.\n")
    return parts


def update_markdown() -> None:
    path = RESULTS / "TABLES.md"
    text = path.read_text()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    path.write_text(f"{head}{start}\n{render()}\n{end}{tail}")


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("SPECULATIVE_BENCH_THREADS", min(2, torch.get_num_threads()))))
    RESULTS.mkdir(exist_ok=True)
    parts = ("heads-gemma-chat", "heads-gemma-grounded", "qwen-transformers")  # also run by heads-gemma, qwen
    chosen = sys.argv[1:] or [name for name in SECTIONS if not name.endswith("-smoke") and name not in parts]
    unknown = [c for c in chosen if c not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    for name in chosen:
        print(f"== {name}")
        SECTIONS[name]()
    if all(name.endswith("-smoke") for name in chosen):
        print("smoke run: results/TABLES.md left as it is")
    else:
        update_markdown()
        print("results/TABLES.md updated")
