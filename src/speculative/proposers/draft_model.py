"""Drafting with a small language model that follows the model protocol."""

from __future__ import annotations

import time

import torch

from ..sampling import probabilities, sample
from .base import Proposal


class DraftModelProposer:
    """Runs the draft model K times per step and rolls it back to the kept prefix.

    The draft lags the committed sequence by one or more tokens (the target's extra token,
    and the last drafted token when all were accepted); those pending tokens are fed at
    the start of the next step, in the same forward call that drafts the first token.

    `vocab` (FR-Spec): the draft scores only these token ids, e.g. the most frequent
    tokens of a corpus (`speculative.vocab`). With a vocabulary of 152k-262k tokens the
    output layer is a large share of a small draft's cost. It stays lossless: q is zero
    outside the subset, so those tokens are never drafted, and the target's residual
    max(0, p - q) keeps all of their probability.
    """

    def __init__(self, model, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, sampling: bool = False, vocab: torch.Tensor | None = None):
        self.model = model
        self.vocab_size = model.vocab_size
        self.vocab = None if vocab is None else check_vocab(vocab, model.vocab_size).to(model.device)
        self.head = None if vocab is None else model.output_head(self.vocab)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        # In greedy mode q is never needed: draft the argmax and skip the softmax.
        self.sampling = sampling and temperature > 0
        self.state = None
        self.generators: list[torch.Generator] = []
        self._committed: list[int] = []
        self._drafted = 0
        # Seconds inside draft forwards (the engine's overhead is what lies outside them).
        self.forward_seconds = 0.0
        # Forwards while drafting (each drafts one position for the whole batch).
        self.forwards = 0

    def start(self, prompts: list[list[int]], capacity: int, generators: list[torch.Generator]) -> None:
        # The prompts are read at the first propose: a draft the adaptive plan never runs
        # (large batches, or prompt lookup doing all the drafting) costs nothing.
        self.state = self.model.new_state(len(prompts), capacity)
        self.generators = list(generators)

    reports_confidence = True
    # Tokens the draft has not seen beyond which they are read first without logits.
    catch_up = 8

    def propose(self, sequences: list[list[int]], limits: list[int], min_confidence: float | None = None) -> Proposal:
        """Draft up to limits[b] tokens for row b. With `min_confidence`, a row stops before
        the first token the draft gives less than that probability, and drafting stops once
        every row has stopped; the confidences are then reported for the adaptive policy."""
        device = self.model.device
        pending = [seq[n:] for seq, n in zip(sequences, self.state.lengths)]
        outside = [t for p in pending for t in p if t >= self.vocab_size]
        if outside:
            raise ValueError(f"the target produced token id {outside[0]}, outside the draft's vocabulary of "
                             f"{self.vocab_size} (a padded id the tokenizer does not have)")
        self._committed = [len(seq) for seq in sequences]
        if max(map(len, pending)) > self.catch_up:  # the prompt, or text drafted while the model sat out
            heads = [p[:-1] for p in pending]
            self._forward(pad(heads, device), [len(h) for h in heads], keep_logits=False)
            pending = [p[-1:] for p in pending]
        logits = self._forward(pad(pending, device), [len(p) for p in pending])
        rows = torch.arange(len(sequences), device=device)
        logits = logits[rows, torch.tensor([len(p) - 1 for p in pending], device=device)]  # (B, V)
        tokens, probs, confidences = [], [], []
        lengths = list(limits)
        for i in range(max(limits)):
            if i:
                logits = self._forward(tokens[-1][:, None])[:, -1]
            if self.sampling:
                q = probabilities(logits, self.temperature, self.top_k, self.top_p)
                drafted = sample(q, self.generators, [i < n for n in limits])
                confidence = q.gather(1, drafted[:, None])[:, 0] if min_confidence is not None else None
                probs.append(q if self.vocab is None else scatter_vocab(q, self.vocab, self.vocab_size))
            else:
                drafted = logits.argmax(-1)
                confidence = logits.float().softmax(-1).amax(-1) if min_confidence is not None else None
            tokens.append(drafted if self.vocab is None else self.vocab[drafted])
            if confidence is not None:
                values = confidence.tolist()
                confidences.append(values)
                for row, value in enumerate(values):
                    if lengths[row] == limits[row] > i and value < min_confidence:
                        lengths[row] = i
                if all(n <= i for n in lengths):
                    break
        self._drafted = len(tokens)
        self._tokens = torch.stack(tokens, 1)
        per_row = [list(row) for row in zip(*confidences)] if confidences else None
        return Proposal(self._tokens, lengths, torch.stack(probs, 1) if self.sampling else None, per_row)

    def _run(self, tokens: torch.Tensor, num_valid: list[int] | None = None, keep_logits: bool = True):
        """Logits (B, T, V) of the draft's vocabulary (the subset's N columns with `vocab`)."""
        if self.head is None or not keep_logits:
            return self.model.forward(tokens, self.state, num_valid, keep_logits=keep_logits)
        _, hidden = self.model.forward(tokens, self.state, num_valid, keep_logits=False, return_hidden=True)
        return self.head(hidden)

    def _forward(self, tokens: torch.Tensor, num_valid: list[int] | None = None, keep_logits: bool = True):
        started = time.perf_counter()
        logits = self._run(tokens, num_valid, keep_logits)
        self.forward_seconds += time.perf_counter() - started
        self.forwards += 1
        return logits

    def commit(self, sequences: list[list[int]]) -> None:
        # The draft has seen the old committed prefix plus all its drafts but the last; keep
        # the part that the new committed sequence still starts with.
        fed = self._tokens.tolist()
        keep = []
        for n, seq, drafts in zip(self._committed, sequences, fed):
            same = 0
            while same < self._drafted - 1 and n + same < len(seq) and seq[n + same] == drafts[same]:
                same += 1
            keep.append(n + same)
        self.model.rollback(self.state, keep)

    def probe_seconds(self, rows: list[list[int]]) -> float:
        """Seconds of one drafted token at this batch size (a forward, then rolled back)."""
        lengths = list(self.state.lengths)
        tokens = torch.tensor([[row[-1]] for row in rows], device=self.model.device)
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            self._run(tokens)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            best = min(best, time.perf_counter() - started)
            self.model.rollback(self.state, lengths)
        return best

    def select_rows(self, rows: list[int]) -> None:
        self.model.select_rows(self.state, rows)
        self.generators = [self.generators[r] for r in rows]


def pad(rows: list[list[int]], device, value: int = 0) -> torch.Tensor:
    """Right-pad token lists into a (B, T) long tensor."""
    width = max(1, max(map(len, rows)))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def check_vocab(vocab, size: int) -> torch.Tensor:
    """A reduced vocabulary as a 1-D long tensor of distinct ids in 0..size-1."""
    vocab = torch.as_tensor(vocab)
    if vocab.dim() != 1 or len(vocab) == 0 or vocab.is_floating_point() or vocab.dtype == torch.bool:
        raise ValueError(f"a draft vocabulary must be a non-empty 1-D list of token ids, got shape "
                         f"{tuple(vocab.shape)} of {vocab.dtype}")
    vocab = vocab.long()
    if int(vocab.min()) < 0 or int(vocab.max()) >= size:
        raise ValueError(f"draft vocabulary ids must lie in 0..{size - 1}, got {int(vocab.min())}..{int(vocab.max())}")
    if len(torch.unique(vocab)) != len(vocab):
        raise ValueError("draft vocabulary ids must be distinct")
    return vocab


def scatter_vocab(q: torch.Tensor, vocab: torch.Tensor, size: int) -> torch.Tensor:
    """q over the subset (B, N) as a distribution over all `size` tokens, zero elsewhere."""
    full = q.new_zeros(q.shape[0], size)
    return full.scatter_(1, vocab.expand(q.shape[0], -1), q)
