"""A caller-owned KV cache: one preallocated array per model, rollback is a pointer move.

Layout [layers, 2 (key/value), capacity, kv_heads, head_dim], token-major inside each layer, so the
valid prefix `data[l, 0, :length]` is one contiguous block that onnxruntime reads without a copy.
The cache owns exactly one number, `length`: how many rows (tokens) are valid.

A cache may also keep one feature row per token ([capacity, feature_size]): the model's final hidden
state there, which a draft that reads the target's features (EAGLE-style) consumes. Features follow
their token through append, trim and evict, so they always describe the cached rows.
"""
from __future__ import annotations

import numpy as np

from .errors import ContextOverflowError
from .facts import ModelFacts


class KVCache:
    def __init__(self, facts: ModelFacts, capacity: int, feature_size: int = 0):
        self.capacity = capacity
        # np.zeros maps untouched pages lazily: only rows that are written become resident.
        self.data = np.zeros((facts.num_layers, 2, capacity, facts.num_kv_heads, facts.head_dim), np.float32)
        self.features = np.zeros((capacity, feature_size), np.float32) if feature_size else None
        self.length = 0

    def feature_rows(self) -> np.ndarray | None:
        """The features of the valid rows [length, feature_size], or None for a cache without them."""
        return None if self.features is None else self.features[: self.length]

    def past(self) -> dict[str, np.ndarray]:
        """The graph inputs for the valid prefix."""
        feed = {}
        for layer in range(self.data.shape[0]):
            feed[f"past_key_{layer}"] = self.data[layer, 0, : self.length]
            feed[f"past_value_{layer}"] = self.data[layer, 1, : self.length]
        return feed

    def room(self) -> int:
        return self.capacity - self.length

    def append(self, new_kv: np.ndarray, rows, features: np.ndarray | None = None) -> None:
        """Keeps rows `rows` (indices into new_kv's token axis) of a pass's new keys/values, in order,
        and of its `features` [n, feature_size] when the cache keeps features.

        After a tree pass, `rows` is the accepted path: the cache is compacted to it.
        """
        rows = np.asarray(rows, dtype=np.int64)
        end = self.length + len(rows)
        if end > self.capacity:
            raise ContextOverflowError(f"the KV cache holds {self.capacity} tokens; {end} were needed")
        if self.features is not None:
            if features is None:
                raise ValueError("this cache keeps features, but the pass returned none")
            self.features[self.length : end] = features[rows]
        if len(rows) and rows[0] == 0 and np.all(np.diff(rows) == 1):
            self.data[:, :, self.length : end] = new_kv[:, :, : len(rows)]  # a chain prefix: one slice copy
        else:
            self.data[:, :, self.length : end] = new_kv[:, :, rows]
        self.length = end

    def evict(self, start: int, count: int, rope_frequencies) -> None:
        """Forgets rows [start, start + count) and moves the later rows down by `count`. Their keys carry
        rotary position embeddings, so they are rotated back by `count` positions: every row's position
        stays its index, as the graphs assume (StreamingLLM's positions within the cache)."""
        if not (0 <= start and count > 0 and start + count <= self.length):
            raise ValueError(f"cannot evict rows {start}..{start + count} of a cache of {self.length}")
        moved = slice(start + count, self.length)
        kept = slice(start, self.length - count)
        freqs = np.asarray(rope_frequencies, dtype=np.float64)
        cos = np.cos(-count * freqs).astype(np.float32)
        sin = np.sin(-count * freqs).astype(np.float32)
        keys = self.data[:, 0, moved].copy()  # [layers, m, kv_heads, head_dim]
        half = len(freqs)
        first, second = keys[..., :half], keys[..., half:]
        self.data[:, 0, kept, :, :half] = first * cos - second * sin
        self.data[:, 0, kept, :, half:] = second * cos + first * sin
        self.data[:, 1, kept] = self.data[:, 1, moved].copy()
        if self.features is not None:
            self.features[kept] = self.features[moved].copy()
        self.length -= count

    def trim(self, length: int) -> None:
        """Forgets every row from `length` on."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of {self.length} rows to {length}")
        self.length = length
