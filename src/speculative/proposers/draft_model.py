"""Drafting with a small language model that follows the model protocol."""

from __future__ import annotations

import copy

import torch

from ..models.base import pad, prefill
from ..core.sampling import Sampler, argmax, check_finite, row_probabilities, sample
from ..core.tree import Tree, expand_tree
from .base import Proposal


class DraftModelProposer:
    """Runs the draft model K times per step and rolls it back to the kept prefix.

    The draft lags the committed sequence by one or more tokens (the target's extra token,
    and the last drafted token when all were accepted); those pending tokens are fed at
    the start of the next step, in the same forward call that drafts the first token.
    Each row drafts with its own settings: greedy rows take the argmax, sampled rows draw
    from q (their temperature, top-k, top-p) with their own generator.

    `vocab` (FR-Spec): the draft scores only these token ids, e.g. the most frequent
    tokens of a corpus (`speculative.proposers.vocab`). With a vocabulary of 152k-262k tokens the
    output layer is a large share of a small draft's cost. It stays lossless: q is zero
    outside the subset, so those tokens are never drafted, and the target's residual
    max(0, p - q) keeps all of their probability.
    """

    # Tokens the draft has not seen beyond which they are read first without logits.
    catch_up_limit = 8
    reads_features = False  # it reads tokens, not the target's hidden states

    def __init__(self, model, vocab: torch.Tensor | None = None):
        self.model = model
        self.vocab_size = model.vocab_size
        self.vocab = None if vocab is None else check_vocab(vocab, model.vocab_size).to(model.device)
        self.head = None if vocab is None else model.output_head(self.vocab)
        self._reset()

    def _reset(self) -> None:
        """No rows: the per-generation part of the proposer."""
        self.state = None
        self.capacity = 0
        self.samplers: list[Sampler] = []
        self.generators: list[torch.Generator] = []
        self._committed: list[int] = []
        self._drafted = 0
        self._tokens: torch.Tensor | None = None

    def fork(self) -> "DraftModelProposer":
        twin = copy.copy(self)  # shares the model and the reduced output layer
        twin._reset()
        return twin

    def add_rows(self, prompts: list[list[int]], capacity: int, samplers: list[Sampler],
                 generators: list[torch.Generator]) -> None:
        # The prompts are read at the first propose: a draft the adaptive plan never runs
        # (large batches, or prompt lookup doing all the drafting) costs nothing.
        self.capacity = max(self.capacity, capacity)
        if self.state is None:
            self.state = self.model.new_state(len(prompts), capacity)
        else:
            self.model.add_rows(self.state, self.model.new_state(len(prompts), 1), capacity)
        self.samplers += list(samplers)
        self.generators += list(generators)

    def select_rows(self, rows: list[int]) -> None:
        self.model.select_rows(self.state, rows)
        self.samplers = [self.samplers[r] for r in rows]
        self.generators = [self.generators[r] for r in rows]

    def free_drafts(self, sequences: list[list[int]], limits: list[int]) -> tuple[list[list[int]], list[bool]]:
        return [[] for _ in sequences], [False] * len(sequences)

    @property
    def branches(self) -> bool:
        """Its own trees (propose_tree; it has no free ones) need a draft model that reads a
        tree in one forward: one with `compact`, as the model protocol says. A recurrent
        draft (S4D) drafts chains."""
        return callable(getattr(self.model, "compact", None))

    def free_trees(self, sequences, limits, top_k, max_nodes):
        return [Tree([], []) for _ in sequences], [False] * len(sequences)

    def unread(self, sequences: list[list[int]]) -> int:
        """The most tokens of a row the draft has yet to read."""
        return max((len(seq) - n for seq, n in zip(sequences, self.state.lengths)), default=0)

    def catch_up(self, sequences: list[list[int]]) -> None:
        """Read what the draft has not seen, but its last `catch_up` tokens, without logits:
        the prompts of rows that joined (in a forward of their own), and text drafted while
        the model sat out."""
        outside = [t for seq, n in zip(sequences, self.state.lengths) for t in seq[n:] if t >= self.vocab_size]
        if outside:
            raise ValueError(f"the target produced token id {outside[0]}, outside the draft's vocabulary of "
                             f"{self.vocab_size} (a padded id the tokenizer does not have)")
        self._read_apart(sequences)
        pending = [seq[n:] for seq, n in zip(sequences, self.state.lengths)]
        if max(map(len, pending)) > self.catch_up_limit:
            heads = [p[:-1] for p in pending]
            self._run(pad(heads, self.model.device), [len(h) for h in heads], keep_logits=False)

    def propose(self, sequences: list[list[int]], limits: list[int], min_confidence: float | None = None) -> Proposal:
        """Draft up to limits[b] tokens for row b. With `min_confidence`, a row stops before
        the first token the draft gives less than that probability, and drafting stops once
        every row has stopped; the confidences are then reported for the adaptive policy."""
        logits = self._root_logits(sequences)  # (B, V) or (B, N)
        check_finite(logits, "draft")
        forwards = 1
        samplers = self.samplers
        sampling = any(not s.greedy for s in samplers)
        draws = [not s.greedy for s in samplers]
        tokens, probs, confidences = [], [], []
        lengths = list(limits)
        for i in range(max(limits)):
            if i:
                logits = self._run(tokens[-1][:, None])[:, -1]
                check_finite(logits, "draft")
                forwards += 1
            if sampling:  # greedy rows get a one-hot q and draw nothing from their stream
                q = row_probabilities(logits, samplers)
                drafted = sample(q, self.generators, [d and i < n for d, n in zip(draws, limits)])
                probs.append(q if self.vocab is None else scatter_vocab(q, self.vocab, self.vocab_size))
            else:
                q, drafted = None, argmax(logits)
            tokens.append(drafted if self.vocab is None else self.vocab[drafted])
            if min_confidence is not None:
                values = self._confidence(logits, drafted, q, draws)
                confidences.append(values)
                for row, value in enumerate(values):
                    if lengths[row] == limits[row] > i and value < min_confidence:
                        lengths[row] = i
                if all(n <= i for n in lengths):
                    break
        self._drafted = len(tokens)
        self._tokens = torch.stack(tokens, 1)
        per_row = [list(row) for row in zip(*confidences)] if confidences else None
        return Proposal(self._tokens, lengths, torch.stack(probs, 1) if sampling else None, per_row,
                        forwards=forwards)

    def propose_tree(self, sequences: list[list[int]], limits: list[int], top_k: int, max_nodes: int) -> list[Tree]:
        """Per row a tree of at most max_nodes nodes, limits[b] deep (empty for limit 0):
        the draft's top_k children of its most probable nodes, one forward per depth
        (`tree.expand_tree`). Its nodes are deterministic candidates (q one-hot), which the
        tree rule for top-k children verifies exactly, sampled rows included."""
        root = self._root_logits(sequences)
        check_finite(root, "draft")
        # The nodes read are no prefix of anything: commit keeps no drafted token.
        self._drafted, self._tokens = 0, torch.zeros(len(sequences), 0, dtype=torch.long)
        return expand_tree(root, self._checked_tree_forward, limits, top_k, max_nodes, self._committed, self.vocab)

    def _checked_tree_forward(self, *layer) -> torch.Tensor:
        logits = self._tree_forward(*layer)  # (B, k, V): every row reads k nodes, none padding
        check_finite(logits, "draft")
        return logits

    def _root_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """Read what the draft has not seen of each row; its logits (B, V) (or (B, N) with
        `vocab`) after the row's last committed token."""
        device = self.model.device
        self.catch_up(sequences)  # nothing left to read when the engine called it already
        self._committed = [len(seq) for seq in sequences]
        pending = [seq[n:] for seq, n in zip(sequences, self.state.lengths)]
        logits = self._run(pad(pending, device), [len(p) for p in pending])
        rows = torch.arange(len(sequences), device=device)
        return logits[rows, torch.tensor([len(p) - 1 for p in pending], device=device)]

    def _tree_forward(self, tokens, parents, positions, mask) -> torch.Tensor:
        """Read a layer of tree nodes (`tree.expand_tree`); their logits (B, k, V)."""
        return self._run(tokens, positions=positions, tree=mask)

    def _run(self, tokens: torch.Tensor, num_valid: list[int] | None = None, keep_logits: bool = True, **tree):
        """Logits (B, T, V) of the draft's vocabulary (the subset's N columns with `vocab`);
        `tree`: a tree layer's positions and mask."""
        if self.head is None or not keep_logits:
            return self.model.forward(tokens, self.state, num_valid, keep_logits=keep_logits, **tree)
        _, hidden = self.model.forward(tokens, self.state, num_valid, keep_logits=False, return_hidden=True, **tree)
        return self.head(hidden)

    def _read_apart(self, sequences: list[list[int]]) -> None:
        """Rows that joined a running batch read their prompts in a forward of their own
        (not one padded to the whole batch), then take their places again."""
        unread = [i for i, (n, seq) in enumerate(zip(self.state.lengths, sequences)) if n == 0 and
                  len(seq) - 1 > self.catch_up_limit]
        if not unread or len(unread) == len(sequences):
            return
        others = [i for i in range(len(sequences)) if i not in set(unread)]
        joined = self._read_joined([sequences[i] for i in unread], unread)
        self.model.select_rows(self.state, others)
        self.model.add_rows(self.state, joined, self.capacity)
        place = {row: j for j, row in enumerate(others + unread)}
        self.model.select_rows(self.state, [place[i] for i in range(len(sequences))])

    def _read_joined(self, prompts: list[list[int]], rows: list[int]):
        """A state of its own holding these rows' prompts, read."""
        return prefill(self.model, prompts, max(map(len, prompts)))

    @staticmethod
    def _confidence(logits, drafted, q, draws) -> list[float]:
        """The draft's probability of each row's token: q(token) for sampled rows, the
        highest softmax probability for greedy ones."""
        greedy = logits.float().softmax(-1).amax(-1)
        if q is None:
            return greedy.tolist()
        drawn = q.gather(1, drafted[:, None])[:, 0]
        return torch.where(torch.tensor(draws, device=logits.device), drawn, greedy).tolist()

    def commit(self, sequences: list[list[int]]) -> None:
        # The draft has seen the old committed prefix plus all its drafts but the last; keep
        # the part that the new committed sequence still starts with (after a tree: none).
        fed = self._tokens.tolist()
        keep = []
        for n, seq, drafts in zip(self._committed, sequences, fed):
            same = 0
            while same < self._drafted - 1 and n + same < len(seq) and seq[n + same] == drafts[same]:
                same += 1
            keep.append(n + same)
        self.model.rollback(self.state, keep)

    def probe(self, sequences: list[list[int]]) -> None:
        """One drafting forward over these rows, then forgotten: what the cost probe times."""
        lengths = list(self.state.lengths)
        self._run(torch.tensor([[row[-1]] for row in sequences], device=self.model.device))
        self.model.rollback(self.state, lengths)


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
