"""One model's graph behind a stateless call: the caller passes tokens, positions, mask and cache."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .features import FEATURES, FEATURES_OUT
from .facts import ModelFacts
from .kvcache import KVCache

# onnxruntime's CPU matmuls (MLAS sgemm, and MatMulNBits at every accuracy level) take a separate
# single-row (GEMV) path whose rounding differs from the multi-row kernel (measured: up to ~8e-5 in
# SmolLM2's fp32 logits, more in int4). Every matmul therefore sees at least two rows — a one-token
# step gets one masked padding row, a one-row logits request a duplicate row for the head — so a
# token's logits are the same bits alone, in a prefill chunk or inside a verified tree.
MIN_ROWS = 2


@dataclass
class Pass:
    logits: np.ndarray  # [R, V] for the requested rows
    new_kv: np.ndarray  # [layers, 2, n, kv_heads, head_dim] for the n real rows
    features: np.ndarray | None = None  # [n, hidden] final hidden states, from a graph that returns them


class ModelRunner:
    def __init__(self, session: ort.InferenceSession, facts: ModelFacts, head_tokens: np.ndarray | None = None):
        """`head_tokens`: the vocabulary ids a trimmed head's logits cover; `forward` spreads them over the
        full vocabulary with -inf elsewhere, so callers never see the trimming."""
        self.session = session
        self.facts = facts
        self.head_tokens = head_tokens
        self.reads_features = FEATURES in {i.name for i in session.get_inputs()}
        self.gives_features = FEATURES_OUT in {o.name for o in session.get_outputs()}
        self.outputs = ["logits", "new_kv"] + [FEATURES_OUT] * self.gives_features

    def forward(self, cache: KVCache, tokens, positions, tree_mask: np.ndarray, logit_rows,
                past_mask: np.ndarray | None = None, features: np.ndarray | None = None,
                exact_rows: bool = True) -> Pass:
        """Runs n new tokens after the cache's valid rows (which it does not modify).

        tree_mask [n, n]: which new tokens each new token may see (itself included);
        past_mask [n, cache.length]: which cached rows it may see (default: all);
        features [n, hidden]: for a graph that reads them, the features that go with each new token;
        exact_rows: see pass_feed.
        """
        feed, n, wanted = pass_feed(cache, tokens, positions, tree_mask, logit_rows, past_mask, exact_rows)
        if self.reads_features:
            feed[FEATURES] = padded_features(features, feed["input_ids"].shape[1], self.facts.hidden_size)
        values = self.session.run(self.outputs, feed)
        logits, new_kv = values[0], values[1]
        logits = logits[0, : len(wanted)]
        if self.head_tokens is not None:
            full = np.full((len(wanted), self.facts.vocab_size), -np.inf, dtype=logits.dtype)
            full[:, self.head_tokens] = logits
            logits = full
        return Pass(logits=logits, new_kv=new_kv[:, :, :n],
                    features=values[2][0, :n] if self.gives_features else None)


def padded_features(features: np.ndarray | None, rows: int, hidden: int) -> np.ndarray:
    """[1, rows, hidden]: the given features, then zero rows for the padding tokens."""
    if features is None:
        raise ValueError("this draft reads the target's features: pass them with the tokens")
    out = np.zeros((1, rows, hidden), np.float32)
    out[0, : len(features)] = features
    return out


def pass_feed(cache: KVCache, tokens, positions, tree_mask: np.ndarray, logit_rows, past_mask=None,
              exact_rows: bool = True):
    """The graph inputs of one pass, padded to MIN_ROWS rows; returns (feed, n real rows, wanted logit rows).

    exact_rows: each root-to-leaf path of `tree_mask` attends in its own sequence, so every row has the
    bits plain decoding gives it (exporters/llama.py says why); `tree_mask` must then be an ancestor
    mask. False puts all rows in one sequence that `tree_mask` masks as it likes (a draft's passes,
    whose rows need not match anything).
    """
    n = len(tokens)
    past_len = cache.length
    rows = max(n, MIN_ROWS)
    ids = np.zeros((1, rows), dtype=np.int64)
    ids[0, :n] = tokens
    pos = np.zeros((1, rows), dtype=np.int64)
    pos[0, :n] = positions
    pos[0, n:] = positions[-1]
    tree_mask = np.asarray(tree_mask, dtype=bool)
    paths = root_to_leaf_paths(tree_mask) if exact_rows else [list(range(n))]
    paths[0] = paths[0] + list(range(n, rows))  # padding rows go last in the first sequence: no real row sees them
    slots = max(len(path) for path in paths)
    path_nodes = np.zeros((len(paths), slots), dtype=np.int64)
    node_slots = np.zeros(rows, dtype=np.int64)
    mask = np.zeros((len(paths), slots, past_len + slots), dtype=bool)
    for b, path in enumerate(paths):
        path_nodes[b, : len(path)] = path
        path_nodes[b, len(path):] = path[-1]  # unused slots repeat the last token (their rows are never read)
        node_slots[path] = b * slots + np.arange(len(path))  # a node on several paths has the same bits on each
        mask[b, :, past_len:] = np.tril(np.ones((slots, slots), dtype=bool))
        mask[b, :, :past_len] = True
        if past_mask is not None:
            real = [k for k, node in enumerate(path) if node < n]
            mask[b, real, :past_len] = np.asarray(past_mask, dtype=bool)[[path[k] for k in real]]
    if not exact_rows:
        mask[0, :n, past_len : past_len + n] = tree_mask
    wanted = np.asarray(logit_rows, dtype=np.int64)
    head_rows = np.concatenate([wanted, np.repeat(wanted[-1:], MIN_ROWS - len(wanted))]) if len(wanted) < MIN_ROWS \
        else wanted
    feed = cache.past()
    feed.update(input_ids=ids, position_ids=pos, attention_mask=mask, logit_rows=head_rows,
                path_nodes=path_nodes, node_slots=node_slots)
    return feed, n, wanted


def root_to_leaf_paths(ancestors: np.ndarray) -> list[list[int]]:
    """The paths of a tree given as an ancestor mask (row i: i and its ancestors, parents first), in
    the order of their leaves. Refuses a mask that is not one (a row seeing a later row, or rows whose
    visible sets are not a chain)."""
    n = len(ancestors)
    if ancestors.shape != (n, n) or not ancestors.diagonal().all() or np.triu(ancestors, 1).any():
        raise ValueError("exact rows need an ancestor mask: each row sees itself and earlier rows only")
    has_child = np.zeros(n, dtype=bool)
    for node in range(n):
        seen = np.flatnonzero(ancestors[node, :node])
        if len(seen):
            parent = seen[-1]
            if not np.array_equal(ancestors[node, :node], ancestors[parent, :node] | (np.arange(node) == parent)):
                raise ValueError(f"row {node} sees rows that are not the chain of its parent {parent}")
            has_child[parent] = True
    return [list(np.flatnonzero(ancestors[leaf])) for leaf in np.flatnonzero(~has_child)]


def prefill(runner: ModelRunner, cache: KVCache, tokens, chunk: int, features: np.ndarray | None = None) -> np.ndarray:
    """Appends `tokens` to the cache in causal chunks (with their input `features` for a graph that
    reads them); returns the last token's logits [V]."""
    logits = None
    for start in range(0, len(tokens), chunk):
        part = list(tokens[start : start + chunk])
        n = len(part)
        out = runner.forward(cache, part, range(cache.length, cache.length + n),
                             np.tril(np.ones((n, n), dtype=bool)), [n - 1],
                             features=None if features is None else features[start : start + n])
        cache.append(out.new_kv, range(n), out.features)
        logits = out.logits[0]
    return logits
