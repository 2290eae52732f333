"""Choosing a static tree from measured acceptance and measured cost (Sequoia's dynamic program).

Model: a node at depth d drafted as its parent's r-th candidate (rank r = 0, 1, ...) is the target's
choice, given its parent was accepted, with probability accept[d - 1, r]; depths beyond the measured
rows take the deepest row. Ranks are disjoint events (the target picks one token), so the expected
number of tokens one target pass yields from a tree T is

    E[T] = 1 + sum over non-root nodes v of  prod over the path root -> v of accept[depth(u) - 1, rank(u)]

(1 for the bonus token). Acceptance depends on depth because a draft reading its own guesses drifts
(falling rows) while a context match that held so far tends to go on holding (rising rows).

Cost: a step with a tree of n nodes, depth L and B leaves costs
pass(n) + (B - 1) * leaf(n) + L * draft_level: the target verifies all n nodes at once, each
root-to-leaf path attending in a sequence of its own (which copies the past values once more per
leaf), and the drafter expands one level at a time. So the program finds, for every node count n and
depth limit L, the tree maximizing E[T]; the choice maximizes E[T] / cost over those trees.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..contract.errors import InputError
from ..contract.topology import Topology


@dataclass(frozen=True)
class TreeChoice:
    topology: Topology
    expected_tokens: float  # per target pass, bonus token included
    step_seconds: float     # target pass plus drafting

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.step_seconds


def _rates(accept) -> np.ndarray:
    """accept as [depth, rank] (a 1-D array: the same rates at every depth)."""
    rates = np.atleast_2d(np.asarray(accept, dtype=float))
    if rates.size == 0 or (rates < 0).any() or (rates > 1).any():
        raise InputError("acceptance rates must be probabilities, one row per depth")
    return rates


def best_trees(accept, max_nodes: int) -> dict[tuple[int, int], tuple[float, Topology]]:
    """For every node budget n = 1..max_nodes and depth limit L = 0..n-1: (E[T], the best tree with
    at most n nodes and at most L levels below the root)."""
    rates = _rates(accept)
    rows, ranks = rates.shape

    def rate(depth: int, rank: int) -> float:
        return float(rates[min(depth, rows) - 1, rank])

    @lru_cache(maxsize=None)
    def children(n: int, depth: int, rank: int, room: int) -> tuple[float, tuple]:
        """Best value of at most n nodes spent on one node's candidates of rank `rank` and after, at
        `depth`, whose subtrees span at most `room` levels (these children's included).
        Returns (value, ((subtree size, subtree plan), ...))."""
        best = (0.0, ())  # no more children: a drafter fills ranks in order, so none can be skipped
        if n == 0 or rank == ranks or room == 0:
            return best
        for size in range(1, n + 1):
            # depths past the last measured row share its rates, so they share one cache entry
            sub_value, sub_plan = children(size - 1, min(depth + 1, rows + 1), 0, room - 1)
            rest_value, rest_plan = children(n - size, depth, rank + 1, room)
            value = rate(depth, rank) * (1.0 + sub_value) + rest_value
            if value > best[0] + 1e-12:
                best = (value, ((size, sub_plan),) + rest_plan)
        return best

    out = {}
    for n in range(1, max_nodes + 1):
        for limit in range(n):
            value, plan = children(n - 1, 1, 0, limit)
            out[n, limit] = (1.0 + value, Topology(_parents(plan)))
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


def chain_value(accept, length: int) -> float:
    """E[T] of a chain of `length` drafted tokens: 1 + sum over d of the product of the rank-0 rates to d."""
    rates = _rates(accept)
    reach, value = 1.0, 1.0
    for depth in range(1, length + 1):
        reach *= float(rates[min(depth, len(rates)) - 1, 0])
        value += reach
    return value


def choose_tree(accept, pass_seconds: dict[int, float], draft_seconds_per_level: float = 0.0,
                leaf_seconds: dict[int, float] | None = None, extra_leaves: int = 0,
                max_paths: int | None = None) -> tuple[TreeChoice, TreeChoice]:
    """The best tree over the measured node counts, and the best chain (for comparison).
    pass_seconds[n]: the measured time of one target pass over n chained nodes; leaf_seconds[n]: what
    each root-to-leaf path beyond the first adds to it; extra_leaves: paths every step adds (a lookup chain);
    max_paths: the root-to-leaf paths the target graph verifies (its lanes): a tree with more would be cut
    to its first paths at run time, so only trees that fit are candidates (a chain always is)."""
    def cost(topology: Topology) -> float:
        leaves = topology.leaves - 1 + extra_leaves
        return (pass_seconds[topology.size] + (leaf_seconds or {}).get(topology.size, 0.0) * leaves
                + draft_seconds_per_level * topology.max_depth)

    trees = best_trees(accept, max(pass_seconds))
    chains = (Topology(tuple(range(-1, n - 1))) for n in pass_seconds)
    chain = max((TreeChoice(c, chain_value(accept, c.size - 1), cost(c)) for c in chains), key=lambda c: c.tokens_per_s)
    # the program maximizes E[T] per size and depth, not counting leaves: a chain it passed over for a
    # bushier tree of the same size may still be faster once each leaf is paid for
    tree = max([TreeChoice(t, value, cost(t)) for value, t in trees.values() if t.size in pass_seconds
                and (max_paths is None or t.leaves + extra_leaves <= max_paths)] + [chain],
               key=lambda c: c.tokens_per_s)
    return tree, chain
