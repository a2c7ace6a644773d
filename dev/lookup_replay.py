"""How far drafting alone can take prompt lookup on the grounded-editing prompts (issue 35).

    python dev/lookup_replay.py [float32|bfloat16]

Records (once, cached in ~/.cache/speculative/dev/) the greedy texts of Gemma 3 270M on
benchmarks/grounded_editing.jsonl, times our transformers-module forward by width at the
prompts' context, then replays every text on that cost table, with no model:

- transformers' prompt lookup (up to 10 tokens from the earliest match of the last 2, 1 tokens);
- our engine and adaptive policy, as `lookup_vs_transformers.py` runs them (K = 24, one
  policy across the prompts, two passes, the second counted), on a clock that the replayed
  forwards advance by the table (10% noise);
- fixed K, every step drafting up to K from our lookup;
- an oracle: our lookup's draft cut to exactly the tokens that will be kept.

Prompt processing is left out of the per-prompt seconds (both sides pay the same); the
last lines add each prompt's measured reading time back, against transformers' lookup and
against plain decoding (the prompt, then one-token forwards), so they bound what a drafting
rule can reach end to end, and say how fast prompts would have to be read for 3x plain. The
forward counts of transformers' replay match its real runs.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from lookup_vs_transformers import K, PEER_K, hf_module, prompts_of  # noqa: E402

from speculative import NGramProposer, SpeculativeConfig, SpeculativeDecoder  # noqa: E402
from speculative.core.rows import SamplingParams  # noqa: E402
from speculative.models.base import screens_argmax  # noqa: E402
from speculative.policy.adaptive import AdaptivePolicy  # noqa: E402
from speculative.runtime.engine import Engine  # noqa: E402

NEW = 128
WIDTHS = (1, 2, 5, 8, 11, 14, 16, 17, 25)  # 16 and 17: bfloat16's AMX tiles hold 16 rows


def record(hf, path: Path) -> list[dict]:
    """Prompts and greedy texts (ours, identical to plain decoding in float32), cached."""
    if path.is_file():
        return json.loads(path.read_text())
    decoder = SpeculativeDecoder(hf, NGramProposer(num_draft_tokens=K), SpeculativeConfig(num_draft_tokens=K))
    texts = [{"prompt": ids, "out": decoder.generate(ids, NEW)} for ids in prompts_of(hf.tokenizer)]
    path.write_text(json.dumps(texts))
    return texts


def cost_table(hf, prompt: list[int]) -> dict[int, float]:
    """Seconds of a forward by width after the prompt (the fastest of 5), scored as the
    engine scores a greedy row (through the screen where the model has one)."""
    state, screen = hf.new_state(1), {"argmax_rows": [True]} if screens_argmax(hf) else {}
    with torch.inference_mode():
        hf.forward(torch.tensor([prompt]), state)
        length, table = state.lengths[0], {}
        for width in WIDTHS:
            times = []
            for _ in range(5):
                start = time.perf_counter()
                hf.forward(torch.tensor([prompt[:width]]), state, **screen)
                times.append(time.perf_counter() - start)
                hf.rollback(state, [length])
            table[width] = min(times)
    return table


def prompt_seconds(hf, prompt: list[int]) -> float:
    """Seconds to read a prompt into a fresh state (the fastest of 2)."""
    times = []
    with torch.inference_mode():
        for _ in range(2):
            state = hf.new_state(1)
            start = time.perf_counter()
            hf.forward(torch.tensor([prompt[:-1]]), state, keep_logits=False)
            times.append(time.perf_counter() - start)
    return min(times)


def at(table: dict[int, float], width: int) -> float:
    """The table's seconds at any width, linear between the widths timed."""
    low = max(w for w in table if w <= width)
    high = min((w for w in table if w >= width), default=low)
    return table[low] if high == low else table[low] + (table[high] - table[low]) * (width - low) / (high - low)


class Replay:
    """A model whose logits at position p put the recorded text's token p + 1 first, and
    whose forwards of at most 64 tokens advance the clock by the cost table."""

    max_seq_len = None
    device = torch.device("cpu")

    def __init__(self, texts, table, vocab_size, seed=0):
        self.texts, self.table, self.vocab_size, self.now = texts, table, vocab_size, 0.0
        self.random, self.current = random.Random(seed), 0

    def clock(self) -> float:
        return self.now

    def new_state(self, batch_size, capacity=None):
        return type("State", (), {"lengths": [0] * batch_size, "text": self.current})()

    def forward(self, tokens, state, num_valid=None, keep_logits=True, **options):
        width = tokens.shape[1]
        logits = torch.zeros(1, width, self.vocab_size)
        text = self.texts[state.text]
        for t in range(width):
            position = state.lengths[0] + t + 1
            logits[0, t, text[position] if position < len(text) else 0] = 10.0
        state.lengths[0] += width if num_valid is None else num_valid[0]
        if width <= 64:
            self.now += at(self.table, width) * math.exp(self.random.gauss(0, 0.1))
        return logits

    def rollback(self, state, lengths):
        state.lengths = list(lengths)

    def select_rows(self, state, rows):
        pass


def ours(texts, table, vocab_size, prompts) -> list[float]:
    """Seconds per prompt of our engine and policy, the second of two passes."""
    model = Replay(texts, table, vocab_size)
    config = SpeculativeConfig(num_draft_tokens=K)
    policy, proposer, seconds = AdaptivePolicy.for_config(config, None), NGramProposer(num_draft_tokens=K), []
    for _ in range(2):
        seconds = []
        for number, prompt in enumerate(prompts):
            model.current = number
            engine = Engine(model, proposer, config, max_batch_size=1, policy=policy, clock=model.clock)
            engine.add_request(prompt, SamplingParams(NEW))
            start = model.now
            while engine.has_unfinished():
                engine.step()
            seconds.append(model.now - start)
    return seconds


def walk(texts, prompts, table, draft) -> list[float]:
    """Seconds per prompt of a rule `draft(sequence, position, left) -> (tokens, width verified)`."""
    seconds = []
    for text, prompt in zip(texts, prompts):
        position, total = len(prompt), 0.0
        while position < len(prompt) + NEW:
            tokens, width = draft(text[:position], len(prompt) + NEW - position - 1)
            tokens = tokens[:width]
            kept = next((i for i, token in enumerate(tokens) if token != text[position + i]), len(tokens))
            position, total = position + kept + 1, total + at(table, width + 1)
        seconds.append(total)
    return seconds


def transformers_rule(sequence, left):
    """transformers' PromptLookupCandidateGenerator: the earliest match of the last 2, then 1 tokens."""
    for n in (2, 1):
        suffix = sequence[-n:]
        for start in range(len(sequence) - n):
            if sequence[start:start + n] == suffix and start + n < len(sequence):
                tokens = sequence[start + n:start + n + PEER_K][:left]
                return tokens, len(tokens)
    return [], 0


def lookup_rule(cut):
    """Our lookup's draft (up to K), verified up to `cut(tokens, sequence)`."""
    def rule(sequence, left):
        proposer = NGramProposer(num_draft_tokens=K)
        proposer.add_rows([sequence])
        tokens = proposer.lookup([sequence], [left])[0][0]
        return tokens, cut(tokens, sequence)
    return rule


def main(dtype: str) -> None:
    torch.set_num_threads(2)
    hf = hf_module(dtype)
    from speculative.models.presets import cache_root

    (cache_root() / "dev").mkdir(parents=True, exist_ok=True)
    records = record(hf, cache_root() / "dev" / f"lookup_replay_{dtype}.json")
    prompts = [r["prompt"] for r in records]
    texts = [r["prompt"] + r["out"] for r in records]
    table = cost_table(hf, prompts[0])
    print("forward seconds by width:", {w: round(s, 4) for w, s in table.items()})
    rows = {"transformers' lookup (10)": walk(texts, prompts, table, transformers_rule),
            f"ours, adaptive K <= {K}": ours(texts, table, hf.vocab_size, prompts)}
    for k in (8, 12, 16, 24):
        rows[f"fixed K = {k}"] = walk(texts, prompts, table, lookup_rule(lambda tokens, s, k=k: min(k, len(tokens))))
    # The oracle verifies exactly what will be kept: its widths are the kept tokens (the walk
    # stops at the first token that differs, so cutting there changes no outcome).
    oracle = {}

    def kept_only(sequence, left):
        tokens, _ = lookup_rule(lambda tokens, s: len(tokens))(sequence, left)
        text = oracle["text"]
        kept = next((i for i, token in enumerate(tokens) if token != text[len(sequence) + i]), len(tokens))
        return tokens[:kept], kept

    seconds = []
    for text, prompt in zip(texts, prompts):
        oracle["text"] = text
        seconds += walk([text], [prompt], table, kept_only)
    rows["oracle (our lookup, cut to what is kept)"] = seconds
    peer = sum(rows["transformers' lookup (10)"])
    for name, seconds in rows.items():
        print(f"{name:42s} {sum(seconds):6.2f} s  {peer / sum(seconds):.2f}x transformers  "
              f"per prompt {[round(s, 2) for s in seconds]}")
    reading = sum(prompt_seconds(hf, prompt) for prompt in prompts)
    plain = reading + len(prompts) * NEW * at(table, 1)
    print(f"end to end, with {reading:.2f} s of prompt reading (plain decoding {plain:.2f} s):")
    decoding = plain - reading  # plain decoding's one-token forwards
    for name in (f"ours, adaptive K <= {K}", "oracle (our lookup, cut to what is kept)"):
        total = reading + sum(rows[name])
        # 3x plain: (r + decoding) / (r + ours) >= 3, so r <= (decoding - 3 ours) / 2
        needed = (decoding - 3 * sum(rows[name])) / 2
        print(f"  {name:40s} {(reading + peer) / total:.2f}x transformers' lookup, {plain / total:.2f}x plain; "
              f"3x plain needs the prompts read in {needed:.2f} s ({needed / reading:.0%} of today's)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32")
