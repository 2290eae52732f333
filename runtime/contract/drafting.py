"""What proposes a bundle's tokens, as the manifest records it: the drafter's kind and each drafter's settings."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import InputError


class DrafterKind(Enum):
    """What proposes a bundle's tokens: the manifest's `draft.kind`, and `export --draft`'s training-free names."""

    MODEL = "model"  # a draft model's graph
    TEXT = "text"  # a draft model with a tokenizer of its own, drafting through text (runtime/decoding/text_draft.py)
    NGRAM = "ngram"  # prompt lookup over the context
    RECYCLING = "recycling"  # Token Recycling: the target's own recent successors
    NGRAM_RECYCLING = "ngram+recycling"  # context matches first, recycled candidates fill the other branches
    SUFFIX = "suffix"  # suffix drafting alone (runtime/decoding/suffix.py), under the step controller
    MEDUSA = "medusa"  # Medusa heads over the target's final hidden state (runtime/decoding/medusa.py): no KV cache

    @classmethod
    def training_free(cls, name: str) -> "DrafterKind | None":
        """The training-free drafter `name` names, or None (then it names a draft model)."""
        kind = next((k for k in cls if k.value == name), None)
        return None if kind is not None and (kind.has_model or kind is cls.MEDUSA) else kind

    @classmethod
    def named(cls, name: str) -> "DrafterKind":
        kind = next((k for k in cls if k.value == name), None)
        if kind is None:
            raise InputError(f"unknown drafter {name!r}: one of {', '.join(k.value for k in cls)}")
        return kind

    @property
    def has_model(self) -> bool:
        """Whether a draft model's graph proposes (the bundle's `draft` entry holds it)."""
        return self in (DrafterKind.MODEL, DrafterKind.TEXT)

    @property
    def looks_up_ngrams(self) -> bool:
        return self in (DrafterKind.NGRAM, DrafterKind.NGRAM_RECYCLING)

    @property
    def recycles(self) -> bool:
        return self in (DrafterKind.RECYCLING, DrafterKind.NGRAM_RECYCLING)


@dataclass(frozen=True)
class NgramConfig:
    """A training-free n-gram drafter's settings (manifest `tree.ngram`): suffixes of min_n..max_n
    tokens are looked up, and without a full max_n-token match the tree is cut at
    `partial_match_depth` (None: never cut). Bundles written before these settings existed load as
    `LEGACY_NGRAM`."""
    min_n: int = 1
    max_n: int = 4
    partial_match_depth: int | None = 5

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n or (self.partial_match_depth is not None and self.partial_match_depth < 0):
            raise InputError(f"bad n-gram settings: {self}")

    def to_dict(self) -> dict:
        return {"min_n": self.min_n, "max_n": self.max_n, "partial_match_depth": self.partial_match_depth}


LEGACY_NGRAM = NgramConfig(min_n=2, max_n=3, partial_match_depth=None)


@dataclass(frozen=True)
class DynamicTreeConfig:
    budget: int = 16  # nodes per verification, root included
    width: int = 4  # children per expanded node, and nodes expanded per level
    max_depth: int = 6
    min_confidence: float = 0.02

    def __post_init__(self):
        if self.budget < 2 or self.width < 1 or self.max_depth < 1 or not 0 <= self.min_confidence < 1:
            raise InputError(f"bad dynamic tree settings: {self}")

    def to_dict(self) -> dict:
        return {"budget": self.budget, "width": self.width, "max_depth": self.max_depth,
                "min_confidence": self.min_confidence}


@dataclass(frozen=True)
class LookupConfig:
    """Prompt lookup beside a draft model: up to `tokens` drafted tokens that continue the context the
    way it continued after an earlier occurrence of its suffix (n = min_n..max_n tokens), and up to
    `quote_tokens` when all max_n of the suffix's tokens occurred before (0: no longer than `tokens`).
    `tokens` = 0 drafts by lookup only while quoting: where each node costs (int4 weights), a shorter
    match does not pay for its nodes (benchmarks/history.md §32); a quote's chain then stands alone
    (WithLookup)."""
    tokens: int = 4
    min_n: int = 1
    max_n: int = 4
    quote_tokens: int = 0

    def __post_init__(self):
        if self.tokens < 0 or self.quote_tokens < 0 or self.longest < 1 or not 1 <= self.min_n <= self.max_n:
            raise InputError(f"bad lookup settings: {self}")

    @property
    def longest(self) -> int:
        """The most lookup tokens one step may draft."""
        return max(self.tokens, self.quote_tokens)

    def ngram(self) -> NgramConfig:
        """The n-gram drafter that drafts the chain: cut at `tokens` unless quoting, when there is a quote length."""
        return NgramConfig(self.min_n, self.max_n, self.tokens if self.quote_tokens > self.tokens else None)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "min_n": self.min_n, "max_n": self.max_n, "quote_tokens": self.quote_tokens}


@dataclass(frozen=True)
class SuffixConfig:
    """Suffix drafting's settings (manifest `tree.suffix`)."""
    max_depth: int = 24  # the longest continuation drafted
    max_pattern: int = 32  # the longest suffix matched
    min_match: int = 2  # a shorter match drafts nothing: one token's continuations are mostly noise
    spec_factor: float = 2.0  # a tree holds at most spec_factor x the match length drafted tokens
    min_probability: float = 0.1  # a node whose estimated probability is lower is not drafted
    store_tokens: int = 65536  # earlier outputs kept across requests (4 bytes each)

    @property
    def store_bytes(self) -> int:
        """What SuffixStore(store_tokens) holds: int32 tokens and a separator."""
        return 4 * (self.store_tokens + 1)

    def __post_init__(self):
        ints = ("max_depth", "max_pattern", "min_match", "store_tokens")
        if any(isinstance(getattr(self, n), bool) or not isinstance(getattr(self, n), int) for n in ints) \
                or not 1 <= self.min_match <= self.max_pattern or self.max_depth < 1 or self.store_tokens < 0 \
                or not self.spec_factor > 0 or not 0 <= self.min_probability <= 1:
            raise InputError(f"bad suffix-drafting settings: {self}")

    def to_dict(self) -> dict:
        return {"max_depth": self.max_depth, "max_pattern": self.max_pattern, "min_match": self.min_match,
                "spec_factor": self.spec_factor, "min_probability": self.min_probability,
                "store_tokens": self.store_tokens}
