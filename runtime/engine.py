"""The decode loop: prefill, then draft -> verify -> accept -> commit until a stop condition.

State ownership (who holds what):
- the caller's `Session` owns the committed token ids (prompt + emitted) and the target cache;
  invariant between steps: target cache length == len(committed) - 1, because the newest committed
  token (the root of the next tree) has not been through the target yet;
- a draft-model drafter owns its own cache (see drafters.py); the target never reads it;
- `TextSink` owns what text has been shown, and holds back any tail that may begin a stop string.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .accept import accept_greedy, accept_sampled
from .drafters import Drafter
from .errors import ContextOverflowError
from .kvcache import KVCache
from .model import ModelRunner, prefill
from .sampling import Sampler, SamplingConfig, sample
from .tokenizer import TextCodec, TextStream


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True
    sampling: SamplingConfig = SamplingConfig()  # greedy unless temperature > 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        if any(not s for s in self.stop_strings):
            raise ValueError("a stop string cannot be empty")


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_passes: int = 0  # verification passes after prefill
    accepted_drafts: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: the first token comes from prefill and is counted in first_token_s instead."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s and self.new_tokens > 1 else 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        """Tokens one target pass yields: accepted drafts plus the bonus token."""
        return (self.accepted_drafts + self.target_passes) / self.target_passes if self.target_passes else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "target_passes": self.target_passes, "tokens_per_s": round(self.tokens_per_s, 2),
                "mean_accepted_per_pass": round(self.mean_accepted_per_pass, 3),
                "time_to_first_token_s": round(self.first_token_s, 4), "prefill_s": round(self.prefill_s, 4),
                "decode_s": round(self.decode_s, 4)}


@dataclass
class Result:
    token_ids: list[int]
    text: str
    stats: Stats
    stop_reason: str  # "eos", "stop_string", "max_new_tokens"


@dataclass
class Session:
    """One conversation's state, owned by the caller."""

    cache: KVCache
    committed: list[int] = field(default_factory=list)


def speculative_step(target: ModelRunner, session: Session, drafter: Drafter,
                     sampler: Sampler | None = None) -> tuple[list[int], int]:
    """One target pass. Returns (new committed tokens, number of accepted draft tokens)."""
    cache = session.cache
    tree = drafter.propose(session.committed, cache.room(), sampler)             # 1. draft what fits
    topo = tree.topology
    out = target.forward(cache, tree.tokens, cache.length + topo.depths,      # 2. verify in one pass
                         topo.ancestor_mask, range(tree.size))
    if sampler is None:                                                       # 3. accept
        path, bonus = accept_greedy(tree.tokens, topo.children, out.logits.argmax(-1))
    else:
        p_target = sampler.distributions(out.logits, session.committed, tree.paths())
        path, bonus = accept_sampled(tree.tokens, topo.children, p_target, tree.q_draft, sampler.rng)
    cache.append(out.new_kv, path)                                            # 4. compact to the path
    new_tokens = [int(t) for t in tree.tokens[path[1:]]] + [bonus]
    session.committed.extend(new_tokens)
    drafter.observe(new_tokens, tree.tokens, out.logits)
    return new_tokens, len(path) - 1


class TextSink:
    """Streams text as tokens arrive, cutting at the first stop string and never showing any part of it."""

    def __init__(self, stream: TextStream, stop_strings: tuple[str, ...], on_text):
        self.stream, self.stops, self.on_text = stream, stop_strings, on_text
        self.text = ""  # everything decoded so far
        self.shown = 0  # how much of it on_text has received
        self.token_ends: list[int] = []  # len(text) after each token
        self.stopped_at: int | None = None  # text index where a stop string begins

    def push(self, token: int) -> bool:
        """Adds a token; returns True when a stop string has appeared."""
        self.text += self.stream.push(token)
        self.token_ends.append(len(self.text))
        hits = [self.text.find(s) for s in self.stops if s in self.text]
        if hits:
            self.stopped_at = min(hits)
            self._show(self.stopped_at)
            return True
        held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        self._show(len(self.text) - held)
        return False

    def finish(self) -> str:
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        self._show(end)
        return self.text[:end]

    def tokens_before_stop(self) -> int:
        """How many tokens lie wholly before the stop string (all of them without one)."""
        if self.stopped_at is None:
            return len(self.token_ends)
        return sum(1 for end in self.token_ends if end <= self.stopped_at)

    def _show(self, upto: int) -> None:
        if upto > self.shown:
            if self.on_text:
                self.on_text(self.text[self.shown : upto])
            self.shown = upto


def generate(target: ModelRunner, codec: TextCodec, drafter: Drafter, session: Session, context_ids: list[int],
             config: GenerationConfig, prefill_chunk: int, on_text=None) -> Result:
    """Generates after `context_ids`, the whole conversation so far; what the session already holds
    of it (the longest common prefix) is reused. `on_text(piece)` streams the text."""
    cache = session.cache
    if not context_ids:
        raise ValueError("the prompt is empty")
    if len(context_ids) > cache.capacity:
        raise ContextOverflowError(
            f"the prompt has {len(context_ids)} tokens but the context holds {cache.capacity}: "
            f"shorten the prompt or export with a larger --context")
    stats = Stats(prompt_tokens=len(context_ids))
    started = time.perf_counter()
    keep = min(_common_prefix(session.committed, context_ids), len(context_ids) - 1, cache.length)
    cache.trim(keep)
    drafter.rewind(keep)
    session.committed = list(context_ids)
    sampler = None if config.sampling.greedy else Sampler(config.sampling)
    logits = prefill(target, cache, context_ids[keep:], prefill_chunk)            # prefill
    first = int(np.argmax(logits)) if sampler is None else \
        sample(sampler.distributions(logits[None], session.committed, [[]])[0], sampler.rng)
    session.committed.append(first)
    drafter.observe(session.committed[-1:])
    stats.prefill_s = stats.first_token_s = time.perf_counter() - started

    sink = TextSink(codec.stream(), config.stop_strings, on_text)
    eos = set(codec.spec.eos_token_ids) if config.stop_at_eos else set()
    emitted: list[int] = []
    new_tokens = session.committed[-1:]
    reason = None
    decode_start = time.perf_counter()
    while reason is None:
        for token in new_tokens:
            if token in eos:
                reason = "eos"
            elif sink.push(token):
                emitted.append(token)
                reason = "stop_string"
            else:
                emitted.append(token)
                if len(emitted) >= config.max_new_tokens:
                    reason = "max_new_tokens"
            if reason:
                break
        if reason is None:
            if cache.room() < 1:
                raise ContextOverflowError(f"the context is full ({cache.capacity} tokens) after {len(emitted)} "
                                           "new tokens; lower --max-new-tokens or export with a larger --context")
            new_tokens, accepted = speculative_step(target, session, drafter, sampler)
            stats.target_passes += 1
            stats.accepted_drafts += accepted
    text = sink.finish()
    if reason == "stop_string":
        emitted = emitted[: sink.tokens_before_stop()]
    stats.new_tokens = len(emitted)
    stats.decode_s = time.perf_counter() - decode_start
    # Forget what was accepted past the stop, so the next turn continues from what the user saw.
    session.committed = session.committed[: len(context_ids) + len(emitted) + (reason == "eos")]
    cache.trim(min(cache.length, len(session.committed) - 1))
    return Result(token_ids=emitted, text=text, stats=stats, stop_reason=reason)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
