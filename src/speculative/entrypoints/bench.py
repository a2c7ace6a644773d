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
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from ..core.config import SpeculativeConfig, integer
from ..models.hf import HFModel
from ..proposers.ngram import NGramProposer
from ..runtime.decoder import SpeculativeDecoder, autoregressive_generate
from .bench_engine import batch_throughput
from .bench_report import LEGEND, identical_words, machine, plot, table


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
    lineup = Lineup(target, lookup, draft_vocab)
    for draft_name, draft in drafts.items():
        lineup.chains(draft_name, draft, ks, adaptive)
    if ngram:
        lineup.ngram_chains(ks, adaptive)
    if tree is not None:
        lineup.trees(drafts, ks, tree, adaptive)
    if peers:
        lineup.peers(drafts, max(ks), log)
    return run_methods(lineup.methods, prompts, max_new, runs, eos, log, progress)


class Lineup:
    """The methods of one benchmark, the baseline (plain decoding of the target) first."""

    def __init__(self, target, lookup: tuple[str, ...], draft_vocab):
        self.target, self.lookup, self.draft_vocab = target, lookup, draft_vocab
        self.methods = [plain_method("autoregressive", target)]

    def add(self, name: str, draft, draft_name: str, k: int, adaptive: bool, **trees) -> None:
        """A speculative decoder of `draft` at K (the most K with `adaptive`)."""
        config = SpeculativeConfig(num_draft_tokens=k, adaptive=adaptive, prompt_lookup=draft_name in self.lookup,
                                   **trees)
        vocab = None if hasattr(draft, "propose") else self.draft_vocab
        decoder = SpeculativeDecoder(self.target, draft, config, draft_vocab=vocab)
        self.methods.append(Method(Result(name, draft=draft_name, k=k, adaptive=adaptive),
                                   lambda ids, n, e: decoder.generate(ids, n, e), decoder))

    def chains(self, name: str, draft, ks: tuple[int, ...], adaptive: bool) -> None:
        for k in ks:
            self.add(f"{name} K={k}", draft, name, k, False)
        if adaptive:
            self.add(f"{name} adaptive (K<={max(ks)})", draft, name, max(ks), True)

    def ngram_chains(self, ks: tuple[int, ...], adaptive: bool) -> None:
        for k in sorted({min(ks), max(ks)}):
            self.add(f"ngram K={k}", NGramProposer(num_draft_tokens=k), "ngram", k, False)
        if adaptive:
            self.add(f"ngram adaptive (K<={max(ks)})", NGramProposer(num_draft_tokens=max(ks)), "ngram", max(ks), True)

    def trees(self, drafts: dict, ks: tuple[int, ...], tree: tuple[int, int], adaptive: bool) -> None:
        """Per draft (n-gram lookup first): a chain as wide as the tree, the tree, an adaptive tree."""
        top_k, nodes = tree
        shape = dict(tree_top_k=top_k, tree_max_tokens=nodes)
        sources = {"ngram": lambda: NGramProposer(num_draft_tokens=max(ks)),
                   **{name: lambda draft=draft: draft for name, draft in drafts.items()}}
        for name, draft in sources.items():
            chain = NGramProposer(num_draft_tokens=nodes) if name == "ngram" else draft()
            self.add(f"{name} chain K={nodes}", chain, name, nodes, False)
            self.add(f"{name} tree top-{top_k} {nodes} nodes", draft(), name, max(ks), False, **shape)
            if adaptive:
                self.add(f"{name} tree top-{top_k} adaptive (<={nodes} nodes)", draft(), name, max(ks), True, **shape)

    def peers(self, drafts: dict, k_max: int, log) -> None:
        """transformers' own methods, where the target runs through transformers; else why not."""
        if isinstance(self.target, HFModel):
            for name, kwargs in hf_methods(drafts, k_max):
                self.methods.append(Method(Result(name, draft=kwargs.get("draft_name")),
                                           hf_generate(self.target, kwargs)))
            return
        import importlib.util

        why = ("transformers is not installed (pip install 'speculative[hf]')"
               if importlib.util.find_spec("transformers") is None else
               f"they run only on a target loaded through transformers, not on a {type(self.target).__name__}")
        log(f"transformers' own methods (prompt lookup, assisted generation) left out: {why}")


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
        seconds = time_round(methods, prompts, max_new, eos, round_number, runs, bar)
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
        summarize(method, methods[0], speeds[id(method)], ratios[id(method)], baseline, len(prompts))
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts),
            "max_new_tokens": max_new, "runs": runs, "methods": [m.result.__dict__ for m in methods]}


def time_round(methods: list[Method], prompts: list[list[int]], max_new: int, eos, round_number: int, runs: int,
               bar) -> dict:
    """One round: every method on every prompt; seconds per method (by id), per prompt."""
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
    return seconds


def summarize(method: Method, base: Method, speeds: list[float], ratios: list[float], baseline: float,
              prompts: int) -> None:
    """Fill the method's Result: speeds and speedups (medians over rounds), sameness, memory."""
    result = method.result
    result.run_tokens_per_second = [round(v, 2) for v in speeds]
    result.tokens_per_second = statistics.median(speeds)
    result.speedup = statistics.median(ratios)
    result.prompt_speedups = [  # per prompt: the median over rounds of its same-round ratio
        round(statistics.median(mine[i] / theirs[i] for mine, theirs in zip(method.prompt_speeds,
                                                                              base.prompt_speeds)), 3)
        for i in range(prompts)]
    result.median_prompt_speedup = statistics.median(result.prompt_speedups)
    if method.compare:
        reference = (method.reference or base).outputs
        result.identical = method.outputs == reference
        result.identical_prompts = sum(a == b for a, b in zip(method.outputs, reference))
    result.peak_rss_mb = method.peak / 2 ** 20
    result.peak_rss_delta_mb = (method.peak - method.before) / 2 ** 20
    result.generated_tokens = sum(map(len, method.outputs))
    stats = method.decoder.stats if method.decoder is not None else None
    if stats is not None and stats.total_seconds > 0:
        decoder_figures(result, stats, method.decoder.config, baseline)


def decoder_figures(result: Result, stats, config: SpeculativeConfig, baseline: float) -> None:
    """Acceptance, tokens per forward, where the time went, and the chain formula's prediction."""
    result.acceptance_rate = stats.acceptance_rate
    result.conditional_acceptance = stats.conditional_acceptance
    result.tokens_per_forward = stats.tokens_per_forward
    result.acceptance_per_depth = [round(a / d, 3) for a, d in zip(stats.accepted_at, stats.drafted_at) if d]
    decode = stats.total_seconds - stats.prefill_seconds
    result.draft_share = stats.draft_forward_seconds / decode
    result.verify_share = stats.target_forward_seconds / decode
    result.overhead_share = stats.overhead_seconds / decode
    # The chain formula: not for trees (whose drafted nodes are not one path).
    if not result.adaptive and not config.trees and stats.drafted and stats.target_forwards:
        c = stats.draft_forward_seconds / stats.drafted * baseline
        v = stats.target_forward_seconds / stats.target_forwards * baseline
        result.predicted_speedup = predicted_speedup(stats.conditional_acceptance, result.k, c, v)


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


__all__ = ["Method", "Result", "run_bench", "run_methods", "speculative_method", "plain_method", "hf_generate",
           "batch_throughput", "machine", "table", "plot", "identical_words", "LEGEND"]
