"""Token trees (issue 15): trees against chains of the same verify width, and plain decoding.

Two parts, on the shipped pair's verifier (fast here; no Gemma download needed), and a
third, `trees-gemma`, on Gemma 3 270M:

- `lookup`: code completion with n-gram drafts: a chain of K = 8, a chain of K = 16 (the
  trees' verify width), and n-gram trees of 16 nodes, depth 8, top-3 children (run_bench:
  interleaved rounds, medians, identical outputs).
- `repeated`: a repeated-task workload: the same prompts twice, one after another, through
  one long-lived engine per method (batch 1): plain decoding, n-gram trees, and suffix-cache
  trees (lookup in the row plus the engine's earlier outputs). Every prompt is run by every
  method in turn (interleaved), passes timed apart; speed-ups are per pass, against plain
  decoding in the same pass. tau = tokens per target forward; alpha per depth = kept /
  drafted at that depth.
- `trees-gemma`: Gemma 3 270M on the grounded-editing prompts (the `gemma` section's
  workload, 128 new tokens): n-gram chains of K = 10 (fixed and adaptive, the `gemma`
  section's best), a chain of the trees' verify width, and n-gram trees of GEMMA_NODES nodes
  (fixed, and with the node budget planned by the adaptive policy).
- `trees-models`: model trees (EAGLE-2 expansion) on the shipped verifier, held-out code
  completion (the `heads` section's workload): the distilled draft and the draft head, alone
  and behind lookup trees, each as a chain of K = 4, a chain of the trees' verify width
  (K = MODEL_NODES), a tree of MODEL_NODES nodes (depth MODEL_DEPTH, top-MODEL_TOP_K), and
  trees whose node budget (up to MODEL_NODES) the adaptive policy plans each step.
- `trees-tau`: the issue's tau goal on more prompts than `trees-models` times: the
  distilled draft's trees (top-MODEL_TOP_K) against its chains of the same verify width, on
  the first TAU_PROMPTS held-out function prompts (the first 10 are `trees-models`'). tau is
  deterministic under greedy decoding, so nothing is timed; the ratio's interval comes from
  resampling the prompts.
"""

import random
import statistics
import time

from speculative import Engine, NGramProposer, SamplingParams, SpeculativeConfig, SuffixProposer, load_model, \
    load_tokenizer
from speculative.entrypoints.bench import plain_method, run_bench, run_methods, speculative_method
from speculative.models.loading import load_draft

MAX_NEW = 96
NODES, DEPTH, TOP_K = 16, 8, 3
GEMMA_NODES, GEMMA_DEPTH = 24, 10
MODEL_NODES, MODEL_DEPTH, MODEL_TOP_K, MODEL_NEW = 16, 6, 4, 64
# trees-tau: prompts, and (verify width, tree depth) pairs; 16 nodes at depth 6 is trees-models' tree.
TAU_PROMPTS, TAU_WIDTHS = 40, ((8, 6), (16, MODEL_DEPTH), (24, 8), (32, 8))


def engine_pass(engine, prompts):
    """(seconds per prompt, outputs) of each prompt run alone through `engine`."""
    seconds, outputs = [], []
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        started, tokens = time.perf_counter(), []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        seconds.append(time.perf_counter() - started)
        outputs.append(tokens)
    return seconds, outputs


def repeated(target, prompts, passes=2) -> dict:
    tree = SpeculativeConfig(num_draft_tokens=DEPTH, tree_top_k=TOP_K, tree_max_tokens=NODES, adaptive=False,
                             prompt_lookup=False)
    engines = {"plain": Engine(target, None, max_batch_size=1),
               f"ngram tree top-{TOP_K} {NODES} nodes": Engine(target, NGramProposer(num_draft_tokens=DEPTH), tree, 1),
               f"suffix tree top-{TOP_K} {NODES} nodes": Engine(target, SuffixProposer(num_draft_tokens=DEPTH), tree, 1)}
    warm = Engine(target, NGramProposer(num_draft_tokens=DEPTH), tree, 1)
    engine_pass(warm, prompts[:1])  # warm-up on a separate engine: the suffix caches stay empty
    report = {}
    for number in range(1, passes + 1):
        seconds = {name: [] for name in engines}
        outputs = {name: [] for name in engines}
        before = {name: (e.stats.generated, e.stats.target_forwards) for name, e in engines.items()}
        for prompt in prompts:  # every method on a prompt in turn: drift hits all alike
            for name, engine in engines.items():
                s, out = engine_pass(engine, [prompt])
                seconds[name] += s
                outputs[name] += out
        plain_speed = sum(map(len, outputs["plain"])) / sum(seconds["plain"])
        rows = {}
        for name, engine in engines.items():
            generated = engine.stats.generated - before[name][0]
            forwards = engine.stats.target_forwards - before[name][1]
            speed = sum(map(len, outputs[name])) / sum(seconds[name])
            rows[name] = {"tokens_per_second": round(speed, 2), "speedup": round(speed / plain_speed, 3),
                          "median_prompt_speedup": round(statistics.median(
                              (len(o) / s) / (len(po) / ps) for o, s, po, ps in
                              zip(outputs[name], seconds[name], outputs["plain"], seconds["plain"])), 3),
                          "tau": round(generated / forwards, 3) if forwards else None,
                          "identical": outputs[name] == outputs["plain"]}
        report[f"pass {number}"] = rows
        print(f"  pass {number}: " + ", ".join(f"{n} {r['speedup']:.2f}x (tau {r['tau']})" for n, r in rows.items()))
    for name, engine in engines.items():
        stats = engine.stats
        report.setdefault("alpha_per_depth", {})[name] = [round(a / d, 3) for a, d in
                                                          zip(stats.accepted_at, stats.drafted_at) if d]
    return report


def section(save, prompts, smoke: bool = False):
    target, tokenizer = load_model("default"), load_tokenizer("default")
    ids = prompts("code_completion.jsonl", tokenizer, limit=3 if smoke else 6, max_tokens=512 - MAX_NEW - NODES - 2)
    lookup = run_bench(target, {}, ids, max_new=MAX_NEW, runs=1 if smoke else 2, ks=(DEPTH,), eos=None,
                       adaptive=False, peers=False, tree=(TOP_K, NODES))
    lookup["title"] = (f"Token trees on the shipped verifier, code completion (greedy, {MAX_NEW} new tokens): "
                       f"n-gram trees ({NODES} nodes, depth {DEPTH}, top-{TOP_K}) against chains")
    report = {"lookup": lookup, "repeated": repeated(target, ids), "prompts": len(ids), "max_new_tokens": MAX_NEW,
              "nodes": NODES, "depth": DEPTH, "top_k": TOP_K}
    save("trees-smoke" if smoke else "trees", report)
    return report


def gemma_section(save, prompts, dtype: str = "auto") -> dict:
    from speculative.models.precision import model_dtype

    target = load_model("gemma-3-270m", dtype=dtype)
    ids = prompts("grounded_editing.jsonl", target.tokenizer)
    report = run_bench(target, {}, ids, max_new=128, runs=2, ks=(GEMMA_DEPTH,), eos=None, peers=False,
                       tree=(TOP_K, GEMMA_NODES))
    dtype_name = str(model_dtype(target)).removeprefix("torch.")
    report["title"] = (f"Token trees on Gemma 3 270M, input-grounded prompts (greedy, 128 new tokens): n-gram trees "
                       f"({GEMMA_NODES} nodes, depth {GEMMA_DEPTH}, top-{TOP_K}) against chains, {dtype_name}")
    save("trees-gemma" if dtype == "auto" else f"trees-gemma-{dtype}", report)
    return report


def models_section(save, prompts) -> dict:
    target, tokenizer = load_model("default"), load_tokenizer("default")
    ids = prompts("code_completion.jsonl", tokenizer, max_tokens=512 - MODEL_NEW - MODEL_NODES * MODEL_TOP_K)
    methods = [plain_method("autoregressive", target)]
    for name in ("draft", "head"):
        model = load_draft(f"default-{name}")  # as --draft-dtype auto: the head in int8 on CPUs
        for lookup in (False, True):
            label = name + ("+lookup" if lookup else "")
            tree = dict(num_draft_tokens=MODEL_DEPTH, tree_top_k=MODEL_TOP_K, tree_max_tokens=MODEL_NODES)
            shapes = {f"{label} K=4": dict(num_draft_tokens=4, adaptive=False),
                      f"{label} chain K={MODEL_NODES}": dict(num_draft_tokens=MODEL_NODES, adaptive=False),
                      f"{label} tree top-{MODEL_TOP_K} {MODEL_NODES} nodes": dict(tree, adaptive=False),
                      f"{label} tree top-{MODEL_TOP_K} adaptive (<={MODEL_NODES} nodes)": dict(tree, adaptive=True)}
            for method, shape in shapes.items():
                config = SpeculativeConfig(prompt_lookup=lookup, **shape)
                methods.append(speculative_method(method, target, model, config))
    report = run_methods(methods, ids, MODEL_NEW, 2)
    report["title"] = (f"Model trees (EAGLE-2 expansion) on the shipped verifier, held-out code completion (greedy, "
                       f"{MODEL_NEW} new tokens): trees of {MODEL_NODES} nodes (depth {MODEL_DEPTH}, "
                       f"top-{MODEL_TOP_K}) against chains of K = 4 and of the same verify width")
    save("trees-models", report)
    return report


def render_tau(report: dict) -> list[str]:
    parts = [f"### {report['title']}\n", "| verify width | tree depth | chain tau | tree tau | ratio | 90% interval "
             "(prompts resampled) | ratio on the first 10 | identical |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for w in report["widths"]:
        low, high = w["interval_90"]
        parts.append(f"| {w['width']} | {w['depth']} | {w['chain_tau']:.2f} | {w['tree_tau']:.2f} | "
                     f"**{w['ratio']:.2f}x** | {low:.2f}-{high:.2f}x | {w['ratio_first_10']:.2f}x | "
                     f"{'yes' if w['identical'] else 'NO'} |")
    return parts + [""]


def tau_section(save) -> dict:
    """tau (tokens per target forward) of the distilled draft's trees against its chains of
    the same verify width, every output checked against plain decoding; the ratio pools
    tokens and forwards over the prompts, its 90% interval from 2,000 resamplings of them."""
    from speculative import SpeculativeDecoder, autoregressive_generate
    from speculative.train.corpus import function_prompts, split_files

    target, tokenizer = load_model("default"), load_tokenizer("default")
    draft = load_draft("default-draft")
    keep = 512 - MODEL_NEW - MODEL_NODES * MODEL_TOP_K  # as trees-models cuts its prompts
    ids = [tokenizer.encode(text)[-keep:] for text in function_prompts(split_files()[1], TAU_PROMPTS)]
    expected = [autoregressive_generate(target, p, MODEL_NEW) for p in ids]

    def counts(config: SpeculativeConfig) -> tuple[list[tuple[int, int]], bool]:
        """(tokens, target forwards) per prompt, and whether every output matched."""
        decoder, rows, identical = SpeculativeDecoder(target, draft, config), [], True
        for p, want in zip(ids, expected):
            decoder.reset_stats()
            identical &= decoder.generate(p, MODEL_NEW) == want
            rows.append((decoder.stats.generated, decoder.stats.target_forwards))
        return rows, identical

    def tau(rows, picks) -> float:
        return sum(rows[i][0] for i in picks) / sum(rows[i][1] for i in picks)

    draw = random.Random(0)
    resamples = [[draw.randrange(len(ids)) for _ in ids] for _ in range(2000)]
    widths = []
    for width, depth in TAU_WIDTHS:
        chain, chain_same = counts(SpeculativeConfig(num_draft_tokens=width, adaptive=False, prompt_lookup=False))
        tree, tree_same = counts(SpeculativeConfig(num_draft_tokens=depth, tree_top_k=MODEL_TOP_K,
                                                   tree_max_tokens=width, adaptive=False, prompt_lookup=False))
        every, first = range(len(ids)), range(10)
        ratios = sorted(tau(tree, picks) / tau(chain, picks) for picks in resamples)
        row = {"width": width, "depth": depth, "chain_tau": round(tau(chain, every), 3),
               "tree_tau": round(tau(tree, every), 3), "ratio": round(tau(tree, every) / tau(chain, every), 3),
               "interval_90": [round(ratios[100], 3), round(ratios[1899], 3)],
               "ratio_first_10": round(tau(tree, first) / tau(chain, first), 3), "identical": chain_same and tree_same}
        widths.append(row)
        print(f"  width {width}: chain tau {row['chain_tau']}, tree tau {row['tree_tau']}, ratio {row['ratio']} "
              f"(90%: {row['interval_90']}), first 10 prompts {row['ratio_first_10']}", flush=True)
    report = {"prompts": len(ids), "max_new_tokens": MODEL_NEW, "top_k": MODEL_TOP_K, "widths": widths,
              "title": f"Model trees' tau against chains of the same verify width: the shipped pair (distilled "
                       f"draft, top-{MODEL_TOP_K} EAGLE-2 trees), greedy, {MODEL_NEW} new tokens, the first "
                       f"{len(ids)} held-out function prompts"}
    save("trees-tau", report)
    return report
