"""Draws keyed by the seed and the output position: a seeded sample that no drafter can change.

A seeded generation's token at output position i is the winner of an exponential race run on noise
that depends only on (seed, i): each token t gets E_t ~ Exp(1) from a generator keyed by (seed, i), and
the winner is argmin_t E_t / p_t over the tokens p gives weight. P(winner = t) = p_t (the race is the
Gumbel-max trick in another dress), so each token is an exact draw from the target's distribution
given the tokens before it, and the noise of a position is independent of everything before it.

Verification (engine.verify) keeps a drafted child when its token is the race's winner at its parent
under p_target, and otherwise emits the winner: what is emitted is a function of the seed and the
target's distributions alone, whatever was drafted and however the step controller chose. A draft
model draws its proposals from the same race under q_draft (the k best of the race are k draws without
replacement, the Gumbel-top-k trick), so where q_draft is close to p_target both races tend to have one
winner and the draft is accepted (Daliri et al., "Coupling without communication and drafter-invariant
speculative decoding", 2024). Point-mass proposals (n-grams, suffixes, lookup) are accepted with
probability p_t, as under rejection sampling.
"""
from __future__ import annotations

import numpy as np


def race_keys(probs: np.ndarray, seed: int, position: int) -> np.ndarray:
    """E_t / p_t for every token (inf where p_t is 0): the lower the key, the sooner t wins."""
    uniform = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, position]))).random(len(probs))
    exponential = -np.log1p(-uniform)  # uniform in [0, 1): Exp(1), finite
    with np.errstate(divide="ignore"):
        return np.where(probs > 0, exponential / np.where(probs > 0, probs, 1.0), np.inf)


def seeded_choice(probs: np.ndarray, seed: int, position: int) -> int:
    """The token drawn from `probs` at output `position` under `seed`."""
    return int(np.argmin(race_keys(probs, seed, position)))


def seeded_distinct(probs: np.ndarray, k: int, seed: int, position: int) -> list[int]:
    """k distinct tokens drawn from `probs` without replacement, the first as seeded_choice draws it
    (fewer where the support is smaller)."""
    keys = race_keys(probs, seed, position)
    k = min(k, int(np.count_nonzero(probs)))
    if k < 1:
        return []
    best = np.argpartition(keys, k - 1)[:k] if k < len(keys) else np.arange(len(keys))
    return [int(t) for t in best[np.argsort(keys[best], kind="stable")]][:k]
