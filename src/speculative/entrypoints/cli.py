"""The `speculative` command: generate text, benchmark, train and export models."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from ..core.config import MAX_BATCH_SIZE, MAX_NEW_TOKENS
from .cli_checks import EXIT_STATUSES, INTERRUPTED, OneLineParser, argument_text, integer, number, run_command
from .engine_args import EngineArgs

# No newline at the end: the tokenizer merges a newline with the next line's indentation.
DEFAULT_PROMPT = '''def read_lines(path):
    """Return the lines of a text file, without their line endings."""'''


def stats_line(stats, seconds: float) -> str:
    """One line: tokens/s, acceptance rate, mean tokens per target forward."""
    rate = stats.generated / seconds if seconds > 0 else 0.0
    return (f"[{stats.generated} tokens in {seconds:.2f} s: {rate:.1f} tokens/s | acceptance rate "
            f"{stats.acceptance_rate:.2f} | {stats.tokens_per_forward:.2f} tokens per target forward]")


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
    group = p.add_mutually_exclusive_group()
    group.add_argument("--prompt", help="prompt text (default: the start of a Python function)")
    group.add_argument("--prompt-file", help="file whose text is the prompt ('-' or /dev/stdin: standard input); "
                       "a .jsonl file holds several prompts, one {\"prompt\": ..., \"max_new_tokens\": optional, "
                       "\"chat\": optional} object per line, checked whole, generated in batches and printed as "
                       "JSON lines in input order")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template (Gemma "
                   "and Qwen have one; the shipped default, a code-completion model, has none)")
    p.add_argument("--max-new-tokens", type=integer(0, MAX_NEW_TOKENS), default=128, help="tokens to generate "
                   "(default: %(default)s)")
    p.add_argument("--batch-size", type=integer(1, MAX_BATCH_SIZE), default=8, help="prompts decoded together from "
                   "a .jsonl --prompt-file (default: %(default)s)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    EngineArgs.add_to_parser(p, sampling="all")
    p.set_defaults(run=run_generate)


def read_prompts(args) -> tuple[str | None, list | None]:
    """(text, None) for one prompt, (None, lines) for a .jsonl --prompt-file."""
    from .prompt_files import is_jsonl, read_jsonl, read_text

    if args.prompt_file and is_jsonl(args.prompt_file):
        return None, read_jsonl(args.prompt_file, "--prompt-file")
    if args.prompt_file:
        text = read_text(args.prompt_file, "--prompt-file")
        if not text:
            raise ValueError(f"--prompt-file {args.prompt_file} is empty; give some text")
        return text, None
    return DEFAULT_PROMPT if args.prompt is None else argument_text(args.prompt, "--prompt"), None


def run_generate(args) -> int:
    # Everything the command line says is checked before a model is loaded.
    engine_args = EngineArgs.from_args(args).validate()
    text, lines = read_prompts(args)
    built = engine_args.build()
    decoder, tokenizer = built.decoder(), built.tokenizer
    eos = tokenizer.eos_token_ids or None
    if lines is not None:
        return generate_batches(decoder, tokenizer, lines, args, eos, built.models())
    ids = (tokenizer.chat if args.chat else tokenizer.encode)(text)
    started = time.perf_counter()
    if args.stream:
        sys.stdout.write(text)
        stream_text(decoder.stream(ids, args.max_new_tokens, eos), tokenizer)
        print()
    else:
        out = decoder.generate(ids, args.max_new_tokens, eos)
        print(text + tokenizer.decode(out))
    print(stats_line(decoder.stats, time.perf_counter() - started))
    return 0


def stream_text(tokens, tokenizer) -> None:
    """Print the text of tokens as they come, each character once whole."""
    out: list[int] = []
    shown = ""
    for token in tokens:
        out.append(token)
        now = tokenizer.decode(out)
        if not now.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(now[len(shown):])
            sys.stdout.flush()
            shown = now


def generate_batches(decoder, tokenizer, lines, args, eos, models) -> int:
    """Decode the prompts `--batch-size` at a time; print JSON lines in input order. Every
    prompt is checked (length, seed) before the first one is generated."""
    from ..core.inputs import check_length, row_seeds

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

    from ..models.loading import ASSETS
    from ..train.pipeline import TrainOptions, run_training

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
    from ..models.loading import load_model
    from ..models.loading import resolve
    from .export import check_destination, check_transformers, export_llama

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
    from .batch_command import add_batch
    from .bench_command import add_bench
    from .serve.command import add_serve
    from .train_head_command import add_train_head

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
