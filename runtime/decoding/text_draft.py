"""A draft model of another tokenizer, drafting through text (manifest draft kind "text").

Each step (as transformers' universal assisted generation, with the boundaries made explicit):
1. the committed target tokens become text, and the text the draft's tokens (re-encoded past the last settled
   anchor, runtime/decoding/text_bridge.py); the draft's cache is rewound to the longest prefix it already holds;
2. the draft drafts greedily in its own vocabulary until its text holds `depth` whole target tokens;
3. that text becomes target tokens continuing the committed ones at their boundary: a chain the target verifies.

Proposals are point masses (tree.q_draft None): a text-level draft has no distribution over target tokens, so
sampled verification accepts a drafted token with the target's own probability of it and otherwise samples the
target's distribution without it (runtime/decoding/accept.py), which keeps the target's distribution exactly.

State ownership: the engine owns the committed tokens; this drafter owns the draft's cache and what it has
read: the committed text (`TargetText`), the draft's tokens for it and the tokens it drafted after them
(`DraftView.ids`, of which the cache holds the first `cache.length`). Drafted rows stay in the cache: those the
target accepts are the next step's committed text, and the common prefix keeps them.
"""
from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..contract.topology import Topology
from ..execution.model import prefill
from ..execution.runner import Cache, Runner
from .sampling import Sampler
from .text_bridge import DraftView, TargetText, target_proposal
from .tree import Tree

DECODE_CONTEXT = 4  # draft tokens before the drafted ones that its decoder sees (pieces joined by neighbours)


class TextDrafter:
    """Proposes a chain of up to `depth` target tokens from a draft model with its own tokenizer."""

    def __init__(self, runner: Runner, cache: Cache, depth: int, prefill_chunk: int,
                 target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer, draft_eos: tuple[int, ...]):
        self.runner, self.cache, self.depth, self.chunk = runner, cache, depth, prefill_chunk
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target = TargetText(target_tokenizer)
        self.view = DraftView(draft_tokenizer)
        # ids past the tokenizer's vocabulary (padding rows of the embedding) decode to nothing: never drafted
        self.usable = draft_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos = set(draft_eos)
        unknown = getattr(draft_tokenizer.model, "unk_token", None)
        self.unknown = draft_tokenizer.token_to_id(unknown) if unknown else None  # no text to re-encode
        self.chains = [Topology(tuple(range(-1, n))) for n in range(depth + 1)]  # made once, as NoDrafter's root

    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        depth, cache = min(self.depth, max_nodes - 1), self.cache
        # 1. the committed text as the draft's tokens; its cache keeps the rows that still agree
        kept_text = self.target.sync(committed)
        kept = self.view.update(self.target.text, kept_text)
        view = self.view.ids
        if depth < 1 or not view or len(view) + 2 * depth > cache.capacity:  # the draft's context is full
            return self._chain(committed[-1], [])
        cache.trim(min(cache.length, kept, len(view) - 1))  # at least the newest token is fed: its logits
        logits = prefill(self.runner, cache, view[cache.length:], self.chunk)
        # 2. draft until the text holds `depth` whole target tokens (a token is whole once another follows it)
        stream = DecodeStream(skip_special_tokens=False)
        for token in view[-DECODE_CONTEXT:]:
            stream.step(self.draft_tokenizer, token)
        drafted, text, whole = [], "", False
        for _ in range(2 * depth):
            token = int(np.argmax(logits[: self.usable]))
            if token == self.unknown:
                break
            drafted.append(token)
            text += stream.step(self.draft_tokenizer, token) or ""  # a character not yet whole waits
            whole = token in self.eos or len(self.target_tokenizer.encode(text, add_special_tokens=False)) > depth
            if whole:
                break
            logits = prefill(self.runner, cache, [token], 1)
        self.view.ids = view + drafted
        # 3. the drafted text as target tokens after the committed ones; a last token not known to be whole
        # (the draft stopped inside a word) is left out
        proposal = target_proposal(self.target_tokenizer, self.target, text) if text else []
        return self._chain(committed[-1], proposal[:depth] if whole else proposal[: min(depth, len(proposal) - 1)])

    def _chain(self, root: int, tokens: list[int]) -> Tree:
        return Tree(self.chains[len(tokens)], np.asarray([root, *tokens], dtype=np.int64))

    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        pass

    def rewind(self, length: int) -> None:
        self.target.rewind(length)  # the draft's rows follow at the next propose, by their common prefix
