"""Which tokens the draft's head predicts: the ones the target itself emits most, with their coverage.

The verifier still scores the full vocabulary, so a token outside the set is never proposed but is
still emitted whenever the target chooses it: trimming costs acceptance, never correctness.
"""
from __future__ import annotations

import numpy as np


def choose_head_tokens(top1_ids: np.ndarray, vocab_size: int, size: int, always: set[int]) -> np.ndarray:
    """The `size` most frequent target top-1 tokens (plus `always`, e.g. end of turn), sorted by id."""
    if size >= vocab_size:
        return np.arange(vocab_size, dtype=np.int64)
    counts = np.bincount(top1_ids, minlength=vocab_size).astype(np.float64)
    counts[list(always)] = np.inf
    # ties (most tokens never appear) are broken by id so the choice is reproducible
    order = np.lexsort((np.arange(vocab_size), -counts))
    return np.sort(order[:size])


def coverage(head_tokens: np.ndarray, top1_ids: np.ndarray) -> float:
    """Share of the target's greedy tokens that the head can propose."""
    return float(np.isin(top1_ids, head_tokens).mean()) if len(top1_ids) else 0.0
