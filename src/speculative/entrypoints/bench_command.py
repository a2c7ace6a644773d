"""`speculative bench`: its options, the models through EngineArgs, and the printed report."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from ..core.config import MAX_NEW_TOKENS, MAX_TREE_TOKENS, MAX_TREE_TOP_K
from ..proposers.vocab import auto_size
from .cli_checks import integer, integer_list
from .engine_args import EngineArgs, draft_model_name


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="compare autoregressive, speculative (each draft, each K, adaptive), n-gram "
                       "and (for transformers targets) transformers' own methods on the same prompts",
                       description="Benchmark in one process: after a warm-up, --runs rounds, each going prompt "
                                   "by prompt through every method; tokens/s and speedup over autoregressive "
                                   "(medians over rounds of same-round ratios, also per prompt), acceptance "
                                   "rate, tokens per target forward, where the time goes, peak memory, and "
                                   "whether the output is identical to the autoregressive output, as a table of "
                                   "100 columns with a legend. The defaults take several minutes on 2 CPU cores "
                                   "(19 methods x 10 prompts x 3 rounds): stderr shows the estimated time, then a "
                                   "progress bar per generation; --limit, --runs, --k and --no-* make it shorter. "
                                   "The last line of stdout is JSON with --json.")
    p.add_argument("--draft", action="append", dest="drafts", metavar="DRAFT", default=None, help="a draft (path, preset, or s4d); repeat to "
                   "compare several (default: the target's shipped drafts, none for other targets)")
    p.add_argument("--prompts", default=None, help="JSONL file, one {\"prompt\": ...} per line (default: "
                   "held-out standard-library functions, for the shipped target)")
    p.add_argument("--limit", type=integer(1), default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=integer(1, MAX_NEW_TOKENS), default=64, help="tokens per prompt "
                   "(default: %(default)s)")
    p.add_argument("--runs", type=integer(1), default=3, help="timed rounds over all prompts (default: %(default)s)")
    p.add_argument("--k", type=integer_list, default=(1, 2, 4, 8), help="fixed K values, comma separated "
                   "(default: 1,2,4,8)")
    p.add_argument("--no-ngram", action="store_true", help="leave out n-gram drafting")
    p.add_argument("--tree-top-k", type=integer(2, MAX_TREE_TOP_K), dest="tree_children", metavar="TREE_TOP_K",
                   default=None, help="also token trees with this many "
                   "children per node: n-gram trees and every draft's trees of --tree-max-tokens nodes, against chains "
                   "of the same verify width, and adaptive trees (their budget planned) unless --no-adaptive")
    p.add_argument("--tree-max-tokens", type=integer(1, MAX_TREE_TOKENS), default=16, help="nodes per tree with "
                   "--tree-top-k (default: %(default)s)")
    p.add_argument("--no-adaptive", action="store_true", help="leave out adaptive K")
    p.add_argument("--no-peers", action="store_true", help="leave out transformers' own methods (prompt lookup, "
                   "assisted generation with each transformers draft); they run only when the target is loaded "
                   "through transformers (and transformers is installed), and stderr says when they are left out")
    p.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    p.add_argument("--plot", default=None, help="write a PNG of speedup and acceptance against K (needs "
                   "matplotlib: pip install 'speculative[bench]')")
    EngineArgs.add_to_parser(p, drafting=False)
    p.set_defaults(run=run_bench)


def bench_prompts(args, tokenizer, lines, limit_tokens: int | None) -> list[list[int]]:
    if lines is not None:
        ids = [tokenizer.chat(line.prompt) if line.chat else tokenizer.encode(line.prompt) for line in lines]
    elif args.target == "default":
        from ..train import corpus

        _, held_out = corpus.split_files()
        ids = [tokenizer.encode(p) for p in corpus.function_prompts(held_out, 10)]
    else:
        raise ValueError("--prompts is needed for a target other than the shipped default")
    ids = ids[:args.limit] if args.limit else ids
    if limit_tokens is not None:
        ids = [row[-limit_tokens:] for row in ids]  # keep the end of prompts the model cannot hold
    return ids


def check_plot(path: str) -> None:
    """--plot is checked before the benchmark runs, not after: matplotlib, and a folder to write into."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install 'speculative[bench]'") from None
    folder = Path(path).parent
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: the folder {folder} does not exist")


def load_drafts(engine_args: EngineArgs, names: list[str], target: tuple, k_max: int) -> dict:
    """Each named draft (not 'ngram', which the benchmark runs itself), every model loaded
    once (MODEL and MODEL+ngram share it), each checked to hold K + 1 positions."""
    from ..core.inputs import check_draft_width

    loaded = {model: replace(engine_args, draft=model).load_draft()
              for model in {draft_model_name(n) for n in names} if model != "ngram"}
    for name, model in [target, *loaded.items()]:
        check_draft_width(k_max, model, repr(name), "--k")
    return {name: loaded[draft_model_name(name)] for name in names if name != "ngram"}


def run_bench(args) -> int:
    from .bench import plot, run_bench as bench, table
    from .prompt_files import read_jsonl

    engine_args = EngineArgs.from_args(args)
    engine_args.check_models()
    if args.plot:
        check_plot(args.plot)
    lines = read_jsonl(args.prompts, "--prompts") if args.prompts else None
    if lines is None and args.target != "default":
        raise ValueError("--prompts is needed for a target other than the shipped default")
    target, tokenizer = engine_args.load_target()
    names = args.drafts if args.drafts is not None else (["default-draft", "default-s4d", "default-draft+ngram"]
                                                          if args.target == "default" else [])
    ks = args.k
    drafts = load_drafts(engine_args, names, (args.target, target), max(ks))
    limit = target.max_seq_len - args.max_new_tokens - max(ks) - 1 if target.max_seq_len else None
    if limit is not None and limit < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} and --k up to {max(ks)} leave no room for a prompt "
                         f"in the target's {target.max_seq_len} positions: allowed --max-new-tokens + max(--k) <= "
                         f"{target.max_seq_len - 2}")
    prompts = bench_prompts(args, tokenizer, lines, limit)
    log = lambda *a: print(*a, file=sys.stderr)  # progress and notices; stdout has the results only
    report = bench(target, drafts, prompts, args.max_new_tokens, args.runs, ks, tokenizer.eos_token_ids or None,
                   ngram=not args.no_ngram or "ngram" in (args.drafts or []), adaptive=not args.no_adaptive,
                   peers=not args.no_peers, lookup=tuple(name for name in drafts if name.endswith("+ngram")), log=log,
                   draft_vocab=engine_args.vocabulary(tokenizer, next(
                       (draft for draft in drafts.values() if auto_size(draft)), None)), progress=True,
                   tree=None if args.tree_children is None else (args.tree_children, args.tree_max_tokens))
    report["target"] = args.target
    print(table(report, legend=True))
    if args.plot:
        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(report))
    return 0
