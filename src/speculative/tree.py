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


def can_branch(target, proposer, top_k: int) -> bool:
    """Whether an engine can draft trees with these; if not, it says so once, here, and
    drafts chains (recurrent models cannot branch in one forward)."""
    why = None
    if not callable(getattr(target, "compact", None)):
        why = (f"the target {type(target).__name__} cannot verify token trees (recurrent models cannot branch in "
               "one forward)")
    elif not getattr(proposer, "branches", False):
        why = f"the draft {type(proposer).__name__} drafts chains only (trees come from lookup sources)"
    elif getattr(proposer, "reads_features", False):
        why = "a draft head reads the target's features, which tree steps do not hand over yet"
    if why is None:
        return True
    warnings.warn(f"tree_top_k={top_k}: {why}; this engine drafts chains", UserWarning, stacklevel=3)
    return False
