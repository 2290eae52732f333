"""Prompt lookup beside a draft model (`export --lookup K`): a chain that continues the context the way
it went on after an earlier occurrence of its suffix, grafted onto the model's tree at the root."""
from __future__ import annotations

import numpy as np

from ..contract.drafting import LookupConfig
from ..contract.topology import Topology
from .drafters import Drafter, NgramDrafter
from .sampling import Sampler
from .tree import Tree


class WithLookup:
    """A draft model's tree with a prompt-lookup chain grafted on at the root; or, when the lookup drafts
    only while quoting (`config.tokens == 0`), one or the other.

    Where the answer quotes its context (code edits, rewrites, summaries) the lookup chain runs long and
    is accepted whole; elsewhere the draft model's candidates do the work. Nodes are shared where the
    chain starts with the model's own candidates, so the tree grows by at most `config.longest` nodes. Under
    sampling the lookup tokens are point masses beside the model's drawn siblings (tree.drawn), which
    the acceptance rule handles exactly (runtime/decoding/accept.py).

    A quote's chain alone, without the model's tree beside it, is one path: the target graph needs no
    lane for it (every lane's attention runs on every pass, and keeps its own copy of the context), and the
    draft model does not run while the answer quotes (it catches up on the quote in one pass afterwards).
    """

    def __init__(self, inner: Drafter, config: LookupConfig):
        self.inner, self.config = inner, config
        self.ngram = NgramDrafter.from_config(Topology(tuple(range(-1, config.longest))), config.ngram())

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        if self.config.tokens == 0:  # lookup only while quoting: the quote's chain, else the model's tree
            chain = self.ngram.propose(committed, min(max_nodes, 1 + self.config.longest), None)
            return chain if chain.size > 1 else self.inner.propose(committed, max_nodes, sampler, target_features)
        tree = self.inner.propose(committed, max_nodes, sampler, target_features)
        if tree.size >= max_nodes:
            return tree
        chain = self.ngram.propose(committed, 1 + self.config.longest, None)
        return graft_chain(tree, [int(t) for t in chain.tokens[1:]], max_nodes)

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        self.inner.observe(accepted, tokens, logits)

    def rewind(self, length: int) -> None:
        self.inner.rewind(length)
        self.ngram.rewind(length)


def graft_chain(tree: Tree, chain: list[int], max_nodes: int) -> Tree:
    """`tree` with the path root -> chain[0] -> chain[1] ... added, following existing nodes while they
    match and stopping at max_nodes. New nodes come after the old ones, so the old indices stay; they
    are point masses (not drawn from the tree's q_draft)."""
    parents, tokens = list(tree.parents), [int(t) for t in tree.tokens]
    node = 0
    for token in chain:
        child = next((c for c in tree.topology.children[node] if tokens[c] == token), None) \
            if node < tree.size else None
        if child is None:
            if len(parents) == max_nodes:
                break
            parents.append(node)
            tokens.append(token)
            child = len(parents) - 1
        node = child
    added = len(parents) - tree.size
    if tree.q_draft is None:
        return Tree.from_parents(tuple(parents), tokens)
    q_draft = np.concatenate([tree.q_draft, np.zeros((added, tree.q_draft.shape[1]))])  # point masses' parents
    drawn = np.ones(tree.size, dtype=bool) if tree.drawn is None else tree.drawn
    drawn = np.concatenate([drawn, np.zeros(added, dtype=bool)])
    return Tree(Topology(tuple(parents)), np.asarray(tokens, dtype=np.int64), q_draft, drawn)
