"""Budget-aware closing: a constrained generation ends complete within its token budget (history.md §67),
narrowing the model's choices only where it must (issue 57).

A small model's masked argmax can repeat array items or digits forever, every token a valid prefix, and end
at the budget with a cut document (history.md §63). Closing bounds the document by the budget instead of by
the schema: every state on the output's path has one completion (`Completions`: its parent's, one token on,
where that still completes; otherwise built by a fixed rule, the grammar's forced tokens, else the first of a
few closing bytes it admits, else the lowest token it admits, then spelled in the fewest tokens the grammar
takes), and its length is the state's closing distance d, an upper bound on the tokens a complete output
still needs (history.md §69). With r tokens left (this one included), a token t the grammar admits stays
admitted exactly when the output can still close after it: d(state + t) <= r - 1. So:

- r > d + WATCH: the grammar's mask unchanged (one token is taken to add at most WATCH to d);
- d < r <= d + WATCH: every admitted token is kept whose completion fits, the model's own choice wherever
  it can still close; checked one by one where the grammar admits few (a structural position); where it
  admits many (free text), only within FREE_JUMP of d (one token of free text is taken to add less), and
  there each ASCII byte admitted alone is probed once (does the completion still complete after it?), a
  token of such bytes keeps the completion (d unchanged, so it fits), and of the tokens with another byte
  (a `"` or a backslash in a string, each a walk of the rule) the first CHECKED_FREE are checked, the rest
  dropped: punctuation, words and the end stay to the last token;
- r <= d: only tokens that shorten the completion, the closing completion's next token among them; from
  there d falls by one a token, so the output ends complete at the budget or before.

Where the grammar can already end (a free-text answer, the text of tool_choice "auto"), its end is always
admitted. The rule reads only the path to a state and the tokens left, both known per tree node, so a node's
mask is the same in a speculative step as in the plain step that reaches it: exactness holds as for the
grammar's mask. What it assumes: a byte that leaves the completion completing leaves the lexer where it was
(true of strings, free text and numbers' digits; a grammar where a run of such bytes opens structure can
leave a cut output, finish "length", as can a token that adds more than WATCH at a structural position or
FREE_JUMP in free text).
The closing distance is the rule's, not the shortest possible: where the rule's completion is longer than
the grammar's shortest (a recursive Lark rule the closing bytes do not end), closing acts earlier than it
must (tests/test_closing_brute.py measures both against an enumeration).
"""
from __future__ import annotations

import numpy as np

WATCH = 64  # how far before the closing distance admitted tokens are checked (a jump larger than this can cut)
FEW = 256  # admitted tokens up to which each is checked one by one
CHECKED = 1024  # the most tokens checked one by one (past it: dropped)
FREE_JUMP = 16  # in free text, tokens are checked only within this many tokens of the closing distance
CHECKED_FREE = 8  # there, the most tokens of unprobed bytes (`"`, a backslash) checked one by one (each a walk)
CLOSERS = (b'"', b"}", b"]", b")", b"0", b",")  # tried in this order where the grammar forces nothing
CHAIN_LIMIT = 4096  # a completion rule that has not ended by then: no known completion (distance infinite)
PARTIAL = 3  # the most bytes that end a character a token leaves open (UTF-8)
RESPELL_BYTES = 16  # the longest token tried when a completion is spelled in fewer tokens
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
        for e in self.eos:
            spelled[e] = b""
        single = {data: i for i, data in reversed(list(enumerate(spelled))) if len(data) == 1}
        self.closers = [single[c] for c in CLOSERS if c in single]
        self._spelled = spelled
        self.spelling = {data: i for i, data in reversed(list(enumerate(spelled))) if 0 < len(data) <= RESPELL_BYTES}
        # each token's bytes as a 256-bit set (4 words), to find at once the tokens made of probed bytes only
        present = np.zeros((vocab_size, 256), dtype=bool)
        for i, data in enumerate(spelled):
            present[i, list(data)] = True
        self.token_words = np.ascontiguousarray(np.packbits(present, axis=1, bitorder="little").view(np.uint64).T)
        self.ascii_tokens = np.array(sorted(i for data, i in single.items() if data[0] < 0x80), dtype=np.int64)
        self.empty = np.array([not data for data in spelled], dtype=bool)  # EOS, special tokens: never probed
        # the bytes from 0x80 are probed together through one whole character (a lexer takes non-ASCII text as
        # a class); a token that splits a character is checked one by one
        self.whole = np.array([_whole_utf8(data) for data in spelled], dtype=bool)
        self.wide = next((i for i, data in enumerate(spelled) if len(data) == 2 and data[0] >= 0xC2
                          and _whole_utf8(data)), None)
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
        finally:
            if completion:
                matcher.rollback(len(completion))
        if not completion:
            return 0, self.end(matcher), ()
        completion = self._respelled(matcher, completion)
        return len(completion), completion[0], tuple(completion)

    def end(self, matcher) -> int | None:
        """The first EOS the matcher's (accepting) state admits."""
        return next((e for e in self.eos if matcher.validate_tokens([e]) == 1), None)

    def _closing_token(self, matcher) -> int | None:
        for token in self.closers:
            if matcher.validate_tokens([token]) == 1:
                return token
        allowed = self.allowed(matcher)
        allowed[list(self.eos)] = False
        admitted = np.flatnonzero(allowed)
        return int(admitted[0]) if admitted.size else None

    def _respelled(self, matcher, completion: list[int]) -> list[int]:
        """The completion with each run of one-byte tokens (the rule's closing bytes: `"` then `}` where `"}`
        is one token) spelled in the fewest tokens, where the grammar takes that spelling to its end; else the
        completion as built."""
        shorter, run = [], []
        for token in [*completion, None]:
            if token is not None and len(self._spelled[token]) == 1:
                run.append(token)
                continue
            shorter += self._fewest(b"".join(self._spelled[t] for t in run)) if len(run) > 1 else run
            run = []
            if token is not None:
                shorter.append(token)
        if len(shorter) >= len(completion):
            return completion
        consumed = matcher.try_consume_tokens(shorter)
        try:
            return shorter if consumed == len(shorter) and matcher.is_accepting() else completion
        finally:
            if consumed:
                matcher.rollback(consumed)

    def _fewest(self, data: bytes) -> list[int]:
        """`data` in the fewest vocabulary tokens (a shortest path over its positions)."""
        best: list[tuple[int, int, int]] = [(0, -1, -1)] + [(INFINITE, -1, -1)] * len(data)  # (count, start, token)
        for end in range(1, len(data) + 1):
            for start in range(max(0, end - RESPELL_BYTES), end):
                token = self.spelling.get(data[start:end])
                if token is not None and best[start][0] + 1 < best[end][0]:
                    best[end] = (best[start][0] + 1, start, token)
        tokens, at = [], len(data)
        while at > 0:
            tokens.append(best[at][2])
            at = best[at][1]
        return tokens[::-1]

    def spelling_of(self, token: int) -> bytes:
        return self._spelled[token]

    def restrict(self, allowed: np.ndarray, left: int, at: tuple[int, int | None], fits, keeps) -> np.ndarray:
        """`allowed` as closing leaves it with `left` tokens left (this one included), `at` the state's (d,
        next token); `fits(token)`: whether the closing distance after `token` is at most `left - 1`;
        `keeps(token)`: whether the state's own completion still completes after `token` (d unchanged)."""
        d, first = at
        if left > d + WATCH or first is None:
            return allowed
        kept = np.zeros_like(allowed)
        kept[first] = True
        if left < d:  # no completion fits any more: the closing one's next token
            return kept
        ends = [e for e in self.eos if allowed[e]]
        kept[ends] = True  # the grammar can end here: its end is always admitted
        candidates = allowed.copy()
        candidates[ends] = False
        candidates[first] = False
        checked = CHECKED
        if np.count_nonzero(candidates) > FEW and d <= left - 1:  # free text
            if left - 1 - d >= FREE_JUMP:  # one token of free text is taken to add less than FREE_JUMP
                return kept | candidates
            clean = candidates & self._probed(allowed, keeps)  # its bytes probed once each
            # a token that ends inside a character is as its whole bytes, but for the (at most 3) bytes that end it
            probed = clean & (self.whole if d + PARTIAL > left - 1 else True)
            kept |= probed
            candidates &= ~probed
            checked = CHECKED_FREE
        for token in np.flatnonzero(candidates)[:checked]:
            if fits(int(token)):
                kept[token] = True
        return kept

    def _probed(self, allowed: np.ndarray, keeps) -> np.ndarray:
        """[V] bool: the tokens made only of bytes after which the completion still completes: each ASCII
        byte's own token probed where admitted (a byte not admitted alone is not probed: its tokens are
        checked one by one), the bytes from 0x80 together through one whole character."""
        ascii_tokens = self.ascii_tokens[allowed[self.ascii_tokens]]
        bad = np.ones(256, dtype=bool)
        for token in ascii_tokens:
            bad[self._spelled[token][0]] = not keeps(int(token))
        bad[0x80:] = not (self.wide is not None and allowed[self.wide] and keeps(self.wide))
        words = np.packbits(bad, bitorder="little").view(np.uint64)
        hit = self.token_words[0] & words[0]
        for i in range(1, 4):
            hit |= self.token_words[i] & words[i]
        return (hit == 0) & ~self.empty


def _walk_limit(left: int) -> int:
    """How far the rule walks for a completion of at most `left` tokens: its walk goes a token a byte where
    the grammar forces nothing, and spelled in fewer tokens may still fit."""
    return min(CHAIN_LIMIT, max(left, 0) + 16)


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


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

    def keeps(self, path: list[int], token: int) -> bool:
        """Whether the completion at `path` still completes one `token` on (the matcher is at `path`)."""
        tokens = [token, *self.completion(path)[2]]
        consumed = self.matcher.try_consume_tokens(tokens)
        try:
            return consumed == len(tokens) and self.matcher.is_accepting()
        finally:
            if consumed:
                self.matcher.rollback(consumed)

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
                self._known[key[:depth]] = self.closer.distance(self.matcher, limit=_walk_limit(self.budget))
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
        if self.matcher.is_accepting():  # the grammar can end here, whatever the parent's completion
            return 0, self.closer.end(self.matcher), ()
        if parent[2][:1] == (token,):
            tail = parent[2][1:]
            return parent[0] - 1, tail[0] if tail else self.closer.end(self.matcher), tail
        if parent[1] is not None and self._completes(parent[2]):
            return parent if parent[2] else (0, self.closer.end(self.matcher), ())
        return self.closer.distance(self.matcher, limit=_walk_limit(self.budget - depth))

    def _completes(self, tokens: tuple[int, ...]) -> bool:
        consumed = self.matcher.try_consume_tokens(list(tokens))
        try:
            return consumed == len(tokens) and self.matcher.is_accepting()
        finally:
            if consumed:
                self.matcher.rollback(consumed)
