"""Token trees: explicit data, and the static topologies a bundle is exported with.

A tree has N nodes in topological order (a parent always precedes its children); node 0 is the last
committed token and has parent -1. Children of one parent are ordered by sibling rank: the drafter
puts its most likely token first. A *topology* (the parents array) is fixed at export; a `Tree`
carries the tokens of one step on that topology.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract.topology import Topology


@dataclass(frozen=True, eq=False)
class Tree:
    """One step's candidate tokens laid on a topology."""

    topology: Topology
    tokens: np.ndarray  # [N] int64; tokens[0] is the last committed token
    # q_draft[u]: the distribution node u's children were drawn from, without replacement (sampling
    # with a draft model); None when the proposals are deterministic (point masses)
    q_draft: np.ndarray | None = None
    # drawn[v]: node v was drawn from q_draft[parent(v)]; False: a point mass beside the drawn siblings
    # (a prompt-lookup token). None: every node is drawn when q_draft is set, none when it is not.
    drawn: np.ndarray | None = None

    @classmethod
    def from_parents(cls, parents: tuple[int, ...], tokens) -> "Tree":
        return cls(Topology(tuple(parents)), np.asarray(tokens, dtype=np.int64))

    def path(self, node: int) -> list[int]:
        """The tokens from the root's child down to `node` itself."""
        return [int(self.tokens[i]) for i in self.topology.path_to(node)[1:]]

    def paths(self) -> list[list[int]]:
        """path(node) for every node."""
        return [self.path(node) for node in range(self.size)]

    def within_paths(self, count: int) -> "Tree":
        """The nodes on the first `count` root-to-leaf paths in depth-first order, most likely sibling
        first: every node keeps a prefix of its children, so sampled siblings stay a prefix of their draws
        and acceptance stays exact. A verifying pass runs a lane per path (runtime/execution/model.py)."""
        topo = self.topology
        if topo.leaves <= count:
            return self
        keep, leaves, stack = [], 0, [0]
        while stack and leaves < count:
            node = stack.pop()
            keep.append(node)
            kids = topo.children[node]
            leaves += not kids
            stack.extend(reversed(kids))
        return self.subset(sorted(keep))

    def subset(self, keep: list[int]) -> "Tree":
        """The nodes `keep` (ascending, closed under parents, 0 included), with their tokens and proposals."""
        if len(keep) == self.size:
            return self
        topo = self.topology
        index = {node: i for i, node in enumerate(keep)}
        parents = tuple(-1 if node == 0 else index[topo.parents[node]] for node in keep)
        return Tree(Topology(parents), self.tokens[keep],
                    None if self.q_draft is None else self.q_draft[keep],
                    None if self.drawn is None else self.drawn[keep])

    def after(self, root: int, chain: list[int]) -> "Tree":
        """This tree hung below a chain of point masses from `root` through `chain` (whose last token is this
        tree's root): the grammar's forced tokens, then the drafter's tree."""
        k = len(chain)
        parents = tuple(range(-1, k)) + tuple(p + k for p in self.parents[1:])
        tokens = np.concatenate([np.asarray([root, *chain[:-1]], dtype=np.int64), self.tokens])
        if self.q_draft is None:
            return Tree(Topology(parents), tokens)
        q_draft = np.concatenate([np.zeros((k, self.q_draft.shape[1])), self.q_draft])
        drawn = np.ones(self.size, dtype=bool) if self.drawn is None else self.drawn
        return Tree(Topology(parents), tokens, q_draft, np.concatenate([np.zeros(k + 1, dtype=bool), drawn[1:]]))

    @property
    def parents(self) -> tuple[int, ...]:
        return self.topology.parents

    @property
    def size(self) -> int:
        return self.topology.size


