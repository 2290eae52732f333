"""Logits -> probabilities: the same processing for the target (p_target) and the draft (q_draft).

Order, as in Hugging Face's samplers: repetition penalty, temperature, top-k, top-p, min-p. Pure
numpy, row-wise, so a tree's N rows are processed in one call with each row's own history.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..contract.errors import InputError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # the same seed reproduces the same output

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{name} must be a number (got {value!r})")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError(f"{name} must be an integer (got {value!r})")
        if self.top_k is None:
            raise InputError("top_k must be an integer (0: off)")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{name} must be a finite number (got {getattr(self, name)})")
        if self.temperature < 0 or 0 < self.temperature < 1e-3:
            raise InputError(f"temperature must be 0 (greedy) or at least 0.001 (got {self.temperature})")
        if self.seed is not None and self.seed < 0:
            raise InputError(f"seed must be >= 0 (got {self.seed})")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p < 1:
            raise InputError(f"min_p must be in [0, 1) (got {self.min_p})")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if self.greedy and self.repetition_penalty != 1.0:  # it would be ignored: greedy takes the raw argmax
            raise InputError("repetition_penalty applies when sampling: give a temperature above 0 with it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL-style repetition penalty on the tokens in `seen` [R, V] bool: positive logits are divided
    by the penalty, negative ones multiplied."""
    if penalty == 1.0:
        return logits
    return np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)


def probabilities(logits: np.ndarray, config: SamplingConfig, seen: np.ndarray | None = None) -> np.ndarray:
    """logits [R, V] -> probabilities [R, V] (float64, rows sum to 1) under `config` (temperature > 0)."""
    x = logits.astype(np.float64)
    if seen is not None:
        x = penalize(x, seen, config.repetition_penalty)
    x = x / config.temperature
    if config.top_k and config.top_k < x.shape[-1]:
        kth = np.partition(x, -config.top_k, axis=-1)[:, -config.top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x -= x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if config.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass strictly before each token
        drop = np.zeros_like(probs, dtype=bool)
        np.put_along_axis(drop, order, before >= config.top_p, axis=-1)  # the top token always stays
        probs = np.where(drop, 0.0, probs)
    if config.min_p > 0:
        probs = np.where(probs < config.min_p * probs.max(axis=-1, keepdims=True), 0.0, probs)
    return probs / probs.sum(axis=-1, keepdims=True)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector (inverse CDF: exact for float64 weights)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def sample_without_replacement(probs: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """k distinct tokens, each drawn from `probs` with the earlier ones removed (fewer if the support is smaller)."""
    q = probs.copy()
    out = []
    for _ in range(min(k, int(np.count_nonzero(q)))):
        token = sample(q, rng)
        out.append(token)
        q[token] = 0.0
    return out


class Sampler:
    """A generation's sampling settings and its random stream (seeded once per generation)."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def spawn(self) -> "Sampler":
        """The same settings with a random stream of its own, drawn from this one's (for another thread)."""
        child = Sampler(self.config)
        child.rng = self.rng.spawn(1)[0]
        return child

    def distributions(self, logits: np.ndarray, committed: list[int], paths: list[list[int]]) -> np.ndarray:
        """logits [R, V] of R tree nodes; paths[r]: the tokens of row r's node after the committed ones
        (they count as history for the repetition penalty)."""
        seen = None
        if self.config.repetition_penalty != 1.0:
            seen = np.zeros(logits.shape, dtype=bool)
            seen[:, np.unique(np.asarray(committed, dtype=np.int64))] = True
            for row, path in enumerate(paths):
                seen[row, path] = True
        return probabilities(logits, self.config, seen)

    def rows(self, logits: np.ndarray, committed: list[int], tree) -> "LazyRows":
        """distributions() of the tree's nodes, each row computed when read: verification reads only
        the nodes it reaches, usually a few of the tree's, and each of them once."""
        return LazyRows(lambda node: self.distributions(logits[node : node + 1], committed, [tree.path(node)])[0])


class LazyRows:
    def __init__(self, compute):
        self.compute = compute

    def __getitem__(self, row: int) -> np.ndarray:
        return self.compute(row)
