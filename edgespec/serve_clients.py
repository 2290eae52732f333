"""Whose conversation a request continues, and the conversations `edgespec serve` keeps between requests.

A client is the API key a request presents (when the server has keys), its `user` and its `cache_salt`,
together; a request with none of them is no one's and continues nothing. A kept conversation (its
target cache, its drafter with the draft cache) is continued only by its own client, so the cached
tokens and the time to first token a client sees say nothing of another client's prompt. Keys are kept
only as digests.

A conversation also holds what its drafter learns from across requests: its own store of earlier
outputs (suffix drafting) and Token Recycling table, where the bundle has them, so that no client's
outputs speed up, and so show in the timing of, another's; a request that is no one's gets empty ones.

`KeptConversations` owns the kept conversations; it is touched by generations under their turn
(edgespec/serve_turns.py: one at a time), so it needs no lock of its own. Each conversation's caches
stay allocated while it is kept: at most `bound` conversations, and with a memory budget the idle ones
within what the budget leaves over after the one it plans for and the others in flight; the least
recently used goes first.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edgespec.runtime.decoding.engine import Session
from edgespec.runtime.decoding.suffix import SuffixStore
from edgespec.runtime.pipeline import Pipeline


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def client_of(key_digest: str | None, user: str | None, cache_salt: str | None) -> str | None:
    """The client a request speaks for (None: no one, it shares nothing)."""
    if key_digest is None and user is None and cache_salt is None:
        return None
    return hashlib.sha256(json.dumps([key_digest, user, cache_salt]).encode()).hexdigest()


@dataclass
class Conversation:
    session: Session  # the caches, and the drafter made with the two below
    suffix_store: SuffixStore | None
    recycling_table: np.ndarray | None

    def nbytes(self, draft_kv_per_token: int) -> int:
        """The target cache's buffers as allocated; the draft's estimated from the tokens it holds; the
        drafter's store and table as allocated."""
        cache = self.session.cache
        features = 0 if cache.features is None else cache.features.nbytes
        learned = sum(0 if x is None else x.nbytes for x in (self.suffix_store, self.recycling_table))
        return cache.data.nbytes + features + len(self.session.committed) * draft_kv_per_token + learned


def full_conversation_bytes(memory) -> int:
    """What one conversation takes at the full context (a `MemoryPlan` plans one): both caches, the store."""
    return memory.target_kv + memory.draft_kv + memory.suffix_store


def in_flight(interleave: int, memory) -> int:
    """How many generations may be in flight at once: `interleave`, and under a memory budget only as many
    as its room holds beside the one it plans for, each at the full context (one at least)."""
    if memory.budget is None:
        return interleave
    room = max(0, memory.budget - memory.total)
    return max(1, min(interleave, 1 + room // full_conversation_bytes(memory)))


class KeptConversations:
    def __init__(self, pipeline: Pipeline, bound: int, in_flight: int = 1):
        self.pipeline, self.bound = pipeline, bound
        self.kept: OrderedDict[str, Conversation] = OrderedDict()  # least recently used first
        memory = pipeline.memory
        # the budget plans one conversation's caches at full context; the others in flight take their
        # share of what is left, and the idle ones live on the rest
        reserved = (in_flight - 1) * full_conversation_bytes(memory) if in_flight > 1 else 0
        self.room = None if memory.budget is None else max(0, memory.budget - memory.total - reserved)

    def take(self, client: str) -> Conversation:
        """`client`'s conversation (a new one the first time), out of the kept ones while it generates. The
        others are dropped, oldest first, until they leave it a place and fit in the budget's room, so
        that the generation never runs beyond either."""
        conversation = self.kept.pop(client, None)
        while self.kept and (len(self.kept) >= self.bound or (self.room is not None and self.held() > self.room)):
            self.kept.popitem(last=False)
        return self.new() if conversation is None else conversation

    def new(self) -> Conversation:
        """A conversation with empty caches, store and table (kept only if `keep` is given it)."""
        store, table = self.pipeline.new_suffix_store(), self.pipeline.new_recycling_table()
        return Conversation(self.pipeline.new_session(suffix_store=store, recycling_table=table), store, table)

    def keep(self, client: str, conversation: Conversation) -> None:
        """Keeps a conversation its generation left in a state to continue (not one that failed midway)."""
        if self.bound > 0:
            self.kept[client] = conversation

    def held(self) -> int:
        per_token = self.pipeline.memory.draft_kv_per_token
        return sum(c.nbytes(per_token) for c in self.kept.values())

    def __len__(self) -> int:
        return len(self.kept)
