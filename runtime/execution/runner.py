"""What the decode loop asks of a model, whatever runs it: the ONNX runner (model.py), the staged runner
(staged.py) and the CoreML runner (coreml.py) each satisfy `Runner`, and their caches `Cache`. The engine,
the drafters and the pipeline call nothing else, so one loop (runtime/decoding/engine.py) decodes on every
backend."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from ..contract.facts import ModelFacts
from ..contract.graph import GraphSignature, StaticShape


@runtime_checkable
class Cache(Protocol):
    """A conversation's KV rows for one model: `length` rows are valid; a pass writes after them and
    `commit` keeps the ones the caller accepts."""
    capacity: int
    lanes: int
    length: int
    features: np.ndarray | None  # [capacity, feature_size]: the model's final hidden state per row, if kept

    def room(self) -> int: ...

    def feature_rows(self) -> np.ndarray | None: ...

    def commit(self, lane: int, count: int, features: np.ndarray | None = None) -> None: ...

    def trim(self, length: int) -> None: ...

    def reserve(self, rows: int) -> None:
        """Holds `rows` rows from now on (a buffer that grows, grown once; one of fixed size, as it is)."""

    def evict(self, start: int, count: int, rope_frequencies) -> None: ...


@runtime_checkable
class Runner(Protocol):
    """One model behind a stateless pass: the caller passes tokens, positions, masks and the cache."""
    facts: ModelFacts
    signature: GraphSignature  # what the graph takes and gives, read once
    min_rows: int  # the rows a one-token step runs here (runtime/decoding/exactness.py sets it)
    run_seconds: float  # time inside the backend, all passes so far (`bench` reports the rest as Python's)

    @property
    def lanes(self) -> int: ...

    @property
    def static(self) -> StaticShape | None: ...

    @property
    def pass_limit(self) -> int | None:
        """The most tokens one pass takes (prefill chunks are cut to it); None without a limit."""

    @property
    def tree_limit(self) -> int | None:
        """The most nodes one verified tree takes (trees and forced chains are cut to it); None without one."""

    @property
    def reads_features(self) -> bool: ...

    def new_cache(self, capacity: int, feature_size: int = 0) -> Cache: ...

    def forward(self, cache, tokens, positions, tree_mask: np.ndarray, logit_rows,
                past_mask: np.ndarray | None = None, features: np.ndarray | None = None,
                exact_rows: bool = True):
        """Runs the new tokens after the cache's valid rows; returns a model.Pass (logits at `logit_rows` over
        the full vocabulary, which lane holds which rows, the features a graph returns)."""
