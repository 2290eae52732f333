"""Budget-aware closing: a constrained generation ends complete within its token budget (history.md §67).

A small model's masked argmax can repeat array items or digits forever, every token a valid prefix, and end
at the budget with a cut document (history.md §63). Closing bounds the document by the budget instead of by
the schema: every state on the output's path has one completion (`Completions`: its parent's, one token on,
where that still completes; otherwise built by a fixed rule, the grammar's forced tokens, else the first of a
few closing bytes it admits, else the lowest token it admits), and its length is the state's closing
distance d, an upper bound on the tokens a complete output still needs (history.md §69). With r tokens left
(this one included):

- r <= d: only the closing completion's next token is admitted; from there d falls by one a token, so the
  output ends complete at the budget or before;
- d < r <= d + WATCH: a token t stays admitted only if d(state + t) <= r - 1, so that no token opens more
  structure than the budget can close; checked for every admitted token where the grammar admits few (a
  structural position), and where it admits many (free text), only tokens of word bytes are kept with the
  closing token (word bytes inside free text do not open structure);
- r > d + WATCH: the grammar's mask unchanged.

The rule reads only the path to a state and the tokens left, both known per tree node, so a node's mask is
the same in a speculative step as in the plain step that reaches it: exactness holds as for the grammar's mask.
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


def admitted(matcher, bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """[V] bool: the tokens the matcher's state admits, computed into `bits` (the caller's reused buffer of
    (V + 31) // 32 int32)."""
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size].view(bool)


class Closer:
    """Closing distances and masks for one vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos = tuple(e for e in eos if e < vocab_size)  # an id past the vocabulary is never admitted
        spelled = [tokenizer.decode_bytes([i]) for i in range(vocab_size)]
        single = {data: i for i, data in reversed(list(enumerate(spelled))) if len(data) == 1}
        self.closers = [single[c] for c in CLOSERS if c in single]
        word = set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ") | set(range(0x80, 0x100))
        self.wordy = np.array([bool(data) and all(b in word for b in data) for data in spelled], dtype=bool)
        self.wordy[list(self.eos)] = False
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self, matcher) -> np.ndarray:
        return admitted(matcher, self._bits, self.vocab_size)

    def distance(self, matcher, limit: int = CHAIN_LIMIT) -> tuple[int, int | None, tuple[int, ...]]:
        """(d, the closing completion's next token, the completion) from the matcher's state, which it leaves
        as it was; (INFINITE, None, ()) where the rule does not end within `limit` tokens. At an accepting
        state d is 0, the completion empty and the next token an EOS."""
        completion: list[int] = []
        try:
            while not matcher.is_accepting():
                if len(completion) >= limit or matcher.is_error() or matcher.is_stopped():
                    return INFINITE, None, ()
                # the forced tokens at once: computing them is the chain's main cost
                tokens = [int(t) for t in matcher.compute_ff_tokens()] or [self._closing_token(matcher)]
                if tokens[0] is None or not matcher.consume_tokens(tokens):
                    return INFINITE, None, ()
                completion += tokens
            return len(completion), completion[0] if completion else self.end(matcher), tuple(completion)
        finally:
            if completion:
                matcher.rollback(len(completion))

    def end(self, matcher) -> int | None:
        """The first EOS the matcher's (accepting) state admits."""
        allowed = self.allowed(matcher)
        return next((e for e in self.eos if allowed[e]), None)

    def _closing_token(self, matcher) -> int | None:
        for token in self.closers:
            if matcher.validate_tokens([token]) == 1:
                return token
        allowed = self.allowed(matcher)
        allowed[list(self.eos)] = False
        admitted = np.flatnonzero(allowed)
        return int(admitted[0]) if admitted.size else None

    def restrict(self, allowed: np.ndarray, left: int, at: tuple[int, int | None], fits) -> np.ndarray:
        """`allowed` as closing leaves it with `left` tokens left (this one included), `at` the state's (d,
        next token); `fits(token)`: whether the closing distance after `token` is at most `left - 1`."""
        d, first = at
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
            if int(token) in self.eos or fits(int(token)):
                closing[token] = True
        return closing


class Completions:
    """One generation's closing completions by path (the tokens the matcher is at), each a function of its
    path alone, whatever order tree walks and steps ask for them in (exactness). A path is its parent and
    one token; its completion is, by the first rule that holds:

    - the parent's completion after its first token, where that token is the one taken (no work: inside the
      closing region every token is such a step);
    - the parent's completion, where it still completes from here (most tokens open nothing: checking costs
      one batch of the parser, a fraction of building a completion);
    - the rule's own walk from here, given up past the tokens left (no completion fits then: masks alone act).
    Only the last committed state's parent and later are kept."""

    def __init__(self, closer: Closer, matcher, budget: int):
        self.closer, self.matcher, self.budget = closer, matcher, budget
        self._known: dict[tuple[int, ...], tuple[int, int | None, tuple[int, ...]]] = {}

    def at(self, path: list[int]) -> tuple[int, int | None]:
        """(d, next token) at `path`, where the matcher is."""
        d, first, _ = self.completion(path)
        return d, first

    def fits(self, path: list[int], token: int) -> bool:
        """Whether the completion after `token` takes at most the tokens left after it."""
        if not self.matcher.consume_token(token):
            return False
        try:
            return self.completion([*path, token])[0] <= self.budget - len(path) - 1
        finally:
            self.matcher.rollback(1)

    def completion(self, path: list[int]) -> tuple[int, int | None, tuple[int, ...]]:
        """(d, next token, the completion) at `path`, where the matcher is (and is left)."""
        key = tuple(path)
        if key and key not in self._known and key[:-1] in self._known:  # the common case: the parent is known
            self._known[key] = self._after(self._known[key[:-1]], key[-1], len(key))
        elif key not in self._known:  # from the deepest path known (the root at worst), each path in turn
            depth = len(key)
            while depth > 0 and key[:depth] not in self._known:
                depth -= 1
            if depth < len(key):
                self.matcher.rollback(len(key) - depth)
            if key[:depth] not in self._known:  # the root
                self._known[key[:depth]] = self.closer.distance(self.matcher, limit=self.budget)
            for step in range(depth + 1, len(key) + 1):
                self.matcher.consume_token(key[step - 1])
                self._known[key[:step]] = self._after(self._known[key[: step - 1]], key[step - 1], step)
        return self._known[key]

    def forget_before(self, committed: int) -> None:
        """Drops the paths shorter than the committed state's parent: no later path reaches them."""
        for key in [key for key in self._known if len(key) < committed - 1]:
            del self._known[key]

    def _after(self, parent: tuple[int, int | None, tuple[int, ...]], token: int, depth: int):
        """The completion where the matcher is, one `token` after `parent`'s state, `depth` tokens in."""
        if parent[2][:1] == (token,):
            tail = parent[2][1:]
            return parent[0] - 1, tail[0] if tail else self.closer.end(self.matcher), tail
        if parent[1] is not None and self._completes(parent[2]):
            return parent if parent[2] else (0, self.closer.end(self.matcher), ())
        return self.closer.distance(self.matcher, limit=self.budget - depth)

    def _completes(self, tokens: tuple[int, ...]) -> bool:
        consumed = self.matcher.try_consume_tokens(list(tokens))
        try:
            return consumed == len(tokens) and self.matcher.is_accepting()
        finally:
            if consumed:
                self.matcher.rollback(consumed)
