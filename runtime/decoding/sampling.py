"""Logits -> probabilities: the same processing for the target (p_target) and the draft (q_draft).

Order, as in vLLM's and Hugging Face's samplers: logit bias, repetition penalty (over the prompt and the
output), frequency and presence penalties (over the output, as OpenAI's API defines them), temperature,
top-k, top-p, min-p. Pure numpy, row-wise, so a tree's N rows are processed in one call with each row's
own history.

How a token is drawn: with a seed, by a race keyed by the seed and the output position
(runtime/decoding/seeded.py: the draft cannot change the sample); without one, from the generation's own
random stream, with recursive rejection sampling over the tree (runtime/decoding/accept.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..contract.errors import InputError
from .seeded import seeded_choice, seeded_distinct

PENALTY_RANGE = 2.0  # frequency and presence penalties: OpenAI's range, -2 to 2
BIAS_RANGE = 100.0  # a logit bias: OpenAI's range, -100 (banned) to 100 (chosen)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # the same seed reproduces the same output, whatever drafted it
    frequency_penalty: float = 0.0  # subtracted from a logit once per time its token is in the output so far
    presence_penalty: float = 0.0  # subtracted once if its token is in the output so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{name} must be a number (got {value!r})")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError(f"{name} must be an integer (got {value!r})")
        if self.top_k is None:
            raise InputError("top_k must be an integer (0: off)")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
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
        for name in ("frequency_penalty", "presence_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise InputError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (got {getattr(self, name)})")
        self._check_bias()
        changed = [name for name, off in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                          ("presence_penalty", 0.0), ("logit_bias", ())) if getattr(self, name) != off]
        if self.greedy and changed:  # it would be ignored: greedy takes the raw argmax
            raise InputError(f"{changed[0]} applies when sampling: give a temperature above 0 with it")

    def _check_bias(self) -> None:
        if not isinstance(self.logit_bias, tuple) or not all(isinstance(pair, tuple) and len(pair) == 2
                                                             for pair in self.logit_bias):
            raise InputError(f"logit_bias must be a tuple of (token id, bias) pairs (got {self.logit_bias!r})")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InputError(f"logit_bias: a token id must be an integer >= 0 (got {token!r})")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -BIAS_RANGE <= bias <= BIAS_RANGE:
                raise InputError(f"logit_bias: the bias of token {token} must be a number in [-{BIAS_RANGE:g}, "
                                 f"{BIAS_RANGE:g}] (got {bias!r})")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InputError("logit_bias names a token twice")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuses a logit bias on a token the model does not have."""
        outside = [token for token, _ in self.logit_bias if token >= vocab_size]
        if outside:
            raise InputError(f"logit_bias: token id {outside[0]} is outside this model's vocabulary "
                             f"(0..{vocab_size - 1})")

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


def penalize_output(logits: np.ndarray, counts: np.ndarray, frequency: float, presence: float) -> np.ndarray:
    """OpenAI's frequency and presence penalties: counts [R, V], how often each token is in a row's output."""
    return logits - frequency * counts - presence * (counts > 0)


class Sampler:
    """A generation's sampling settings and how it draws: keyed by (seed, output position) when seeded,
    else from a random stream of its own. Draws are placed by window index (the drafters' coordinates);
    the caller keeps `evicted` current (the conversation's tokens a sliding cache dropped from the window),
    and `origin` is the conversation index of the generation's first new token: the output position of
    window index i is i + evicted - origin. The frequency and presence penalties count the conversation's
    tokens from `origin` on."""

    def __init__(self, config: SamplingConfig, origin: int = 0):
        self.config = config
        self.seeded = config.seed is not None
        self.rng = np.random.default_rng(config.seed)  # unseeded: rejection sampling's draws
        self.origin, self.evicted = origin, 0

    def spawn(self) -> "Sampler":
        """The same settings with a random stream of its own, drawn from this one's (for another thread);
        seeded draws stay keyed alike."""
        child = Sampler(self.config, self.origin)
        child.evicted = self.evicted
        child.rng = self.rng.spawn(1)[0]
        return child

    def output_position(self, window_index: int) -> int:
        return window_index + self.evicted - self.origin

    def draw(self, probs: np.ndarray, window_index: int) -> int:
        """One token from `probs` for the token at `window_index`."""
        if self.seeded:
            return seeded_choice(probs, self.config.seed, self.output_position(window_index))
        return sample(probs, self.rng)

    def draw_distinct(self, probs: np.ndarray, k: int, window_index: int) -> list[int]:
        """k distinct tokens from `probs` for the token at `window_index` (a draft's siblings)."""
        if self.seeded:
            return seeded_distinct(probs, k, self.config.seed, self.output_position(window_index))
        return sample_without_replacement(probs, k, self.rng)

    def distributions(self, logits: np.ndarray, committed: list[int], paths: list[list[int]]) -> np.ndarray:
        """logits [R, V] of R tree nodes; paths[r]: the tokens of row r's node after the committed ones
        (they count as history for the penalties; the output is what follows `origin`)."""
        config = self.config
        x = logits.astype(np.float64)
        if config.logit_bias:
            tokens, biases = zip(*config.logit_bias)
            x[:, list(tokens)] += np.asarray(biases, dtype=np.float64)
        seen = None
        if config.repetition_penalty != 1.0:
            seen = np.zeros(logits.shape, dtype=bool)
            seen[:, np.unique(np.asarray(committed, dtype=np.int64))] = True
            for row, path in enumerate(paths):
                seen[row, path] = True
        if config.frequency_penalty or config.presence_penalty:
            output = np.bincount(np.asarray(committed[self.origin:], dtype=np.int64), minlength=x.shape[-1])
            counts = np.repeat(output[None].astype(np.float64), len(x), axis=0)
            for row, path in enumerate(paths):
                np.add.at(counts[row], np.asarray(path, dtype=np.int64), 1.0)
            x = penalize_output(x, counts, config.frequency_penalty, config.presence_penalty)
        return probabilities(x, config, seen)

    def rows(self, logits: np.ndarray, committed: list[int], tree) -> "LazyRows":
        """distributions() of the tree's nodes, each row computed when read: verification reads only
        the nodes it reaches, usually a few of the tree's, and each of them once."""
        return LazyRows(lambda node: self.distributions(logits[node : node + 1], committed, [tree.path(node)])[0])

    def choices(self, p_target: "LazyRows", tree, next_index: int) -> "LazyRows":
        """Seeded: the token drawn after each node of `tree`, whose root's child is at window index
        `next_index` (each read when verification reaches its node)."""
        depths = tree.topology.depths
        return LazyRows(lambda node: self.draw(p_target[node], next_index + int(depths[node])))


class LazyRows:
    def __init__(self, compute):
        self.compute = compute

    def __getitem__(self, row: int) -> np.ndarray:
        return self.compute(row)


# what a conversation samples with where the model's generation_config says nothing: llama.cpp's sampler
# defaults (common_params_sampling: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) with Ollama's repeat
# penalty 1.1 (llama.cpp's is now off); greedy decoding of a small chat model loops (docs/cli.md)
CONVERSATION_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
GENERATION_CONFIG_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def conversation_defaults(generation_config: dict | None) -> dict:
    """The sampling a conversation uses for what it leaves unset: the model's generation_config (its
    sampling keys, where it samples: do_sample not false) over CONVERSATION_DEFAULTS."""
    defaults = dict(CONVERSATION_DEFAULTS)
    if generation_config and generation_config.get("do_sample", True) is not False:
        defaults.update({key: generation_config[key] for key in GENERATION_CONFIG_KEYS
                         if generation_config.get(key) is not None})
    return defaults


def with_defaults(given: dict, defaults: dict) -> SamplingConfig:
    """A SamplingConfig of the settings `given` (None: unset), the unset ones from `defaults`; a temperature of
    0, given or defaulted, is greedy decoding, which takes no defaults (a penalty given with it is refused)."""
    temperature = given.get("temperature")
    temperature = defaults.get("temperature", 0.0) if temperature is None else temperature
    base = {} if temperature == 0 else defaults
    settings = {**base, **{name: value for name, value in given.items() if value is not None}}
    settings["temperature"] = temperature
    return SamplingConfig(**{name: value for name, value in settings.items() if value is not None})
