"""Acceptance math, pure numpy: which drafted tokens the target keeps.

Greedy verification walks the tree from the root: at each accepted node the target's own choice is
`argmax p_target[node]`; if a child carries that token, the walk moves to it, otherwise the walk stops
and the target's choice becomes the bonus token. The emitted tokens are therefore exactly the
target's argmax chain: the draft only decides how many of them one pass yields.

Sampled verification (SpecInfer / RSD / Sequoia, recursive rejection sampling over the tree): the
children c_1..c_k of an accepted node u were drawn from q = q_draft[u] *without replacement*, in that
order. With p = p_target[u]:

    for each child c_i (token t):
        accept c_i with probability min(1, p[t] / q[t])        -> continue the walk at c_i
        else:  p <- max(0, p - q) / sum(max(0, p - q))          (the residual)
               q <- q with t removed, renormalized              (siblings are drawn without it)
    if every child is rejected: emit a token sampled from p (the last residual)

and after an accepted leaf, the bonus token is sampled from p_target[leaf]. Each emitted token is
then distributed exactly as the target's own sampling distribution. A deterministic proposal (an
n-gram drafter, or greedy draft tokens) is a point mass: q = onehot(t), so a child is accepted with
probability p[t] and on rejection p loses t — sequential sampling of p, also exact.

Siblings may mix the two (a prompt-lookup token beside the draft model's drawn tokens, tree.drawn):
each check is the same rule with that child's own proposal — q for a drawn child, onehot(t) for a
point mass — and p stays the target's distribution given every rejection so far. The drawn
children's q loses only the drawn tokens, because only they were drawn without replacement.
"""
from __future__ import annotations

import numpy as np

from .sampling import sample


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


def accept_sampled(tokens: np.ndarray, children: tuple[tuple[int, ...], ...], p_target: np.ndarray,
                   q_draft: np.ndarray | None, rng: np.random.Generator,
                   drawn: np.ndarray | None = None) -> tuple[list[int], int]:
    """p_target [N, V]: the target's processed distribution at every node (an array, or rows computed
    when read: only the nodes the walk reaches are); q_draft [N, V]: the distribution node u's children
    were drawn from (None: every proposal is a point mass); drawn [N]: which nodes were drawn from it
    (None: all, when q_draft is set).
    Returns (accepted path of node indices from the root, the token emitted after it)."""
    path = [0]
    node = 0
    while True:
        p = p_target[node].astype(np.float64, copy=True)
        q = None if q_draft is None else q_draft[node].astype(np.float64, copy=True)
        accepted = None
        rejected: dict[int, bool] = {}  # token -> whether it was drawn from q
        for child in children[node]:
            t = int(tokens[child])
            from_q = q is not None and (drawn is None or bool(drawn[child]))
            if t in rejected:  # a repeated sibling (the draft's support was smaller than the fan-out)
                if from_q and not rejected[t]:  # skipping it would leave q's draw uncorrected
                    raise ValueError("a drawn proposal follows a point mass with the same token: "
                                     "point masses go after a node's drawn children (lookup.graft_chain)")
                continue
            rejected[t] = from_q
            q_t = q[t] if from_q else 1.0
            if q_t > 0 and rng.random() < min(1.0, p[t] / q_t):
                accepted = child
                break
            p = _residual(p, q if from_q else None, t)
            if from_q:
                q[t] = 0.0
                total = q.sum()
                q = q / total if total > 0 else q
        if accepted is None:
            return path, sample(p, rng)
        path.append(accepted)
        node = accepted


def _residual(p: np.ndarray, q: np.ndarray | None, token: int) -> np.ndarray:
    """norm(max(0, p - q)); for a point mass at `token` that is p without `token`."""
    if q is None:
        residual = p.copy()
        residual[token] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    # p == q leaves nothing to correct: any child would have been accepted, so p itself is right
    return residual / total if total > 0 else p
