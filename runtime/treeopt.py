"""Choosing a static tree from measured acceptance and measured cost (Sequoia's dynamic program).

Model: a node drafted as its parent's r-th candidate (rank r = 0, 1, ...) is accepted, given its
parent was, with probability accept[r], independently of depth. The expected number of tokens one
target pass yields from a tree T is 1 (the bonus token) plus the sum over non-root nodes v of the
product of accept[rank(u)] along the path to v. For every node count N the program finds the tree
maximizing that expectation; the best N maximizes expected tokens / measured pass time t(N).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .tree import Topology


@dataclass(frozen=True)
class TreeChoice:
    topology: Topology
    expected_tokens: float  # per target pass, bonus token included
    pass_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.pass_seconds


def best_trees(accept: np.ndarray, max_nodes: int) -> list[tuple[float, Topology]]:
    """For N = 1..max_nodes: (expected tokens per pass, the best tree of N nodes)."""
    accept = [float(a) for a in accept]
    ranks = len(accept)

    @lru_cache(maxsize=None)
    def children(n: int, rank: int) -> tuple[float, tuple]:
        """Best value of spending at most n nodes on the subtrees of one node's candidates of rank
        `rank` and after. Returns (value, ((subtree size, subtree plan), ...))."""
        best = (0.0, ())  # no more children: a drafter fills ranks in order, so none can be skipped
        if n == 0 or rank == ranks:
            return best
        for size in range(1, n + 1):
            sub_value, sub_plan = subtree(size)
            rest_value, rest_plan = children(n - size, rank + 1)
            value = accept[rank] * sub_value + rest_value
            if value > best[0] + 1e-12:
                best = (value, ((size, sub_plan),) + rest_plan)
        return best

    @lru_cache(maxsize=None)
    def subtree(n: int) -> tuple[float, tuple]:
        """A subtree of n nodes rooted at an accepted candidate: 1 token plus its descendants' value."""
        value, plan = children(n - 1, 0)
        return 1.0 + value, plan

    out = []
    for n in range(1, max_nodes + 1):
        value, plan = children(n - 1, 0)
        out.append((1.0 + value, Topology(_parents(plan))))
    return out


def _parents(plan: tuple) -> tuple[int, ...]:
    """Turns a plan ((size, subplan), ...) for the root's children into a topologically ordered
    parents array, breadth first so that ranks stay in order among siblings."""
    parents = [-1]
    queue = [(0, plan)]
    while queue:
        node, child_plans = queue.pop(0)
        for _, sub in child_plans:
            parents.append(node)
            queue.append((len(parents) - 1, sub))
    return tuple(parents)


def choose_tree(accept: np.ndarray, pass_seconds: dict[int, float]) -> tuple[TreeChoice, TreeChoice]:
    """The best tree over the measured node counts, and the best chain (for comparison).
    pass_seconds[n]: the measured time of one step (draft + verify) with an n-node tree."""
    max_nodes = max(pass_seconds)
    trees = best_trees(accept, max_nodes)
    tree = max((TreeChoice(t, value, pass_seconds[t.size]) for n, (value, t) in enumerate(trees, start=1)
                if n in pass_seconds and t.size in pass_seconds), key=lambda c: c.tokens_per_s)
    chains = []
    for n in pass_seconds:
        value = 1.0 + sum(float(accept[0]) ** d for d in range(1, n))
        chains.append(TreeChoice(Topology(tuple(range(-1, n - 1))), value, pass_seconds[n]))
    return tree, max(chains, key=lambda c: c.tokens_per_s)
