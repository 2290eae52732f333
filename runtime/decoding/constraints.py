"""Constrained decoding: what a grammar admits, on llguidance (chosen by measurement, history.md §58).

A `ConstraintSpec` says what the output must be (a JSON schema, any JSON object, a regular expression, one
of some strings, a Lark grammar); a `Grammars` holds the tokenizer the engine reads (built once per
pipeline) and compiles a spec into a `Guide`, one generation's parser state.

State ownership: the engine's caller owns the Guide, as it owns the session; the Guide's matcher is at the
committed tokens between steps. Within a step, `admit` walks the tree depth first on that one matcher,
consuming a node's token on the way down and rolling it back on the way up, so each node's mask is that
of its own path's state; `advance` then consumes what the step committed. `forced` gives the tokens the
grammar admits deterministically next, which the engine verifies as the first nodes of the step's tree.

Exactness: the target's logits at a node are masked with that node's mask before acceptance, in plain and
speculative decoding alike, so greedy output is the argmax of the masked logits and sampling draws from the
masked distribution. A drafted token the mask refuses can never be accepted: greedy drops it with its
subtree before the pass. Under sampling a point mass is dropped the same way (p_target[t] = 0 rejects it
and leaves the residual as it was); a token drawn from q_draft stays as a leaf, since its rejection
changes the residual (runtime/decoding/accept.py), and only its subtree goes. q_draft stays as the draft drew it:
rejection sampling is exact for any proposal, and masking q after the draw would not describe the draw.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import numpy as np

from ..contract.errors import ConstraintError, InputError
from .closing import INFINITE, Closer, Completions, admitted
from .shortest import shortest_tokens
from .tree import Tree

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as json.dumps writes it: fixed separators make keys, quotes and punctuation forced tokens, which the
# grammar supplies to the tree; flexible whitespace completed hardly more often (history.md §58)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match. `value`: the schema as JSON text (json_schema), the pattern (regex), the
    strings (choice, a tuple), the Lark grammar's text (grammar); None for json_object."""

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"unknown constraint kind {self.kind!r}: one of {', '.join(KINDS)}")
        if self.kind == "json_object":
            if self.value is not None:
                raise InputError("a json_object constraint takes no value")
        elif self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value or not all(isinstance(s, str) and s for s in self.value):
                raise InputError("a choice constraint needs a tuple of non-empty strings")
        elif not isinstance(self.value, str) or not self.value.strip():
            raise InputError(f"a {self.kind} constraint needs its text (got {self.value!r})")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as err:
                raise InputError(f"the JSON schema is not valid JSON: {err}") from err
            if not isinstance(schema, dict):
                raise InputError("a JSON schema must be a JSON object")

    @classmethod
    def json_schema(cls, schema: dict | str, strict: bool = False) -> "ConstraintSpec":
        """`strict`: as OpenAI's strict structured outputs, an object admits only the properties it names
        (`additionalProperties: false` wherever the schema leaves it out)."""
        if strict:
            schema = closed_objects(json.loads(schema) if isinstance(schema, str) else schema)
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "ConstraintSpec":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "ConstraintSpec":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options) -> "ConstraintSpec":
        return cls("choice", tuple(options))

    @classmethod
    def grammar(cls, lark: str) -> "ConstraintSpec":
        return cls("grammar", lark)

    def engine_grammar(self) -> str:
        """The spec as llguidance's grammar text."""
        compile_ = llguidance.LLMatcher
        if self.kind == "json_schema":
            return compile_.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return compile_.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return compile_.grammar_from_regex(self.value)
        if self.kind == "choice":  # Lark string literals take JSON's escapes
            return compile_.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in self.value))
        return compile_.grammar_from_lark(self.value)

    def describe(self) -> str:
        return {"json_schema": "the JSON schema", "json_object": "a JSON object", "regex": f"the pattern {self.value!r}",
                "choice": "the choice", "grammar": "the grammar"}[self.kind]


def closed_objects(schema):
    """A copy of `schema` in which every object schema that names properties and says nothing of others admits
    no others (strict mode: a model cannot wander off into keys of its own)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class Grammars:
    """The tokenizer as the grammar engine reads it, for one vocabulary (reading it takes a while on a large
    vocabulary: a pipeline keeps one), and the compiler of specs into Guides."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos = tuple(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(self.eos))
        self._vocab_bytes: frozenset[bytes] | None = None
        self._closer: Closer | None = None

    def start(self, spec: ConstraintSpec, forced_chains: bool = True, budget: int | None = None) -> "Guide":
        """The parser state before the first new token; a spec the engine cannot compile is a ConstraintError.
        `forced_chains`: steps verify the grammar's forced tokens as a chain (speculation); plain decoding
        takes one token a pass whatever the grammar forces. `budget`: the most new tokens the output may have,
        within which it closes (runtime/decoding/closing.py); None: masks only, an output may end cut."""
        grammar = spec.engine_grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ConstraintError(f"{spec.describe()} cannot be compiled for constrained decoding: {error.strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"{spec.describe()} cannot be compiled for constrained decoding: {matcher.get_error()}")
        if budget is not None and self._closer is None:  # every token's bytes, read once per vocabulary
            self._closer = Closer(self.tokenizer, self.vocab_size, self.eos)
        return Guide(matcher, self.vocab_size, forced_chains, None if budget is None else self._closer, budget)

    def shortest(self, spec: ConstraintSpec, above: int | None = None) -> int:
        """The fewest new tokens a complete output of `spec` has (runtime/decoding/shortest.py; `above`: only
        whether it exceeds this matters)."""
        if self._vocab_bytes is None:  # every token's bytes, read once (a few tens of ms on a large vocabulary)
            self._vocab_bytes = frozenset(self.tokenizer.decode_bytes([i]) for i in range(self.vocab_size))
            self._longest = max(map(len, self._vocab_bytes))
        return shortest_tokens(spec, self.tokenizer, self._vocab_bytes, self._longest, above)

    def within(self, spec: ConstraintSpec, max_new_tokens: int, name: str = "max_new_tokens",
               closing: bool = True) -> None:
        """Refuses (InputError) a budget in which no output of `spec` can complete: a run would only end
        at the budget with a cut document. `name`: the budget's name in the caller's terms. The server, the CLI
        and `Pipeline.generate` ask it of every constrained request that closes within its budget; with masks
        only (`close_within_budget=False`) a short budget is a prefix the caller may want."""
        needed = self.shortest(spec, above=max_new_tokens)
        if needed > max_new_tokens:
            raise InputError(f"no output matching {spec.describe()} is shorter than {needed} tokens, and {name} is "
                             f"{max_new_tokens}: raise {name} to {needed} or more, or loosen the constraint")
        closes = self.start(spec, budget=max_new_tokens).closing_distance() if closing else 0
        # INFINITE: the closing rule finds no completion from the start (e.g. a `minimum` its `0` misses), so
        # closing never acts on this output and is no reason to refuse; masks alone decide it, as without closing
        if max_new_tokens < closes < INFINITE:  # the budget closes the output, taking this many from the start
            raise InputError(f"an output matching {spec.describe()} closes within no fewer than {closes} tokens (the "
                             f"shortest has {needed}), and {name} is {max_new_tokens}: raise {name} to {closes} or "
                             "more, or loosen the constraint")


class Guide:
    """One generation's parser state (at the committed tokens between steps), and what it supplied."""

    def __init__(self, matcher, vocab_size: int, forced_chains: bool, closer: Closer | None = None,
                 budget: int | None = None):
        self.matcher, self.vocab_size, self.forced_chains = matcher, vocab_size, forced_chains
        self.closer, self.budget = closer, budget
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.supplied = 0  # tokens committed from the grammar's forced chains (accepted without a drafter)
        self.closed = False  # closing alone chose a committed token (the output's finish is then "length")
        self._path: list[int] = []  # the tokens the matcher is at: committed, then a tree walk's path
        self._completions = None if closer is None else Completions(closer, matcher, budget)
        self._complete: set[int] = set()  # committed token counts after which the output is a complete match

    def mask(self) -> np.ndarray:
        """[V] bool: the tokens admitted next from the matcher's state (closing counts the tokens left from
        the path the matcher is at)."""
        self._check()
        allowed = admitted(self.matcher, self._bits, self.vocab_size)
        if not allowed.any():
            raise ConstraintError("the grammar admits no token here and cannot end: check that it can complete")
        if self.closer is not None:
            allowed = self.closer.restrict(allowed, self.budget - len(self._path), self._completions.at(self._path),
                                           lambda token: self._completions.fits(self._path, token),
                                           lambda token: self._completions.keeps(self._path, token))
        return allowed

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar admits deterministically from the committed state: its forced
        tokens, or where the budget leaves only the closing completion, that completion."""
        self._check()
        if limit <= 0 or not self.forced_chains:
            return []
        forced = list(self.matcher.compute_ff_tokens()[:limit])
        if forced or self.closer is None or self.budget - len(self._path) > self._completions.at(self._path)[0]:
            return forced
        while len(forced) < limit:  # closing: each token the completion's next, the distance one less
            d, first = self._completions.at(self._path)
            if d == 0 or first is None or not self.matcher.consume_token(first):
                break
            forced.append(first)
            self._path.append(first)
        if forced:
            self.matcher.rollback(len(forced))
            del self._path[len(self._path) - len(forced):]
        return forced

    def closing_distance(self) -> int:
        """The tokens the closing completion takes from the committed state (runtime/decoding/closing.py),
        however many: INFINITE only where the rule finds no completion."""
        return self.closer.distance(self.matcher)[0]

    def admit(self, tree: Tree, sampling: bool) -> tuple[Tree, np.ndarray]:
        """The tree without what the grammar refuses (see the module docstring for what sampling keeps), and
        each kept node's mask from its own path's state [N, V]."""
        children, matcher = tree.topology.children, self.matcher
        masks = np.ones((tree.size, self.vocab_size), dtype=bool)
        keep = []

        def visit(node: int) -> None:  # the matcher is at node's path: consumed on the way down, rolled back up
            keep.append(node)
            masks[node] = self.mask()
            for child in children[node]:
                token = int(tree.tokens[child])
                if masks[node][token] and matcher.is_stopped():
                    keep.append(child)  # the grammar has ended: its EOS ends the output and nothing follows
                elif masks[node][token]:
                    if not matcher.consume_token(token):
                        raise ConstraintError(f"the grammar refused a token it admitted: {matcher.get_error()}")
                    self._path.append(token)
                    visit(child)
                    self._path.pop()
                    matcher.rollback(1)
                elif sampling and tree.q_draft is not None and (tree.drawn is None or bool(tree.drawn[child])):
                    keep.append(child)  # a refused draw: a leaf the walk rejects, its rejection shaping the residual

        visit(0)
        keep.sort()
        return tree.subset(keep), masks[keep]

    def advance(self, tokens: list[int]) -> None:
        """Consumes what a step committed (every token was admitted by its node's mask; past the grammar's
        end only its EOS, which ends the output)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if self.closer is not None and self._closing_chose(int(token)):
                self.closed = True
            self._path.append(int(token))
            if not self.matcher.consume_token(int(token)):
                raise ConstraintError(f"the grammar refused a committed token: {self.matcher.get_error()}")
            if self.closer is not None and self.matcher.is_accepting():
                self._complete.add(len(self._path))
        if self._completions is not None:
            self._completions.forget_before(len(self._path))

    def complete_after(self, count: int) -> bool:
        """Whether the first `count` committed tokens are a complete match (closing: an output that reached
        its budget there ended complete, its EOS past the budget)."""
        return count in self._complete

    def _closing_chose(self, token: int) -> bool:
        """Whether the budget alone chose this committed token: closing admitted only it, and it is not the
        end the grammar reached anyway."""
        d, first = self._completions.at(self._path)
        return self.budget - len(self._path) <= d and d > 0 and token == first

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar's parser failed: {self.matcher.get_error()}")
