"""Budget-aware closing: a constrained generation ends complete within its token budget (history.md §67).

A small model's masked argmax can repeat array items or digits forever, every token a valid prefix, and end
at the budget with a cut document (history.md §63). Closing bounds the document by the budget instead of by
the schema: at every parser state the `Closer` builds one completion by a fixed rule (the grammar's forced
tokens, else the first of a few closing bytes it admits, else the lowest token it admits) and counts it: the
state's closing distance d, an upper bound on the tokens a complete output still needs. With r tokens left
(this one included):

- r <= d: only the closing completion's next token is admitted; from there d falls by one a token, so the
  output ends complete at the budget or before;
- d < r <= d + WATCH: a token t stays admitted only if d(state + t) <= r - 1, so that no token opens more
  structure than the budget can close; checked for every admitted token where the grammar admits few (a
  structural position), and where it admits many (free text), only tokens of word bytes are kept with the
  closing token (word bytes inside free text do not open structure);
- r > d + WATCH: the grammar's mask unchanged.

The rule reads only the parser state and the tokens left, both known per tree node, so a node's mask is the
same in a speculative step as in the plain step that reaches it: exactness holds as for the grammar's mask.
A token that adds more than WATCH to the closing distance from free-text position can still leave a cut
output (finish "length"); the README says so.
"""
from __future__ import annotations

import numpy as np

WATCH = 64  # how far before the closing distance admitted tokens are checked (a jump larger than this can cut)
FEW = 256  # admitted tokens up to which each is checked one by one
CLOSERS = (b'"', b"}", b"]", b")", b"0", b",")  # tried in this order where the grammar forces nothing
CHAIN_LIMIT = 4096  # a completion rule that has not ended by then: no known completion (distance infinite)
INFINITE = 1 << 30


class Closer:
    """Closing distances and masks for one vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos: tuple[int, ...]):
        self.vocab_size, self.eos = vocab_size, tuple(eos)
        spelled = [tokenizer.decode_bytes([i]) for i in range(vocab_size)]
        single = {data: i for i, data in reversed(list(enumerate(spelled))) if len(data) == 1}
        self.closers = [single[c] for c in CLOSERS if c in single]
        word = set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ") | set(range(0x80, 0x100))
        self.wordy = np.array([bool(data) and all(b in word for b in data) for data in spelled], dtype=bool)
        for e in self.eos:
            if e < vocab_size:
                self.wordy[e] = False
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self, matcher) -> np.ndarray:
        matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].view(bool)

    def distance(self, matcher, limit: int = CHAIN_LIMIT) -> tuple[int, int | None]:
        """(d, the closing completion's next token) from the matcher's state, which it leaves as it was;
        (INFINITE, None) where the rule does not end within `limit` tokens. At an accepting state d is 0 and
        the next token is an EOS."""
        consumed, first = 0, None
        try:
            while not matcher.is_accepting():
                if consumed >= limit or matcher.is_error() or matcher.is_stopped():
                    return INFINITE, None
                # the forced tokens at once: computing them is the chain's main cost
                tokens = [int(t) for t in matcher.compute_ff_tokens()] or [self._closing_token(matcher)]
                if tokens[0] is None or not matcher.consume_tokens(tokens):
                    return INFINITE, None
                consumed += len(tokens)
                first = tokens[0] if first is None else first
            if first is None:
                allowed = self.allowed(matcher)
                first = next((e for e in self.eos if e < self.vocab_size and allowed[e]), None)
            return consumed, first
        finally:
            if consumed:
                matcher.rollback(consumed)

    def _closing_token(self, matcher) -> int | None:
        for token in self.closers:
            if matcher.validate_tokens([token]) == 1:
                return token
        allowed = self.allowed(matcher)
        allowed[[e for e in self.eos if e < self.vocab_size]] = False
        admitted = np.flatnonzero(allowed)
        return int(admitted[0]) if admitted.size else None

    def restrict(self, allowed: np.ndarray, left: int, distance_of) -> np.ndarray:
        """`allowed` as closing leaves it with `left` tokens left (this one included); `distance_of(token)`:
        the closing distance after `token` (cached by the caller)."""
        d, first = distance_of(None)
        if left > d + WATCH or first is None:
            return allowed
        closing = np.zeros_like(allowed)
        closing[first] = True
        if left <= d:
            return closing
        admitted = np.flatnonzero(allowed)
        if admitted.size > FEW:
            return closing | (allowed & self.wordy)
        for token in admitted:
            if int(token) in self.eos or distance_of(int(token))[0] <= left - 1:
                closing[token] = True
        return closing
