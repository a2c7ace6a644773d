"""`speculative bench`: every method on the same models, prompts and settings, in one process.

Methods: plain autoregressive decoding (the baseline), speculative decoding with each
draft at each fixed K and with adaptive K, n-gram drafting, and, when the models are
transformers models, transformers' own assisted generation and prompt lookup. Each method
is warmed up, then timed over `runs` rounds, each prompt by prompt with every method in
turn; speedups are medians over rounds of same-round ratios to the baseline, and every
greedy output is compared with the autoregressive one, token for token.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from .config import SpeculativeConfig, integer
from .decoder import SpeculativeDecoder, autoregressive_generate
from .models.hf import HFModel
from .proposers.ngram import NGramProposer


class PeakMemory:
    """Peak resident memory of this process while the block runs (sampled every 2 ms)."""

    def __init__(self):
        self.peak = self.before = rss_bytes()
        self._stop = threading.Event()

    def __enter__(self):
        self.before = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Result:
    name: str
    draft: str | None = None
    k: int | None = None
    adaptive: bool = False
    tokens_per_second: float = 0.0
    run_tokens_per_second: list[float] = field(default_factory=list)
    speedup: float | None = None
    prompt_speedups: list[float] = field(default_factory=list)
    median_prompt_speedup: float | None = None
    acceptance_rate: float | None = None
    conditional_acceptance: float | None = None
    tokens_per_forward: float | None = None
    draft_share: float | None = None
    verify_share: float | None = None
    overhead_share: float | None = None
    predicted_speedup: float | None = None
    peak_rss_mb: float = 0.0
    peak_rss_delta_mb: float = 0.0
    identical: bool | None = None
    identical_prompts: int | None = None  # prompts whose output equals the reference's
    generated_tokens: int = 0
    # Per depth d (1, 2, ...): kept / drafted at that depth (trees: rows whose tree reached it).
    acceptance_per_depth: list[float] = field(default_factory=list)


def predicted_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Leviathan et al.: (1 - alpha^(K+1)) / ((1 - alpha)(K c + v))."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + v)


@dataclass
class Method:
    """One way of generating: a function of (prompt ids, max new tokens, eos) -> new tokens."""

    result: Result
    run: object
    decoder: SpeculativeDecoder | None = None
    # The method whose outputs these must equal (None: the baseline, the first method).
    reference: "Method | None" = None
    # False for a method whose output is not expected to equal any other (another dtype).
    compare: bool = True
    outputs: list = field(default_factory=list)
    prompt_speeds: list = field(default_factory=list)
    peak: int = 0
    before: int = 0


def timed(method: Method, ids, max_new, eos) -> float:
    """Generate for one prompt; keeps the output and the peak memory, returns the seconds."""
    with PeakMemory() as memory:
        started = time.perf_counter()
        method.outputs.append(method.run(ids, max_new, eos))
        seconds = time.perf_counter() - started
    method.peak = max(method.peak, memory.peak)
    method.before = method.before or memory.before
    return seconds


def run_bench(target, drafts: dict, prompts: list[list[int]], max_new: int = 64, runs: int = 3,
              ks: tuple[int, ...] = (1, 2, 4, 8), eos=None, ngram: bool = True, adaptive: bool = True,
              peers: bool = True, lookup: tuple[str, ...] = (), log=print, draft_vocab=None,
              tree: tuple[int, int] | None = None, progress: bool = False) -> dict:
    """Benchmark every method; returns a JSON-able dict with one entry per method.

    `drafts` maps names to draft models; the names in `lookup` draft with prompt lookup
    first (SpeculativeConfig.prompt_lookup); `draft_vocab` is the reduced vocabulary of
    every draft model (None: all tokens). `tree` = (top_k, nodes) adds trees of that many nodes
    (depth max(ks)) for n-gram lookup and every draft, their chains of the same verify width
    (K = nodes), and (with `adaptive`) trees whose node budget the adaptive policy plans. (A
    suffix cache needs one engine across prompts: benchmarks/trees.py.) After a warm-up of
    every method, each of the `runs` rounds goes prompt by prompt and runs the baseline and
    every method on it (each prompt starting the turn at the next method, so that none
    always runs first), so that a machine whose speed drifts slows all methods alike. A
    method's speedup is the median over rounds of its speed (all prompts) over the
    baseline's in the same round; per prompt, the median over rounds of the same ratio for
    that prompt alone. `peers`: transformers' own methods, which need a target loaded through
    transformers (otherwise `log` says they are left out). `progress`: see run_methods.
    """
    check_settings(prompts, max_new, runs, ks)
    methods = [Method(Result("autoregressive"), lambda ids, n, e: autoregressive_generate(target, ids, n,
                                                                                            eos_token_id=e))]

    def speculative(name, draft, draft_name, k, is_adaptive, **trees):
        config = SpeculativeConfig(num_draft_tokens=k, adaptive=is_adaptive, prompt_lookup=draft_name in lookup,
                                   **trees)
        vocab = None if hasattr(draft, "propose") else draft_vocab
        decoder = SpeculativeDecoder(target, draft, config, draft_vocab=vocab)
        methods.append(Method(Result(name, draft=draft_name, k=k, adaptive=is_adaptive),
                              lambda ids, n, e: decoder.generate(ids, n, e), decoder))

    for draft_name, draft in drafts.items():
        for k in ks:
            speculative(f"{draft_name} K={k}", draft, draft_name, k, False)
        if adaptive:
            speculative(f"{draft_name} adaptive (K<={max(ks)})", draft, draft_name, max(ks), True)
    if ngram:
        for k in sorted({min(ks), max(ks)}):
            speculative(f"ngram K={k}", NGramProposer(num_draft_tokens=k), "ngram", k, False)
        if adaptive:
            speculative(f"ngram adaptive (K<={max(ks)})", NGramProposer(num_draft_tokens=max(ks)), "ngram", max(ks),
                        True)
    if tree is not None:
        top_k, nodes = tree
        shape = dict(tree_top_k=top_k, tree_max_tokens=nodes)
        sources = {"ngram": lambda: NGramProposer(num_draft_tokens=max(ks)),
                   **{name: lambda draft=draft: draft for name, draft in drafts.items()}}
        for name, draft in sources.items():
            chain = NGramProposer(num_draft_tokens=nodes) if name == "ngram" else draft()
            speculative(f"{name} chain K={nodes}", chain, name, nodes, False)
            speculative(f"{name} tree top-{top_k} {nodes} nodes", draft(), name, max(ks), False, **shape)
            if adaptive:
                speculative(f"{name} tree top-{top_k} adaptive (<={nodes} nodes)", draft(), name, max(ks), True,
                            **shape)
    if peers and isinstance(target, HFModel):
        for name, kwargs in hf_methods(drafts, max(ks)):
            methods.append(Method(Result(name, draft=kwargs.get("draft_name")), hf_generate(target, kwargs)))
    elif peers:
        import importlib.util

        why = ("transformers is not installed (pip install 'speculative[hf]')"
               if importlib.util.find_spec("transformers") is None else
               f"they run only on a target loaded through transformers, not on a {type(target).__name__}")
        log(f"transformers' own methods (prompt lookup, assisted generation) left out: {why}")
    return run_methods(methods, prompts, max_new, runs, eos, log, progress)


def speculative_method(name: str, target, draft, config: SpeculativeConfig, draft_vocab=None,
                       reference: Method | None = None) -> Method:
    """One speculative configuration as a method of the benchmark."""
    decoder = SpeculativeDecoder(target, draft, config, draft_vocab=draft_vocab)
    draft_name = "ngram" if isinstance(draft, NGramProposer) else name.split(" ")[0]
    return Method(Result(name, draft=draft_name, k=config.num_draft_tokens, adaptive=config.adaptive),
                  lambda ids, n, e: decoder.generate(ids, n, e), decoder, reference)


def plain_method(name: str, model, reference: Method | None = None) -> Method:
    """Our autoregressive decoding of `model` as a method of the benchmark."""
    return Method(Result(name), lambda ids, n, e: autoregressive_generate(model, ids, n, eos_token_id=e),
                  reference=reference)


def run_methods(methods: list[Method], prompts: list[list[int]], max_new: int, runs: int, eos=None,
                log=print, progress: bool = False) -> dict:
    """Time the methods, the first being the baseline: warm-up, then `runs` interleaved
    rounds (see run_bench); a JSON-able report with one entry per method. `progress`: a bar
    on stderr per generation (round, prompt, method), with the estimated time left."""
    from tqdm import tqdm

    def say(line):  # log lines above the bar, never through it
        with tqdm.external_write_mode():
            log(line)

    say(f"{len(methods)} methods, {len(prompts)} prompts, {max_new} new tokens, {runs} rounds")
    per_token = warm_up(methods, prompts[0], min(8, max_new), eos, progress)
    generations = runs * len(prompts) * len(methods)
    say(f"{generations} generations of {max_new} tokens: about {generations * max_new * per_token / 60:.1f} min if "
        "every method ran at plain decoding's warm-up speed (faster methods take less)")
    bar = tqdm(total=generations, desc="timed", unit="gen", file=sys.stderr, disable=not progress, leave=False)
    speeds = {id(m): [] for m in methods}
    ratios = {id(m): [] for m in methods}
    for round_number in range(runs):  # prompt by prompt, every method in turn: drift hits all alike
        seconds = {id(m): [] for m in methods}
        for method in methods:
            method.outputs = []
        for index, ids in enumerate(prompts):
            # Each prompt starts the turn at another method: a method's place in the turn
            # changes its speed by a few percent (measured: the third of three identical
            # decoders 1-5% slower than the first in each of 3 rounds), shared out evenly so.
            start = (round_number * len(prompts) + index) % len(methods)
            for method in methods[start:] + methods[:start]:
                bar.set_postfix_str(f"round {round_number + 1}/{runs}, prompt {index + 1}/{len(prompts)}, "
                                    f"{method.result.name}", refresh=False)
                seconds[id(method)].append(timed(method, ids, max_new, eos))
                bar.update()
        for method in methods:
            lengths = list(map(len, method.outputs))
            speeds[id(method)].append(sum(lengths) / sum(seconds[id(method)]))
            ratios[id(method)].append(speeds[id(method)][-1] / speeds[id(methods[0])][-1])
            method.prompt_speeds.append([n / t for n, t in zip(lengths, seconds[id(method)])])
        say(f"  round {round_number + 1}: " + ", ".join(f"{m.result.name} {ratios[id(m)][-1]:.2f}x"
                                                        for m in methods[1:]))
    bar.close()
    baseline = statistics.median(speeds[id(methods[0])])
    for method in methods:
        result = method.result
        result.run_tokens_per_second = [round(v, 2) for v in speeds[id(method)]]
        result.tokens_per_second = statistics.median(speeds[id(method)])
        result.speedup = statistics.median(ratios[id(method)])
        result.prompt_speedups = [  # per prompt: the median over rounds of its same-round ratio
            round(statistics.median(mine[i] / base[i] for mine, base in zip(method.prompt_speeds,
                                                                              methods[0].prompt_speeds)), 3)
            for i in range(len(prompts))]
        result.median_prompt_speedup = statistics.median(result.prompt_speedups)
        if method.compare:
            reference = (method.reference or methods[0]).outputs
            result.identical = method.outputs == reference
            result.identical_prompts = sum(a == b for a, b in zip(method.outputs, reference))
        result.peak_rss_mb = method.peak / 2 ** 20
        result.peak_rss_delta_mb = (method.peak - method.before) / 2 ** 20
        result.generated_tokens = sum(map(len, method.outputs))
        stats = method.decoder.stats if method.decoder is not None else None
        if stats is not None and stats.total_seconds > 0:
            result.acceptance_rate = stats.acceptance_rate
            result.conditional_acceptance = stats.conditional_acceptance
            result.tokens_per_forward = stats.tokens_per_forward
            result.acceptance_per_depth = [round(a / d, 3) for a, d in zip(stats.accepted_at, stats.drafted_at) if d]
            decode = stats.total_seconds - stats.prefill_seconds
            result.draft_share = stats.draft_forward_seconds / decode
            result.verify_share = stats.target_forward_seconds / decode
            result.overhead_share = stats.overhead_seconds / decode
            # The chain formula: not for trees (whose drafted nodes are not one path).
            if not result.adaptive and not method.decoder.config.trees and stats.drafted and stats.target_forwards:
                c = stats.draft_forward_seconds / stats.drafted * baseline
                v = stats.target_forward_seconds / stats.target_forwards * baseline
                result.predicted_speedup = predicted_speedup(stats.conditional_acceptance, result.k, c, v)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts),
            "max_new_tokens": max_new, "runs": runs, "methods": [m.result.__dict__ for m in methods]}


def warm_up(methods: list[Method], ids: list[int], max_new: int, eos, progress: bool) -> float:
    """Run every method once (adaptive K also measures its costs here), then reset its
    statistics; returns the baseline's (the first method's) seconds per token."""
    from tqdm import tqdm

    seconds = []
    with tqdm(methods, desc="warm-up", unit="method", file=sys.stderr, disable=not progress, leave=False) as bar:
        for method in bar:
            bar.set_postfix_str(method.result.name, refresh=False)
            started = time.perf_counter()
            method.run(ids, max_new, eos)
            seconds.append(time.perf_counter() - started)
            if method.decoder is not None:
                method.decoder.reset_stats()
    return seconds[0] / max_new


def check_settings(prompts: list, max_new: int, runs: int, ks: tuple[int, ...]) -> None:
    """Refuse settings that would fail (or measure nothing) only after the work is done."""
    if not prompts:
        raise ValueError("no prompts to benchmark: give at least one")
    integer(max_new, "max_new (tokens per prompt)", low=1)
    integer(runs, "runs", low=1)
    if not ks:
        raise ValueError("ks is empty: give at least one K")
    for k in ks:
        integer(k, "every K", low=1)


def hf_methods(drafts: dict, k_max: int):
    """transformers' own speculative methods: prompt lookup, and assisted generation with
    each transformers draft under its two schedules."""
    yield "transformers prompt lookup (10)", {"prompt_lookup_num_tokens": 10}
    for name, draft in drafts.items():
        if isinstance(draft, HFModel):
            yield f"transformers assisted {name} (heuristic)", {
                "assistant_model": draft.model, "draft_name": name, "num_assistant_tokens": 5,
                "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.0}
            yield f"transformers assisted {name} (confidence 0.4)", {
                "assistant_model": draft.model, "draft_name": name, "num_assistant_tokens": 20,
                "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4}


def hf_generate(target: HFModel, kwargs: dict):
    kwargs = {k: v for k, v in kwargs.items() if k != "draft_name"}
    assistant = kwargs.pop("assistant_model", None)
    schedule = {k: kwargs.pop(k) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                          "assistant_confidence_threshold") if k in kwargs}

    def run(ids, n, eos):
        if assistant is not None:
            for key, value in schedule.items():  # transformers reads these from the assistant's config
                setattr(assistant.generation_config, key, value)
        inputs = torch.tensor([ids], device=target.device)
        with torch.inference_mode():  # an explicit mask: generate() would take pad ids for padding
            out = target.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n,
                                        do_sample=False, assistant_model=assistant, eos_token_id=eos,
                                        pad_token_id=eos[0] if eos else 0, **kwargs)
        return out[0, len(ids):].tolist()

    return run


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from .precision import cpu_features

    # Tables from CPUs with and without native bfloat16 differ most: say which this is.
    native = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
              if flag in cpu_features()]
    cpu += f" ({', '.join(native)})" if native else ""
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def identical_words(method: dict, prompts: int) -> str:
    """yes, NO (with how many prompts' outputs are equal, where recorded), or - (not compared)."""
    if method["identical"] is None:
        return "-"
    same = method.get("identical_prompts")
    return "yes" if method["identical"] else "NO" if same is None else f"NO ({same}/{prompts})"


# What the columns mean (the command prints it under the table).
LEGEND = ("speedup: tokens/s over autoregressive, the median of same-round ratios (per prompt: its median over "
          "prompts); predicted: (1 - a^(K+1)) / ((1 - a)(K c + v)) from the measured a, c and v; alpha: accepted "
          "/ drafted; judged: accepted / drafted tokens that the target judged; tau: tokens per target forward; "
          "time %: decoding time drafting / verifying / elsewhere. Adaptive methods plan from measured timings: "
          "their alpha and tau change from run to run, their greedy output never.")


def table(report: dict, width: int = 100, legend: bool = False) -> str:
    """The results as a table for people (rich) in `width` columns, as plain text (long
    method names wrap), with the LEGEND under it if asked."""
    import textwrap

    from rich import box
    from rich.console import Console
    from rich.table import Table

    grid = Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    grid.add_column("method", min_width=16)
    for column in ("tok/s", "speedup", "per\nprompt", "predicted", "alpha", "judged", "tau", "time %\nd/v/o",
                   "peak\nMB", "identical"):
        grid.add_column(column, justify="right", no_wrap=True)

    def fmt(value, pattern="{:.2f}", scale=1.0):
        return "-" if value is None else pattern.format(value * scale)

    for m in report["methods"]:
        shares = (m["draft_share"], m["verify_share"], m["overhead_share"])
        grid.add_row(m["name"], fmt(m["tokens_per_second"], "{:.1f}"), fmt(m["speedup"], "{:.2f}x"),
                     fmt(m.get("median_prompt_speedup"), "{:.2f}x"), fmt(m["predicted_speedup"], "{:.2f}x"),
                     fmt(m["acceptance_rate"]), fmt(m.get("conditional_acceptance")),
                     fmt(m["tokens_per_forward"]),
                     "-" if None in shares else "/".join(f"{100 * share:.0f}" for share in shares),
                     fmt(m["peak_rss_mb"], "{:.0f}"), identical_words(m, report["prompts"]))
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(grid)
    title = (f"{report['prompts']} prompts x {report['max_new_tokens']} new tokens, medians of {report['runs']} "
             f"rounds ({report['machine']})")
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    parts = [textwrap.fill(title, width), "\n".join(lines).strip("\n")] + [textwrap.fill(LEGEND, width)] * legend
    return "\n".join(parts) + "\n"


def plot(report: dict, path) -> None:
    """Speedup and acceptance against K per draft, with the speedup the formula predicts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_alpha) = plt.subplots(1, 2, figsize=(11, 4))
    drafts = sorted({m["draft"] for m in report["methods"] if m["k"] is not None and not m["adaptive"]})
    for draft in drafts:
        rows = sorted((m for m in report["methods"] if m["draft"] == draft and not m["adaptive"] and m["k"]),
                      key=lambda m: m["k"])
        ks = [m["k"] for m in rows]
        line, = ax_speed.plot(ks, [m["speedup"] for m in rows], "o-", label=f"{draft} measured")
        if any(m["predicted_speedup"] for m in rows):
            ax_speed.plot(ks, [m["predicted_speedup"] or float("nan") for m in rows], "--", color=line.get_color(),
                          label=f"{draft} predicted")
        ax_alpha.plot(ks, [m["acceptance_rate"] for m in rows], "o-", color=line.get_color(), label=draft)
        adaptive = [m for m in report["methods"] if m["draft"] == draft and m["adaptive"]]
        for m in adaptive:
            ax_speed.axhline(m["speedup"], color=line.get_color(), linestyle=":", label=f"{draft} adaptive")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="K (drafted tokens per step)", ylabel="speedup over autoregressive", title="Speedup")
    ax_alpha.set(xlabel="K", ylabel="acceptance rate alpha", title="Acceptance", ylim=(0, 1.05))
    ax_speed.legend(fontsize=7)
    ax_alpha.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def batch_throughput(target, draft, prompts: list[list[int]], batch_sizes=(1, 2, 4, 8, 16), max_new: int = 64,
                     runs: int = 3, k: int = 4, eos=None, prompt_lookup: bool = False, log=print) -> dict:
    """Total tokens/s across a batch: batched autoregressive against speculative decoding
    (fixed K and adaptive), per batch size. Rows cycle through the prompts."""
    rows = []
    for size in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        entry = {"batch_size": size}
        methods = {
            "autoregressive": None,
            f"speculative K={k}": SpeculativeDecoder(target, draft, SpeculativeConfig(
                num_draft_tokens=k, adaptive=False, prompt_lookup=prompt_lookup)),
            "speculative adaptive": SpeculativeDecoder(target, draft, SpeculativeConfig(
                num_draft_tokens=k, prompt_lookup=prompt_lookup)),
        }
        def run(method, batch=batch):
            if method is None:
                return autoregressive_generate(target, batch, max_new, eos_token_id=eos)
            return method.generate(batch, max_new, eos)

        for method in methods.values():
            run(method)  # warm-up (adaptive K measures its costs at this batch size here)
            if method is not None:
                method.reset_stats()
        speeds = {name: [] for name in methods}
        ratios = {name: [] for name in methods}
        outputs = {}
        for _ in range(runs):  # rounds: each method's ratio is to the baseline of its round
            for name, method in methods.items():
                started = time.perf_counter()
                outputs[name] = run(method)
                speeds[name].append(sum(map(len, outputs[name])) / (time.perf_counter() - started))
                ratios[name].append(speeds[name][-1] / speeds["autoregressive"][-1])
        for name, method in methods.items():
            entry[name] = {"tokens_per_second": statistics.median(speeds[name]),
                           "speedup": statistics.median(ratios[name]),
                           "identical": outputs[name] == outputs["autoregressive"]}
            if method is not None:
                entry[name]["acceptance_rate"] = method.stats.acceptance_rate
                entry[name]["tokens_per_forward"] = method.stats.tokens_per_forward
                entry[name]["drafted_per_step"] = method.stats.drafted / max(1, method.stats.target_forwards)
        log(f"  batch {size}: " + ", ".join(f"{n} {entry[n]['tokens_per_second']:.1f} tok/s "
                                              f"({entry[n]['speedup']:.2f}x)" for n in methods))
        rows.append(entry)
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "max_new_tokens": max_new, "runs": runs,
            "k": k, "prompt_lookup": prompt_lookup, "rows": rows}
