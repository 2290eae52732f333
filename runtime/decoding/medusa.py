"""Medusa drafting (Cai et al. 2024): the target's final hidden state at the newest row it computed (the row
that predicted the newest committed token) goes through K heads; head k guesses the token k + 1 places after
the root, so the tree's depth d takes head d - 1's top tokens, the same at every node of a level (Medusa's
Cartesian candidates), verified in one target pass.

State: none across steps (the heads read only that row); the engine owns the committed tokens and the target
cache's features. Proposals are point masses under sampling (tree.q_draft stays None), as prompt lookup's.
"""
from __future__ import annotations

import numpy as np

from ..contract.errors import InputError
from ..contract.topology import Topology
from ..execution.medusa_heads import MedusaHeads
from .drafters import grow_tree
from .sampling import Sampler
from .tree import Tree


class MedusaDrafter:
    def __init__(self, heads: MedusaHeads, topology: Topology):
        self.heads, self.topology = heads, topology
        self.width = max(topology.max_width, 1)

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        if target_features is None:
            raise InputError("Medusa heads read the target's features, but the target cache keeps none: "
                             "the bundle's target graph must return `features_out`")
        topology = self.topology.prefix(max_nodes)
        if len(target_features) == 0 or topology.size == 1:
            return Tree.from_parents((-1,), [committed[-1]])
        logits = self.heads.logits(target_features[-1])
        width = min(self.width, logits.shape[1])
        top = np.argpartition(-logits, width - 1, axis=1)[:, :width]
        order = np.take_along_axis(top, np.argsort(-np.take_along_axis(logits, top, axis=1), axis=1, kind="stable"), 1)
        ranked = order.tolist()  # per head, its top tokens, most likely first

        def candidates(path: list[int], k: int) -> list[int]:
            depth = len(path) - 1  # the children sit one deeper than the last node of `path`
            return ranked[depth][:k] if depth < len(ranked) else []

        return grow_tree(topology, committed[-1], candidates)

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        pass

    def rewind(self, length: int) -> None:
        pass
