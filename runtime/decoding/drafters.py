"""Drafters propose a token tree; the target verifies it. One small protocol, several proposers.

State ownership: the engine owns the committed token list and passes it in; a draft-model drafter
owns its draft KV cache, whose `length` is how many committed tokens it has already consumed
(tree rows it adds while drafting are rolled back before `propose` returns).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..contract.drafting import NgramConfig
from ..contract.errors import InputError
from ..contract.topology import Topology, path_from_root
from ..execution.features import draft_inputs
from ..execution.model import commit, prefill
from ..execution.runner import Cache, Runner
from .sampling import Sampler
from .tree import Tree


class Drafter(Protocol):
    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        """A tree of at most `max_nodes` nodes whose root is committed[-1], shaped as (a subset closed
        under parents of) the drafter's topology. With a sampler, a drafter that has a distribution
        draws children from it without replacement and returns it as tree.q_draft.
        `target_features` [len(committed) - 1, hidden]: the target's final hidden state at every
        committed token but the newest, for a draft that reads them (None when the target keeps none)."""

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        """The tokens committed by the last step (accepted drafts and the bonus token), and the tree
        that was verified with the target's logits at its nodes (None after prefill)."""

    def rewind(self, length: int) -> None:
        """Forget every committed token from index `length` on (a new turn edited the context)."""


class NoDrafter:
    """Plain decoding: the tree is the root alone."""

    def __init__(self):
        self.root = Topology((-1,))  # one for every step: its depths and masks are computed once

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        return Tree(self.root, np.array([committed[-1]], dtype=np.int64))

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass


def grow_tree(topology: Topology, root: int, candidates) -> Tree:
    """Fills the topology level by level: node i's children take the first len(children) tokens of
    candidates(path tokens from root to i). Children without a candidate are dropped with their
    subtrees, so the tree shrinks when the drafter has nothing to say."""
    parents, tokens, kept = [-1], [root], {0: 0}
    for level in topology.levels[1:]:
        by_parent: dict[int, list[int]] = {}
        for node in level:
            by_parent.setdefault(topology.parents[node], []).append(node)
        for parent, kids in by_parent.items():
            if parent not in kept:
                continue
            path = [tokens[i] for i in path_from_root(parents, kept[parent])]
            for node, token in zip(kids, candidates(path, len(kids))):
                kept[node] = len(tokens)
                parents.append(kept[parent])
                tokens.append(token)
    return Tree.from_parents(tuple(parents), tokens)


class NgramDrafter:
    """Prompt lookup: continue the current suffix the way it continued earlier in the context.

    An index from every n-gram (n = min_n..max_n) to the positions that followed it keeps each
    lookup O(1); siblings are the distinct continuations, most recent first.

    With `partial_match_depth`, the tree is cut at that depth unless the context's last max_n tokens
    occurred before. Such a full match means the answer is quoting, and a quote goes on for many
    tokens; a shorter match is right less often, so its deep nodes would cost more than they bring
    (benchmarks/history.md §32).
    """

    def __init__(self, topology: Topology, max_n: int = 3, min_n: int = 2, partial_match_depth: int | None = None):
        self.topology = topology
        self.max_n, self.min_n = max_n, min_n
        # the tree drafted without a full match: the whole topology, or its top levels
        self.partial_topology = topology if partial_match_depth is None else topology.within_depth(partial_match_depth)
        self.context: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}

    @classmethod
    def from_config(cls, topology: Topology, config: NgramConfig) -> "NgramDrafter":
        return cls(topology, config.max_n, config.min_n, config.partial_match_depth)

    def _index_upto(self, committed: list[int]) -> None:
        # maps each n-gram ending at p - 1 to p, the position of the token that followed it
        for p in range(len(self.context), len(committed)):
            self.context.append(committed[p])
            for n in range(self.min_n, self.max_n + 1):
                if p - n >= 0:
                    self.index.setdefault(tuple(self.context[p - n : p]), []).append(p)

    def candidates(self, path: list[int], k: int) -> list[int]:
        """Up to k tokens that followed (committed context + path) before; path starts at the root."""
        seq_tail = (self.context[-self.max_n - 1 : -1] + list(path))[-self.max_n :]
        found: list[int] = []
        for n in range(min(self.max_n, len(seq_tail)), self.min_n - 1, -1):
            for p in reversed(self.index.get(tuple(seq_tail[-n:]), ())):
                token = self.context[p]
                if token not in found:
                    found.append(token)
                    if len(found) == k:
                        return found
        return found

    def full_match(self) -> bool:
        """Whether the indexed context's last max_n tokens occurred earlier in it."""
        return len(self.context) > self.max_n and tuple(self.context[-self.max_n:]) in self.index

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        # Proposals are deterministic: under sampling they are point masses (tree.q_draft stays None).
        # Indexing the root maps the n-grams ending just before it; the n-gram ending at the root has
        # no continuation yet, so a lookup never finds its own position.
        return grow_tree(self.step_topology(committed).prefix(max_nodes), committed[-1], self.candidates)

    def step_topology(self, committed: list[int]) -> Topology:
        """Indexes the committed tokens; the topology to fill this step: whole on a full match, else cut."""
        self._index_upto(committed)
        return self.topology if self.full_match() else self.partial_topology

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        pass

    def rewind(self, length: int) -> None:
        if length < len(self.context):
            self.context, self.index = [], {}  # rebuilt lazily by the next propose


def catch_up(runner: Runner, cache: Cache, committed: list[int], chunk: int,
             target_features: np.ndarray | None) -> np.ndarray:
    """Feeds the draft the committed tokens it has not seen; returns the newest one's logits.

    A draft that reads features (EAGLE-style) pairs token i with the target's feature at i - 1, the
    state from which the target predicted token i (zeros at position 0). Tokens past the rows the target
    has computed (drafted ahead while the target verifies: runtime/decoding/overlap.py) take the draft's own
    prediction of that feature instead, as tree nodes do while drafting deeper: one token per pass."""
    start = cache.length
    if not runner.reads_features:
        return prefill(runner, cache, committed[start:], chunk)
    if target_features is None:
        raise InputError("this draft reads the target's features, but the target cache keeps none: "
                         "the bundle's target graph must return `features_out`")
    known = min(len(committed), len(target_features) + 1)  # tokens [0, known) have the target's feature
    logits = None
    if start < known:
        logits = prefill(runner, cache, committed[start:known], chunk, draft_inputs(target_features, start, known))
    for i in range(max(start, known), len(committed)):
        logits = prefill(runner, cache, committed[i : i + 1], 1, cache.features[i - 1 : i].copy())
    return logits


def own_features(cache: Cache, committed_len: int, fed: list[int], nodes) -> np.ndarray | None:
    """The draft's own output features at the parents of a level of tree nodes: a drafted token has
    no target feature yet, so (as in EAGLE) the draft's prediction of it stands in. `nodes` are parent
    node ids: 0 is the root (the newest committed row), others are rows fed while drafting."""
    if cache.features is None:
        return None
    rows = [committed_len - 1 if node == 0 else committed_len + fed.index(node) for node in nodes]
    return cache.features[rows]


class ModelDrafter:
    """A draft model proposes the top-k tokens of its own distribution at every node."""

    def __init__(self, runner: Runner, cache: Cache, topology: Topology, prefill_chunk: int):
        self.runner, self.cache, self.topology, self.chunk = runner, cache, topology, prefill_chunk

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        cache, topo = self.cache, self.topology.prefix(max_nodes)
        # 1. catch up on committed tokens the draft has not seen (prompt, accepted tokens, bonus)
        logits = catch_up(self.runner, cache, committed, self.chunk, target_features)
        committed_len = cache.length
        # 2. expand level by level; tree rows live in the cache only until we return
        tokens = np.zeros(topo.size, dtype=np.int64)
        tokens[0] = committed[-1]
        q_draft = None if sampler is None else np.zeros((topo.size, len(logits)))
        node_logits = {0: logits}
        fed: list[int] = []  # tree nodes whose rows are in the cache, in row order
        try:  # tree rows leave the draft cache however drafting ends
            for depth, level in enumerate(topo.levels[1:], start=1):
                for parent in {topo.parents[n] for n in level}:
                    kids = list(topo.children[parent])
                    if sampler is None and len(kids) == 1:  # a chain's: one argmax, not a partition of the vocabulary
                        tokens[kids] = node_logits[parent].argmax()
                    elif sampler is None:  # greedy: the draft's top tokens, most likely first
                        top = np.argpartition(-node_logits[parent], len(kids))[: len(kids)]
                        tokens[kids] = top[np.argsort(-node_logits[parent][top], kind="stable")]
                    else:
                        path = [int(tokens[i]) for i in topo.path_to(parent)[1:]]
                        q_draft[parent] = sampler.distributions(node_logits[parent][None], committed, [path])[0]
                        drawn = sampler.draw_distinct(q_draft[parent], len(kids), len(committed) + len(path))
                        drawn += [drawn[-1]] * (len(kids) - len(drawn))  # support smaller than the fan-out
                        tokens[kids] = drawn
                if depth == topo.max_depth:
                    break
                level = list(level)
                anc = topo.ancestor_mask
                past_mask = np.concatenate([np.ones((len(level), committed_len), bool),
                                            anc[np.ix_(level, fed)]], axis=1)
                root_position = committed_len - 1
                features = own_features(cache, committed_len, fed, [topo.parents[n] for n in level])
                out = self.runner.forward(cache, tokens[level], root_position + topo.depths[level],
                                          anc[np.ix_(level, level)], range(len(level)), past_mask=past_mask,
                                          features=features, exact_rows=False)
                commit(cache, out, range(len(level)))
                fed += level
                node_logits.update(zip(level, out.logits))
        finally:
            cache.trim(committed_len)
        return Tree(topo, tokens, q_draft)

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        pass

    def rewind(self, length: int) -> None:
        self.cache.trim(min(self.cache.length, length))


def new_recycling_table(vocab_size: int, width: int = 8) -> np.ndarray:
    return np.full((vocab_size, width), -1, dtype=np.int32)


class RecyclingDrafter:
    """Token Recycling: the target's own top-k candidates at every verified node, kept in an
    adjacency table token -> recent successors (vocab x width int32: 1.5 MB for 49152 x 8), and
    replayed as a tree. Optionally behind an n-gram drafter (GOOSE-style): context matches first,
    recycled candidates fill the remaining branches.

    The table outlives turns and conversations: it describes the target, not one context, so rewind
    keeps it and a pipeline shares one table among its drafters.
    """

    def __init__(self, topology: Topology, table: np.ndarray, ngram: NgramDrafter | None = None):
        """`table` [vocab, width] int32 (-1: empty), owned by the caller so that it can serve every
        conversation with the same target: see `new_recycling_table`."""
        self.topology = topology
        self.table = table
        self.width = table.shape[1]
        self.ngram = ngram

    def candidates(self, path: list[int], k: int) -> list[int]:
        found = self.ngram.candidates(path, k) if self.ngram is not None else []
        for token in self.table[path[-1]]:
            if len(found) == k or token < 0:
                break
            if int(token) not in found:
                found.append(int(token))
        return found

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        # behind an n-gram drafter the tree is cut as that drafter cuts it: recycled branches fill it
        topology = self.topology if self.ngram is None else self.ngram.step_topology(committed)
        return grow_tree(topology.prefix(max_nodes), committed[-1], self.candidates)

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        if logits is None:
            return
        k = min(self.width, logits.shape[-1] - 1)
        top = np.argpartition(-logits, k, axis=-1)[:, :k]
        order = np.argsort(-np.take_along_axis(logits, top, axis=-1), axis=-1, kind="stable")
        self.table[np.asarray(tokens)[: len(top)], :k] = np.take_along_axis(top, order, axis=-1)

    def rewind(self, length: int) -> None:
        if self.ngram is not None:
            self.ngram.rewind(length)
