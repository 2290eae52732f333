"""Closing acts only where it must (runtime/decoding/closing.py, issue 57): on small grammars and the tiny
vocabulary, every node's mask is checked against a closing distance found by enumerating token sequences.

- sound: every token the mask admits leaves an output that can still close within the tokens left;
- only where it must: every token the grammar admits after which some output closes within the tokens left
  is kept, wherever the rule's own distance is the enumerated one (JSON, regular expressions, text, calls);
  where the rule's completion is longer than the shortest (a Lark rule whose lowest token takes the long
  branch), soundness is checked, and keeping the model's choice wherever the budget is not near;
- where the grammar can end, its EOS is always admitted.
"""
import numpy as np
import pytest
from edgespec.runtime.decoding.closing import INFINITE, WATCH
from edgespec.runtime.decoding.constraints import ConstraintSpec, Grammars
from edgespec.tool_calls import tool_constraint
from tiny import make_tokenizer

WEATHER = ({"name": "weather", "description": "", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},)
EXACT = {  # grammars on which the rule's distance is the shortest (asserted below, state by state)
    "json": ConstraintSpec.json_schema({"type": "object", "properties": {  # small alphabets: enumerable
        "a": {"type": "array", "items": {"enum": [1, 23]}}, "b": {"type": "string", "pattern": "^[ab.,!]*$"}},
        "required": ["a", "b"], "additionalProperties": False}),
    "regex": ConstraintSpec.regex(r"(ab|cd)+e?"),
    "text": ConstraintSpec.regex(r"[a-z .,!]*"),  # can end anywhere: a free-text answer
    "auto": tool_constraint(WEATHER, "auto"),  # text, or a call of the tool
}
FRONTIER = 20_000  # sequences per depth the enumeration takes on
# the rule's fallback (the lowest token admitted) takes the long branch: its distance exceeds the shortest
OVER = {"long_way": ConstraintSpec.grammar('start: item (", " item)*\nitem: "z" | "a" "b" "c" "d" "e"\n')}


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer = make_tokenizer(folder)
    return Grammars((folder / "tokenizer.json").read_text(), len(tokenizer), (tokenizer.eos_token_id,))


class Enumeration:
    """The fewest tokens from the matcher's state to an accepting one, by breadth-first enumeration of the
    admitted tokens (sequences spelling the same bytes reach the same state: kept once), up to a limit."""

    def __init__(self, closer):
        self.closer = closer
        self.bytes = [closer.spelling_of(i) for i in range(closer.vocab_size)]

    def distance(self, matcher, limit: int) -> int:
        frontier = {b"": ()}
        for depth in range(limit + 1):
            assert len(frontier) <= FRONTIER, "the grammar is too large to enumerate: pick a smaller one"
            following = {}
            for path in frontier.values():
                matcher.consume_tokens(list(path)) if path else None
                try:
                    if matcher.is_accepting():
                        return depth
                    if depth == limit:
                        continue
                    allowed = self.closer.allowed(matcher)
                    allowed[list(self.closer.eos)] = False
                    for token in np.flatnonzero(allowed):
                        spelled = b"".join(self.bytes[t] for t in path) + self.bytes[token]
                        following.setdefault(spelled, (*path, int(token)))
                finally:
                    if path:
                        matcher.rollback(len(path))
            frontier = following
        return INFINITE

    def known(self, matcher, left: int) -> bool:
        """Whether the closing rule's own completion closes within `left` tokens, checked by consuming it (a
        proof that some output does: the enumeration is needed only where it does not)."""
        _, _, tokens = self.closer.distance(matcher, limit=left + 1)
        consumed = matcher.try_consume_tokens(list(tokens))
        try:
            return len(tokens) <= left and consumed == len(tokens) and matcher.is_accepting()
        finally:
            if consumed:
                matcher.rollback(consumed)

    def closes_after(self, matcher, token: int, left: int) -> bool:
        """Whether some output closes within `left` tokens after `token` (EOS: the grammar ends here)."""
        if token in self.closer.eos:
            return matcher.is_accepting()
        assert matcher.consume_token(token)
        try:
            return self.known(matcher, left) or self.distance(matcher, left) <= left
        finally:
            matcher.rollback(1)


def walk_and_check(grammars, spec, budget: int, seed: int, exact: bool) -> int:
    """Walks the mask at random (the model's choice, as a sampler would take it) and checks each node's mask
    against the enumeration; returns how many nodes closing narrowed."""
    guide, rng = grammars.start(spec, budget=budget), np.random.default_rng(seed)
    enumeration, narrowed = Enumeration(guide.closer), 0
    for _ in range(budget):
        if guide.matcher.is_stopped():
            break
        left = budget - len(guide._path)
        mask = guide.mask()
        grammar = guide.closer.allowed(guide.matcher)
        closes = np.zeros_like(grammar)
        for token in np.flatnonzero(grammar):
            closes[token] = enumeration.closes_after(guide.matcher, int(token), left - 1)
        assert closes.any(), "the walk reached a state no output closes from"
        assert not (mask & ~closes).any(), f"admitted without a way to close: {np.flatnonzero(mask & ~closes)}"
        if guide.matcher.is_accepting():
            assert mask[list(guide.closer.eos)].any(), "the grammar can end here, and its end was masked"
        d = guide._completions.at(guide._path)[0]
        if exact or left > d + WATCH:
            missing = np.flatnonzero(closes & ~mask)
            assert not missing.size, f"{left} left: closing masked {missing} though an output closes after each"
        narrowed += bool((grammar & ~mask).any())
        choice = int(rng.choice(np.flatnonzero(mask)))
        if choice in guide.closer.eos:
            break
        guide.advance([choice])
    return narrowed


@pytest.mark.parametrize("name", sorted(EXACT))
def test_closing_keeps_every_token_that_can_still_close(name, grammars):
    spec = EXACT[name]
    start = grammars.start(spec, budget=99)
    d = start.closing_distance()
    enumerated = Enumeration(start.closer).distance(start.matcher, d)
    assert d == enumerated, (name, d, enumerated)  # the rule's distance is the shortest here
    narrowed = sum(walk_and_check(grammars, spec, budget, seed, exact=True)
                   for budget in (max(d, 1), d + 2, d + 5) for seed in range(3))
    if name not in ("text",):
        assert narrowed > 0, "the budgets never bound: nothing was tested"


def test_a_longer_completion_than_the_shortest_closes_soundly(grammars):
    spec = OVER["long_way"]
    start = grammars.start(spec, budget=99)
    d = start.closing_distance()
    assert Enumeration(start.closer).distance(start.matcher, d) < d < INFINITE  # longer than it must be
    for budget in (d, d + 4, d + 9):
        for seed in range(3):
            walk_and_check(grammars, spec, budget, seed, exact=False)


def test_text_under_auto_keeps_its_punctuation_and_end(grammars):
    """The text branch of tool_choice "auto" near its budget: every token the grammar admits stays (no
    structure to close), the end included; the call's opening stays where the call still fits."""
    spec = EXACT["auto"]
    text = grammars.tokenizer.tokenize_str("Hello")
    guide = grammars.start(spec, budget=len(text) + 1)
    closer = guide.closer
    guide.advance(text)
    grammar, mask = closer.allowed(guide.matcher), guide.mask()
    # one token left: punctuation, words and the end all stay; only a byte that splits a character goes
    assert (mask == (grammar & closer.whole)).all()
    for piece in (".", ",", "!", "\n", " world"):
        assert mask[grammars.tokenizer.tokenize_str(piece)[0]], piece
    assert mask[list(closer.eos)].all()
    opening = grammars.tokenizer.tokenize_str("<")[0]
    after = grammars.start(spec, budget=999)
    after.advance([opening])
    call = 1 + after.closing_distance()  # the fewest tokens of a call
    assert 1 < call < WATCH
    assert grammars.start(spec, budget=call).mask()[opening]  # a call fits: its "<" is the model's to take
    assert not grammars.start(spec, budget=call - 1).mask()[opening]  # one token fewer: it does not
