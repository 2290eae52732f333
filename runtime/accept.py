"""Acceptance math, pure numpy: which drafted tokens the target keeps.

Greedy verification walks the tree from the root: at each accepted node the target's own choice is
`argmax p_target[node]`; if a child carries that token, the walk moves to it, otherwise the walk stops
and the target's choice becomes the bonus token. The emitted tokens are therefore exactly the
target's argmax chain: the draft only decides how many of them one pass yields.
"""
from __future__ import annotations

import numpy as np


def accept_greedy(tokens: np.ndarray, children: tuple[tuple[int, ...], ...],
                  target_choice: np.ndarray) -> tuple[list[int], int]:
    """tokens [N]: the tree's tokens; children[i]: node i's children; target_choice [N]: the
    target's argmax at every node. Returns (accepted path of node indices, starting with the root;
    the bonus token the target chose after the path's last node)."""
    path = [0]
    node = 0
    while True:
        choice = int(target_choice[node])
        nxt = next((c for c in children[node] if int(tokens[c]) == choice), None)
        if nxt is None:
            return path, choice
        path.append(nxt)
        node = nxt
