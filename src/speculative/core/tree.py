"""Token trees: several candidate continuations of one row, verified in one target forward.

A tree draft is a list of tokens with parent indices in topological order (a parent comes
before its children); parent -1 is the row's last committed token, the root. A chain of n
tokens is the tree with parents -1, 0, ..., n-2. Cutting a tree to its first m nodes keeps
a tree (every node's parent comes before it), which is how a node budget applies.

The verify forward feeds node 0 = the last committed token, then the drafted nodes 1..N.
Node i sees the committed prefix and its own ancestors only (an ancestor mask), at position
prefix + depth(i): siblings share a position, so each root-to-leaf path is scored exactly
as if it had been fed alone. After acceptance the accepted path's cache entries are moved
into place (the model's `compact`), and everything else is dropped.

Lookup sources build their trees from matched continuations (`from_branches`); a draft
model or head grows its own, one draft forward per depth (`expand_tree`).
"""

from __future__ import annotations

import heapq
import warnings
from dataclasses import dataclass

import torch


@dataclass
class Tree:
    # Drafted tokens, in topological order.
    tokens: list[int]
    # Index of each token's parent in `tokens`; -1: the last committed token.
    parents: list[int]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a tree needs one parent per token, got {len(self.tokens)} tokens and "
                             f"{len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"tree node {i} has parent {parent}; allowed -1..{i - 1} (topological order)")

    @classmethod
    def chain(cls, tokens: list[int]) -> "Tree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> "Tree":
        """The first n nodes: still a tree."""
        return Tree(self.tokens[:n], self.parents[:n])

    def depths(self) -> list[int]:
        """Depth of every node (children of the root: 1)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (-1: the empty path)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def children(self) -> list[list[int]]:
        """Per input row (0 = the root, i + 1 = node i), its children, in order."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return out


def from_branches(branches: list[list[int]], top_k: int, max_nodes: int, max_depth: int) -> Tree:
    """Merge candidate continuations into one tree: shared prefixes become one path, and
    nodes are taken best first by how many branches pass through them (ties: the branch
    listed first), at most `top_k` children per node, `max_nodes` nodes, `max_depth` deep."""
    trie: list[dict] = [{"children": {}, "count": 0, "first": -1}]  # node 0: the root
    for rank, branch in enumerate(branches):
        node = 0
        for token in branch[:max_depth]:
            child = trie[node]["children"].get(token)
            if child is None:
                child = len(trie)
                trie.append({"children": {}, "count": 0, "first": rank, "token": token, "node": node})
                trie[node]["children"][token] = child
            trie[child]["count"] += 1
            node = child
    tree = Tree([], [])
    index = {0: -1}  # trie node -> tree node
    frontier: list[tuple[int, int, int]] = []

    def offer(node: int) -> None:
        kids = sorted(trie[node]["children"].values(), key=lambda c: (-trie[c]["count"], trie[c]["first"]))
        for child in kids[:top_k]:
            heapq.heappush(frontier, (-trie[child]["count"], trie[child]["first"], child))

    offer(0)
    while frontier and len(tree) < max_nodes:
        _, _, node = heapq.heappop(frontier)
        index[node] = len(tree)
        tree.tokens.append(trie[node]["token"])
        tree.parents.append(index[trie[node]["node"]])
        offer(node)
    return tree


@dataclass
class Candidate:
    token: int
    score: float  # log q of the path from the root to here (the product of the draft's q)
    parent: int  # index of the parent candidate; -1: the root
    depth: int
    fed: int = -1  # where the draft read it, among the nodes it read (-1: not read)


def expand_tree(root_logits: torch.Tensor, forward, limits: list[int], top_k: int, max_nodes: int,
                starts: list[int], vocab: torch.Tensor | None = None) -> list[Tree]:
    """A draft model's tree, EAGLE-2's way (arXiv 2406.16858): one draft forward per depth.

    Candidates are the top_k tokens after each read node, scored by their path's draft
    probability. Per depth the draft reads the top_k best candidates of the deepest layer
    (every row the same number, so their slots line up), each seeing the committed text and
    its ancestors only (a tree mask over the nodes read so far), and their top_k children
    become the next layer. Row b's tree is then its max_nodes best candidates no deeper than
    limits[b]: a path's score never grows along it, so a node's parent always ranks before
    it, and the order is topological.

    root_logits (B, V): the draft's logits after each row's last committed token.
    `forward(tokens, parents, positions, mask)` reads tokens (B, k), children of the nodes read
    before at `parents` (B, k) (-1: the root), at `positions` (B, k), seeing `mask` (B, k, F + k)
    of the F nodes read before and themselves; returns their logits (B, k, V). starts[b]: the
    position of row b's first drafted token. `vocab`: the ids of the logits' columns (a
    reduced draft vocabulary; None: the column is the id).
    """
    batch, device = len(limits), root_logits.device
    top_k = min(top_k, root_logits.shape[-1])
    ids = None if vocab is None else vocab.tolist()
    rows: list[list[Candidate]] = [[] for _ in range(batch)]
    layer = add_children(rows, root_logits[:, None], [[-1]] * batch, top_k, ids)
    read = 0
    for depth in range(1, max(limits)):  # read the best of this depth; their children are the next
        chosen = [sorted(nodes, key=lambda i: -row[i].score)[:top_k] for row, nodes in zip(rows, layer)]
        parents, mask = feed_layer(rows, chosen, read, top_k)
        tokens = torch.tensor([[row[i].token for i in nodes] for row, nodes in zip(rows, chosen)], device=device)
        positions = (torch.tensor(starts, device=device)[:, None] + depth - 1).expand(batch, top_k)  # start + d - 1
        logits = forward(tokens, torch.tensor(parents, device=device).view(batch, top_k), positions,
                         mask.to(device))
        read += top_k
        layer = add_children(rows, logits, chosen, top_k, ids)
    return [best_tree(row, limit, max_nodes) for row, limit in zip(rows, limits)]


def add_children(rows: list[list[Candidate]], logits: torch.Tensor, parents: list[list[int]], top_k: int,
                 ids: list[int] | None) -> list[list[int]]:
    """Each parent's top_k children as candidates (logits (B, parents, V)); per row, the
    indices of the new ones."""
    scores, tokens = logits.float().log_softmax(-1).topk(top_k, -1)
    layer = []
    for b, (row, row_parents) in enumerate(zip(rows, parents)):
        first = len(row)
        for parent, p_scores, p_tokens in zip(row_parents, scores[b].tolist(), tokens[b].tolist()):
            base, depth = (0.0, 1) if parent < 0 else (row[parent].score, row[parent].depth + 1)
            for score, token in zip(p_scores, p_tokens):
                row.append(Candidate(token if ids is None else ids[token], base + score, parent, depth))
        layer.append(list(range(first, len(row))))
    return layer


def feed_layer(rows: list[list[Candidate]], chosen: list[list[int]], read: int, top_k: int):
    """The chosen candidates as the draft's next input, after the `read` nodes it has read:
    per candidate where its parent was read (-1: the root), and the tree mask (B, top_k,
    read + top_k) of its ancestors and itself. Marks where each is read."""
    mask = torch.zeros(len(rows), top_k, read + top_k, dtype=torch.bool)
    parents = []
    for b, (row, nodes) in enumerate(zip(rows, chosen)):
        for j, i in enumerate(nodes):
            ancestor = row[i].parent
            parents.append(-1 if ancestor < 0 else row[ancestor].fed)
            while ancestor >= 0:
                mask[b, j, row[ancestor].fed] = True
                ancestor = row[ancestor].parent
            mask[b, j, read + j] = True
            row[i].fed = read + j
    return parents, mask


def best_tree(row: list[Candidate], max_depth: int, max_nodes: int) -> Tree:
    """A row's max_nodes best candidates no deeper than max_depth, parents before children."""
    ranked = sorted((i for i, c in enumerate(row) if c.depth <= max_depth),
                    key=lambda i: (-row[i].score, row[i].depth, i))[:max_nodes]
    place = {-1: -1}
    for i in ranked:
        place[i] = len(place) - 1
    return Tree([row[i].token for i in ranked], [place[row[i].parent] for i in ranked])


def tree_inputs(trees: list[Tree], last_tokens: list[int], starts: list[int], device):
    """The verify forward's inputs for a batch of trees (ragged: padded to the largest).

    Returns tokens (B, 1+N) (the last committed token, then the nodes), positions (B, 1+N)
    = start + depth, the ancestor mask (B, 1+N, 1+N) (row t sees column j when j is t or one
    of its ancestors; node 0 sees itself) and the nodes per row, 1 + len(tree).
    """
    width = 1 + max(map(len, trees))
    tokens, positions, masks = [], [], []
    for tree, last, start in zip(trees, last_tokens, starts):
        pad = width - 1 - len(tree)
        tokens.append([last] + tree.tokens + [0] * pad)
        positions.append([start] + [start + d for d in tree.depths()] + [start] * pad)
        seen = [1 << 0]  # bit j: sees column j
        for i, parent in enumerate(tree.parents):
            seen.append(seen[parent + 1] | 1 << (i + 1))  # what its parent sees, and itself
        seen += [1 << j for j in range(len(seen), width)]  # padding sees itself
        masks.append([[bool(row >> j & 1) for j in range(width)] for row in seen])
    mask = torch.tensor(masks, dtype=torch.bool)  # (B, 1+N, 1+N)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.long, device=device)  # noqa: E731
    return as_tensor(tokens), as_tensor(positions), mask.to(device), [1 + len(t) for t in trees]


def can_branch(target, proposer, top_k: int, branches: bool) -> bool:
    """Whether an engine can draft trees with these (`branches`: whether the proposer drafts
    trees, proposers.base.branches); if not, it says so once, here, and drafts chains
    (recurrent models cannot branch in one forward)."""
    why = None
    if not callable(getattr(target, "compact", None)):  # optional in the model protocol
        why = (f"the target {type(target).__name__} cannot verify token trees (recurrent models cannot branch in "
               "one forward)")
    elif not branches:
        model = proposer.model
        why = (f"the draft {type(proposer).__name__} drafts chains only" if model is None else
               f"the draft model {type(model).__name__} cannot read token trees (recurrent models cannot branch in "
               "one forward)")
    if why is None:
        return True
    warnings.warn(f"tree_top_k={top_k}: {why}; this engine drafts chains", UserWarning, stacklevel=3)
    return False
