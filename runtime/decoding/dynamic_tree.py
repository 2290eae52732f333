"""Dynamic trees (EAGLE-2 / DySpec): the draft model grows each step's tree by its own confidence.

Every candidate's score is the product of the draft's probabilities along its path. Per level, the
`width` most confident new nodes are expanded (fed to the draft for their children); drafting stops
early when no new node reaches `min_confidence` (the draft is unsure: SpecDec++/Kangaroo style). The
tree is then the `budget` most confident nodes — a set closed under parents, because a child never
scores above its parent — so verification sees at most `budget` nodes, as a static graph needs.
For the same reason a node that does not score above the budget's current cut (the (budget - 1)-th
best score so far) cannot lead to a chosen node, up to exact ties, and is not expanded: with a small
budget most draft calls deep in the tree would be wasted.

Proposals are deterministic given the draft, so under sampling they count as point masses
(tree.q_draft stays None) and verification stays exact.

State: like ModelDrafter, the draft cache holds the committed tokens it has consumed; the rows of
expanded nodes are rolled back before `propose` returns.
"""
from __future__ import annotations

import numpy as np

from ..contract.drafting import DynamicTreeConfig
from ..contract.topology import path_from_root
from ..execution.kvcache import KVCache
from ..execution.model import ModelRunner, commit
from .drafters import catch_up, own_features
from .sampling import Sampler
from .tree import Tree


def top_candidates(logits: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The `width` likeliest tokens under the draft's own distribution (softmax at temperature 1: a
    confidence, not a sampler), most likely first, and their probabilities."""
    width = min(width, len(logits))
    top = np.argpartition(-logits, width - 1)[:width]
    top = top[np.argsort(-logits[top], kind="stable")]
    shifted = logits.astype(np.float64) - float(logits[top[0]])
    return top, np.exp(shifted[top]) / np.exp(shifted).sum()


class DynamicDrafter:
    def __init__(self, runner: ModelRunner, cache: KVCache, config: DynamicTreeConfig, prefill_chunk: int):
        self.runner, self.cache, self.config, self.chunk = runner, cache, config, prefill_chunk

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        cfg, cache = self.config, self.cache
        budget = min(cfg.budget, max_nodes)
        logits = catch_up(self.runner, cache, committed, self.chunk, target_features)  # 1. catch up
        committed_len = cache.length
        parents, tokens, scores, depths = [-1], [committed[-1]], [1.0], [0]
        frontier, node_logits, fed = [0], {0: logits}, []
        try:  # tree rows leave the draft cache however drafting ends
            for depth in range(1, cfg.max_depth + 1):
                new = []  # 2. children of the frontier, scored by cumulative confidence
                for parent in frontier:
                    for token, prob in zip(*top_candidates(node_logits[parent], cfg.width)):
                        parents.append(parent), tokens.append(int(token)), depths.append(depth)
                        scores.append(scores[parent] * float(prob))
                        new.append(len(tokens) - 1)
                ranked = sorted(scores[1:], reverse=True)
                cut = ranked[budget - 2] if len(ranked) >= budget - 1 else -1.0
                # fed rows live in the draft cache until we return: near the end of the context it has room
                # for fewer than the pruning rule alone would feed (the cut bounds the tree, not the rows fed)
                expand = [n for n in sorted(new, key=lambda n: -scores[n])[: min(cfg.width, cache.room())]
                          if scores[n] >= cfg.min_confidence and scores[n] > cut]
                if budget <= 2 or not expand or depth == cfg.max_depth:
                    break
                # 3. feed the most confident new nodes; each sees the committed rows and its fed ancestors
                out = self._feed(expand, parents, tokens, fed, committed_len, depth)
                fed += expand
                node_logits.update(zip(expand, out.logits))
                frontier = expand
        finally:
            cache.trim(committed_len)
        # 4. the budget's most confident nodes, parents first
        chosen = [0] + sorted(range(1, len(tokens)), key=lambda n: (-scores[n], depths[n]))[: budget - 1]
        order = sorted(chosen, key=lambda n: (depths[n], n))
        index = {n: i for i, n in enumerate(order)}
        return Tree.from_parents(tuple(-1 if n == 0 else index[parents[n]] for n in order), [tokens[n] for n in order])

    def _feed(self, expand: list[int], parents: list[int], tokens: list[int], fed: list[int], committed_len: int,
              depth: int):
        """One draft pass over the nodes in `expand`, their rows kept after the committed and fed ones."""
        cache = self.cache
        ancestors = [set(path_from_root(parents, n)[:-1]) for n in expand]
        past_mask = np.array([[True] * committed_len + [f in anc for f in fed] for anc in ancestors])
        features = own_features(cache, committed_len, fed, [parents[n] for n in expand])
        out = self.runner.forward(cache, [tokens[n] for n in expand], [committed_len - 1 + depth] * len(expand),
                                  np.eye(len(expand), dtype=bool), range(len(expand)), past_mask=past_mask,
                                  features=features, exact_rows=False)
        commit(cache, out, range(len(expand)))
        return out

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        pass

    def rewind(self, length: int) -> None:
        self.cache.trim(min(self.cache.length, length))
