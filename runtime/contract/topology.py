"""The static topologies a bundle is exported with: a token tree's shape, fixed at export.

A tree has N nodes in topological order (a parent always precedes its children); node 0 is the last
committed token and has parent -1. Children of one parent are ordered by sibling rank: the drafter
puts its most likely token first. The graph's tree mask, the manifest's `tree` and every drafter's
proposals share this shape; runtime/decoding/tree.py lays one step's tokens on it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .errors import InputError


@dataclass(frozen=True, eq=False)
class Topology:
    """A static tree shape: `parents[i]` is the parent of node i (-1 for the root)."""

    parents: tuple[int, ...]

    def __post_init__(self):
        if not self.parents or self.parents[0] != -1:
            raise InputError("a tree topology starts with the root: parents[0] must be -1")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise InputError(f"parents[{i}]={p}: a parent must be an earlier node")

    # two topologies are the same tree when their parents are (a manifest read back equals the one written)
    def __eq__(self, other) -> bool:
        return isinstance(other, Topology) and self.parents == other.parents

    def __hash__(self) -> int:
        return hash(self.parents)

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> np.ndarray:
        depths = np.zeros(self.size, dtype=np.int64)
        for i, p in enumerate(self.parents[1:], start=1):
            depths[i] = depths[p] + 1
        return depths

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """[N, N] bool: node i may attend to node j iff j is i or one of its ancestors."""
        mask = np.eye(self.size, dtype=bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[p]
        return mask

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """Nodes grouped by depth, depth 0 first."""
        return tuple(tuple(int(i) for i in np.flatnonzero(self.depths == d)) for d in range(self.max_depth + 1))

    @property
    def leaves(self) -> int:
        """Root-to-leaf paths: the sequences a verifying pass attends in (runtime/execution/model.py)."""
        return sum(1 for kids in self.children if not kids)

    @property
    def max_width(self) -> int:
        return max(len(level) for level in self.levels)

    def prefix(self, size: int) -> "Topology":
        """The first `size` nodes: parents precede children, so any prefix is itself a tree."""
        return self if size >= self.size else Topology(self.parents[: max(1, size)])

    def within_depth(self, depth: int) -> "Topology":
        """The nodes at most `depth` below the root, in their order (a subtree closed under parents)."""
        keep = [i for i in range(self.size) if self.depths[i] <= depth]
        if len(keep) == self.size:
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        return Topology(tuple(-1 if i == 0 else new_index[self.parents[i]] for i in keep))

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root to `node`, both included."""
        return path_from_root(self.parents, node)

    @cached_property
    def root_to_leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        """Every root-to-leaf path, leaves in node order: the lanes a verifying pass attends in."""
        return tuple(tuple(self.path_to(leaf)) for leaf, kids in enumerate(self.children) if not kids)

    @classmethod
    def from_ancestor_mask(cls, ancestors: np.ndarray) -> "Topology":
        """The tree whose `ancestor_mask` this is; refuses a mask that is none (a row seeing a later row,
        or rows whose visible sets are not their parent's plus themselves)."""
        n = len(ancestors)
        if ancestors.shape != (n, n) or not ancestors.diagonal().all() or np.triu(ancestors, 1).any():
            raise InputError("exact rows need an ancestor mask: each row sees itself and earlier rows only")
        parents = [-1]
        for node in range(1, n):
            seen = np.flatnonzero(ancestors[node, :node])
            if not len(seen):
                raise InputError(f"row {node} sees no earlier row: a tree has one root")
            parent = int(seen[-1])
            if not np.array_equal(ancestors[node, :node], ancestors[parent, :node] | (np.arange(node) == parent)):
                raise InputError(f"row {node} sees rows that are not the chain of its parent {parent}")
            parents.append(parent)
        return cls(tuple(parents))

    def spec(self) -> str:
        """The shortest spec `parse_tree_spec` reads back as this topology."""
        if self.size > 1 and self.parents == tuple(range(-1, self.size - 1)):
            return f"chain:{self.size - 1}"
        return "parents:" + ",".join(str(p) for p in self.parents)

    def to_dict(self) -> dict:
        return {"parents": list(self.parents), "size": self.size, "depth": self.max_depth}


def path_from_root(parents, node: int) -> list[int]:
    """The walk up a tree given by `parents` (-1 at the root): nodes from the root to `node`, both included."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


MAX_NODES = 256
_SPEC = re.compile(r"^(chain):(\d+)$|^(topk):(\d+)x(\d+)$|^(parents):(-1(?:,\d+)*)$")


def parse_tree_spec(spec: str) -> Topology:
    """`chain:K` (K draft tokens after the root), `topk:BxD` (every node branches B ways, D levels
    deep) or `parents:-1,0,0,1,...` (an explicit parents array)."""
    match = _SPEC.match(spec.strip())
    if not match:
        raise InputError(f"unknown tree spec {spec!r}: use chain:K, topk:BxD or parents:-1,0,...")
    if match.group(1):
        length = int(match.group(2))
        if not 1 <= length < MAX_NODES:
            raise InputError(f"chain:K needs 1 <= K < {MAX_NODES}")
        return Topology(tuple(range(-1, length)))
    if match.group(3):
        branch, depth = int(match.group(4)), int(match.group(5))
        if branch < 1 or depth < 1:
            raise InputError("topk:BxD needs B >= 1 and D >= 1")
        size, level = 1, 1
        for _ in range(min(depth, MAX_NODES)):
            level *= branch
            size += level
            if size > MAX_NODES:
                break
        if size > MAX_NODES:
            raise InputError(f"tree {spec} has {size} nodes; at most {MAX_NODES} are supported")
        parents, frontier = [-1], [0]
        for _ in range(depth):
            next_frontier = []
            for node in frontier:
                for _ in range(branch):
                    parents.append(node)
                    next_frontier.append(len(parents) - 1)
            frontier = next_frontier
        return Topology(tuple(parents))
    parents = tuple(int(p) for p in match.group(7).split(","))
    if len(parents) > MAX_NODES:
        raise InputError(f"the tree has {len(parents)} nodes; at most {MAX_NODES} are supported")
    return Topology(parents)
