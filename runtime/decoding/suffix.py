"""Suffix drafting (SuffixDecoding, arXiv 2411.04975): continue the text the way it went on after the
longest earlier occurrence of its own suffix, in this conversation or in earlier outputs.

Two token stores are searched alike: the conversation (prompt and output: `SuffixDrafter` keeps it in
step with the committed tokens) and `SuffixStore`, a bounded store of earlier outputs that outlives
requests (the pipeline owns one per bundle, as it owns Token Recycling's table). Both are flat int32
arrays searched with numpy, with no index: a match is found by filtering the positions that end in the
suffix's last token, then its second to last, and so on, so each step costs O(tokens) vector work and
the stores cost 4 bytes a token (`SuffixStore.nbytes`, counted in the memory budget).

The occurrences of the longest match (up to `max_pattern` tokens) vote: their continuations form a
trie whose counts estimate each next token's probability, and the tree grows greedily by estimated
probability (the paper's scoring), at most `spec_factor` x the match length nodes: a long match is a
quote, and a quote goes on. Proposals are point masses (under sampling `tree.q_draft` stays None).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..contract.drafting import SuffixConfig
from .sampling import Sampler
from .tree import Tree

SEPARATOR = -1  # between sequences of a store: no match or continuation runs across it
MAX_OCCURRENCES = 32  # the most recent occurrences of a match that vote on its continuation


class TokenArray:
    """A growing int32 array of tokens (amortised appends), searched for earlier occurrences of a suffix."""

    def __init__(self, capacity: int = 256):
        self.data = np.empty(max(16, capacity), dtype=np.int32)
        self.length = 0

    @property
    def tokens(self) -> np.ndarray:
        return self.data[: self.length]

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.length + len(tokens) > len(self.data):
            grown = np.empty(max(2 * len(self.data), self.length + len(tokens)), dtype=np.int32)
            grown[: self.length] = self.tokens
            self.data = grown
        self.data[self.length : self.length + len(tokens)] = tokens
        self.length += len(tokens)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def drop_front(self, count: int) -> None:
        kept = self.tokens[count:].copy()
        self.data[: len(kept)] = kept
        self.length = len(kept)

    def matches(self, suffix: np.ndarray, end: int, max_pattern: int) -> tuple[np.ndarray, int]:
        """The positions p < `end` whose preceding tokens end with the longest part of `suffix` found (at
        most max_pattern tokens), and that length m: tokens[p - m : p] == suffix[-m:]. p is where the
        continuation starts; p == end (the suffix's own place in the array) is never returned."""
        tokens = self.tokens[:end]
        if not len(suffix) or end < 2:
            return np.zeros(0, dtype=np.int64), 0
        # the one pass over the whole array; the longer matches only filter what it found
        positions = np.flatnonzero(tokens[: end - 1] == suffix[-1]) + 1
        best, length = positions, 1 if len(positions) else 0
        for back in range(2, min(max_pattern, len(suffix)) + 1):
            positions = positions[positions >= back]
            positions = positions[tokens[positions - back] == suffix[-back]]
            if not len(positions):
                break
            best, length = positions, back
        return best, length


class SuffixStore:
    """Earlier outputs of this bundle's generations, most recent last, at most `capacity` tokens (the
    oldest half goes when it fills). Owned by the caller: a pipeline keeps one for all its requests."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.array = TokenArray(capacity + 1)

    def add(self, tokens: list[int]) -> None:
        if self.capacity < 2 or not tokens:
            return
        tokens = list(tokens)[-(self.capacity - 1):]
        need = len(tokens) + 1
        if self.array.length + need > self.capacity:
            self.array.drop_front(max(self.array.length + need - self.capacity, self.array.length // 2))
        self.array.extend(tokens + [SEPARATOR])

    def clear(self) -> None:
        self.array.truncate(0)

    @property
    def nbytes(self) -> int:
        return self.array.data.nbytes


@dataclass(frozen=True)
class SuffixProposal:
    """A suffix drafter's candidates for one step: a tree of continuations with each node's estimated
    probability given its parent (`parent_probability[0]` = 1 for the root) and the match they come from."""
    tree: Tree
    parent_probability: np.ndarray
    match_length: int

    def prefix(self, drafted: int) -> Tree:
        """The tree of its first `drafted` nodes after the root (nodes come most probable first)."""
        return Tree(self.tree.topology.prefix(drafted + 1), self.tree.tokens[: drafted + 1])

    def first_path(self, length: int | None = None) -> list[int]:
        """The nodes of the most probable path (first children) from the root, at most `length` after it."""
        nodes, node = [0], 0
        while (length is None or len(nodes) <= length) and self.tree.topology.children[node]:
            node = self.tree.topology.children[node][0]
            nodes.append(node)
        return nodes

    def chain(self, length: int) -> Tree:
        """The first `length` drafted tokens along the most probable path."""
        nodes = self.first_path(length)
        return Tree.from_parents(tuple(range(-1, len(nodes) - 1)), self.tree.tokens[nodes])


def continuation_trie(sources: list[tuple[np.ndarray, np.ndarray]], depth: int) -> tuple[dict, int]:
    """The trie of the continuations (up to `depth` tokens) after each start position of each (tokens,
    starts) pair, the most recent MAX_OCCURRENCES of each: token -> [count, children], and how many
    continuations voted."""
    trie: dict[int, list] = {}
    votes = 0
    for tokens, starts in sources:
        for start in starts[-MAX_OCCURRENCES:]:
            votes += 1
            level = trie
            for token in tokens[start : start + depth].tolist():
                if token == SEPARATOR:
                    break
                node = level.setdefault(token, [0, {}])
                node[0] += 1
                level = node[1]
    return trie, votes


def grow_by_probability(root: int, trie: dict, votes: int, max_nodes: int, max_leaves: int,
                        min_probability: float) -> tuple[Tree, np.ndarray]:
    """The tree of at most `max_nodes` drafted tokens on at most `max_leaves` paths whose nodes have the
    highest estimated path probabilities (count / votes), and each node's probability given its parent.
    Nodes come out in the order they are taken: parents first, siblings most probable first."""
    parents, tokens, counts, kids = [-1], [root], [votes], [0]
    frontier = [(-node[0], i, token, node, 0) for i, (token, node) in enumerate(trie.items())]
    heapq.heapify(frontier)
    order = len(frontier)
    while frontier and len(parents) <= max_nodes:
        count, _, token, node, parent = heapq.heappop(frontier)
        if -count / votes < min_probability:
            break
        paths = max(1, sum(1 for i, k in enumerate(kids) if k == 0 and i))  # leaves so far (the root alone: 1)
        if kids[parent] and paths >= max_leaves:
            continue  # a second child opens a path the graph has no lane for
        kids[parent] += 1
        parents.append(parent)
        tokens.append(token)
        kids.append(0)
        counts.append(-count)
        for child_token, child in node[1].items():
            order += 1
            heapq.heappush(frontier, (-child[0], order, child_token, child, len(parents) - 1))
    given_parent = np.array(counts, dtype=float) / np.array([votes] + [counts[p] for p in parents[1:]], dtype=float)
    return Tree.from_parents(tuple(parents), tokens), given_parent


class SuffixDrafter:
    """Drafts by suffix match over the conversation and a store of earlier outputs (see the module's note).

    State: `conversation` mirrors the committed tokens (appended as they come, cut on rewind); the
    store belongs to the caller."""

    def __init__(self, config: SuffixConfig, store: SuffixStore | None, max_leaves: int = 1):
        self.config, self.store, self.max_leaves = config, store, max_leaves
        self.conversation = TokenArray()
        self.synced: list[int] = []  # the committed tokens `conversation` holds, to notice edits

    def _sync(self, committed: list[int]) -> None:
        n = self.conversation.length
        if n > len(committed) or committed[:n] != self.synced:
            self.conversation.truncate(0)  # an edit we were not told of (O(n) in C, far below a pass): start again
            self.synced, n = [], 0
        self.conversation.extend(committed[n:])
        self.synced.extend(committed[n:])

    def proposal(self, committed: list[int], max_nodes: int) -> SuffixProposal:
        """The candidates for the step after `committed` (its last token is the tree's root)."""
        self._sync(committed)
        config, conversation = self.config, self.conversation
        suffix = conversation.tokens[max(0, conversation.length - config.max_pattern):]
        found = [(conversation.tokens, *conversation.matches(suffix, conversation.length, config.max_pattern))]
        if self.store is not None and self.store.array.length:
            store = self.store.array
            found.append((store.tokens, *store.matches(suffix, store.length, config.max_pattern)))
        longest = max(length for _, _, length in found)
        root = committed[-1]
        budget = min(max_nodes - 1, config.max_depth, int(config.spec_factor * longest))
        if longest < config.min_match or budget < 1:
            return SuffixProposal(Tree.from_parents((-1,), [root]), np.ones(1), longest)
        trie, votes = continuation_trie([(tokens, starts) for tokens, starts, length in found if length == longest],
                                        config.max_depth)
        tree, given_parent = grow_by_probability(root, trie, votes, budget, self.max_leaves, config.min_probability)
        return SuffixProposal(tree, given_parent, longest)

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        return self.proposal(committed, max_nodes).tree

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        pass  # the committed tokens arrive with the next propose

    def rewind(self, length: int) -> None:
        self.conversation.truncate(length)
        del self.synced[length:]
