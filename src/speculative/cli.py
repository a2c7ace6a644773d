"""The `speculative` command: generate text, benchmark, train and export models."""

from __future__ import annotations

import argparse
import sys
import time


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: text in and out for models without a tokenizer."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stats_line(stats, seconds: float) -> str:
    """One line: tokens/s, acceptance rate, mean tokens per target forward."""
    rate = stats.generated / seconds if seconds > 0 else 0.0
    return (f"[{stats.generated} tokens in {seconds:.2f} s: {rate:.1f} tokens/s | acceptance rate "
            f"{stats.acceptance_rate:.2f} | {stats.tokens_per_forward:.2f} tokens per target forward]")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a continuation of a prompt with speculative decoding",
                       description="Generate text with speculative decoding. Greedy output (the default, "
                                   "--temperature 0) is token-identical to the target alone; sampled output "
                                   "follows the target's distribution exactly.")
    p.add_argument("--target", default="random", help="target model: a local directory or a preset "
                   "(default: %(default)s, a freshly built pair with random weights)")
    p.add_argument("--draft", default=None, help="draft: a local directory, a preset, or 'ngram' "
                   "(default: the target's built-in partner)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--prompt", help="prompt text")
    group.add_argument("--prompt-file", help="file whose text is the prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=4, help="K, tokens drafted per step "
                   "(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="target temperature; 0 = greedy "
                   "(default: %(default)s)")
    p.add_argument("--draft-temperature", type=float, default=1.0, help="draft temperature when sampling; "
                   "changes speed only, never the output distribution (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of tokens "
                   "whose probability reaches p")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: fresh randomness)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.set_defaults(run=run_generate)


def run_generate(args) -> int:
    import torch

    from . import SpeculativeConfig, SpeculativeDecoder, build_pair

    if args.target != "random":
        raise SystemExit(f"error: unknown target {args.target!r}; this build knows the preset 'random'")
    print("note: 'random' is a freshly built draft/verifier pair with random weights; its text is noise.",
          file=sys.stderr)
    tokenizer = ByteTokenizer()
    draft, target = build_pair(tokenizer.vocab_size, seed=0, verifier_model_opts={"max_seq_len": 4096})
    draft, target = draft.to(args.device), target.to(args.device)
    text = args.prompt if args.prompt is not None else (
        open(args.prompt_file, encoding="utf-8").read() if args.prompt_file else "def fibonacci(n):")
    ids = tokenizer.encode(text)
    config = SpeculativeConfig(num_draft_tokens=args.num_draft_tokens, main_temperature=args.temperature,
                               draft_temperature=args.draft_temperature,
                               greedy_verification=args.temperature == 0, top_k=args.top_k, top_p=args.top_p,
                               seed=args.seed)
    decoder = SpeculativeDecoder(target, draft, config)
    started = time.perf_counter()
    if args.stream:
        out: list[int] = []
        for token in decoder.stream(ids, args.max_new_tokens, tokenizer.eos_token_id):
            out.append(token)
            sys.stdout.write(tokenizer.decode([token]))
            sys.stdout.flush()
        print()
    else:
        out = decoder.generate(ids, args.max_new_tokens, tokenizer.eos_token_id)
        print(text + tokenizer.decode(out))
    print(stats_line(decoder.stats, time.perf_counter() - started))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speculative", description="Speculative decoding: faster generation "
                                     "from a language model, with the same output.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
