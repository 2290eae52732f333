"""The decode loop: prefill, then draft -> verify -> accept -> commit until a stop condition.

State ownership (who holds what):
- the caller's `Session` owns the committed token ids (prompt + emitted) and the target cache;
  invariant between steps: target cache length == len(committed) - 1, because the newest committed
  token (the root of the next tree) has not been through the target yet;
- a draft-model drafter owns its own cache (see drafters.py); the target never reads it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .accept import accept_greedy
from .drafters import Drafter
from .errors import ContextOverflowError
from .kvcache import KVCache
from .model import ModelRunner, prefill
from .tokenizer import TextCodec


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True


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
        return self.new_tokens / self.decode_s if self.decode_s else 0.0

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


def speculative_step(target: ModelRunner, session: Session, drafter: Drafter) -> tuple[list[int], int]:
    """One target pass. Returns (new committed tokens, number of accepted draft tokens)."""
    cache = session.cache
    tree = drafter.propose(session.committed)                                  # 1. draft
    if cache.room() < tree.size:
        raise ContextOverflowError(f"the context is full ({cache.capacity} tokens)")
    topo = tree.topology
    out = target.forward(cache, tree.tokens, cache.length + topo.depths,      # 2. verify in one pass
                         topo.ancestor_mask, range(tree.size))
    path, bonus = accept_greedy(tree.tokens, topo.children, out.logits.argmax(-1))  # 3. accept
    cache.append(out.new_kv, path)                                            # 4. compact to the path
    new_tokens = [int(t) for t in tree.tokens[path[1:]]] + [bonus]
    session.committed.extend(new_tokens)
    drafter.observe(new_tokens)
    return new_tokens, len(path) - 1


def generate(target: ModelRunner, codec: TextCodec, drafter: Drafter, session: Session, context_ids: list[int],
             config: GenerationConfig, prefill_chunk: int, on_text=None) -> Result:
    """Generates after `context_ids`, the whole conversation so far; what the session already holds
    of it (the longest common prefix) is reused. `on_text(piece)` streams the text."""
    cache = session.cache
    if len(context_ids) + 1 > cache.capacity:
        raise ContextOverflowError(
            f"the prompt has {len(context_ids)} tokens but the context holds {cache.capacity}: "
            f"shorten the prompt or export with a larger --context")
    stats = Stats(prompt_tokens=len(context_ids))
    started = time.perf_counter()
    keep = min(_common_prefix(session.committed, context_ids), len(context_ids) - 1, cache.length)
    cache.trim(keep)
    drafter.rewind(keep)
    session.committed = list(context_ids)
    logits = prefill(target, cache, context_ids[keep:], prefill_chunk)            # prefill
    first = int(np.argmax(logits))
    session.committed.append(first)
    drafter.observe([first])
    stats.prefill_s = stats.first_token_s = time.perf_counter() - started

    emitted: list[int] = []
    stream = codec.stream()
    text = ""
    reason = "max_new_tokens"
    new_tokens = [first]
    decode_start = time.perf_counter()
    eos = set(codec.spec.eos_token_ids) if config.stop_at_eos else set()
    while True:
        for token in new_tokens:
            if token in eos:
                reason = "eos"
                break
            emitted.append(token)
            piece = stream.push(token)
            text += piece
            if config.stop_strings and any(s in text for s in config.stop_strings):
                reason = "stop_string"
                cut = min(text.index(s) for s in config.stop_strings if s in text)
                piece = piece[: max(0, len(piece) - (len(text) - cut))]
                text = text[:cut]
            if on_text and piece:
                on_text(piece)
            if reason != "max_new_tokens" or len(emitted) >= config.max_new_tokens:
                break
        if reason != "max_new_tokens" or len(emitted) >= config.max_new_tokens:
            break
        if cache.room() < 2:
            raise ContextOverflowError(f"the context is full ({session.cache.capacity} tokens) after "
                                       f"{len(emitted)} new tokens; lower --max-new-tokens or export with a larger --context")
        new_tokens, accepted = speculative_step(target, session, drafter)
        stats.target_passes += 1
        stats.accepted_drafts += accepted
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
