"""The decode loop: prefill, then draft -> verify -> accept -> commit until a stop condition.

State ownership (who holds what):
- the caller's `Session` owns the committed token ids (prompt + emitted), the target cache, and
  `window`: the committed tokens the cache holds plus the newest one. Invariant between steps: target
  cache length == len(window) - 1, because the newest committed token (the root of the next tree)
  has not been through the target yet. `window` equals `committed` until the `sliding` KV policy
  evicts rows; drafters see `window`, so their positions are the cache's;
- a draft-model drafter owns its own cache (see drafters.py); the target never reads it;
- `TextSink` owns what text has been shown, and holds back any tail that may begin a stop string.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np

from ..contract.errors import BundleError, ContextOverflowError, InputError
from ..execution.model import commit, prefill
from ..execution.runner import Cache, Runner
from .accept import accept_greedy, accept_sampled
from .constraints import ConstraintSpec, Guide
from .drafters import Drafter, NoDrafter
from .logprobs import Scores, TokenLogprob
from .sampling import Sampler, SamplingConfig
from .suffix import SuffixStore
from .text import TextCodec, TextStream
from .text_bridge import common_prefix
from .tree import Tree

KV_POLICIES = ("error", "sliding")
FORCED_TOKENS = 16  # the longest forced chain a pass verifies (then the drafter's tree): longer costs more than a pass


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True
    sampling: SamplingConfig = SamplingConfig()  # greedy unless temperature > 0
    # when the context fills the KV cache: "error" says so; "sliding" keeps the first `attention_sinks`
    # tokens and the most recent ones, evicting a quarter of the cache at a time (StreamingLLM)
    kv_policy: str = "error"
    attention_sinks: int = 4
    # what the output must match (JSON schema, JSON object, pattern, choice, grammar): the target's logits are
    # masked at every node; the grammar's end is the output's end (its EOS stops it, whatever stop_at_eos says)
    constraint: ConstraintSpec | None = None
    # a constrained output ends complete within max_new_tokens, the budget closing it where it must (stop
    # reason "closed"; runtime/decoding/closing.py); False: masks only, a cut prefix at the budget
    close_within_budget: bool = True

    def __post_init__(self):
        for name in ("max_new_tokens", "attention_sinks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InputError(f"{name} must be an integer (got {value!r})")
        if not isinstance(self.stop_strings, tuple) or not all(isinstance(s, str) for s in self.stop_strings):
            raise InputError(f"stop_strings must be a tuple of strings (got {self.stop_strings!r})")
        if not isinstance(self.sampling, SamplingConfig):
            raise InputError("sampling must be a SamplingConfig")
        if self.constraint is not None and not isinstance(self.constraint, ConstraintSpec):
            raise InputError("constraint must be a ConstraintSpec (ConstraintSpec.json_schema(...), .regex(...), ...)")
        if self.kv_policy not in KV_POLICIES:
            raise InputError(f"unknown KV policy {self.kv_policy!r}; choose one of {', '.join(KV_POLICIES)}")
        if self.attention_sinks < 0:
            raise InputError(f"attention_sinks must be >= 0 (got {self.attention_sinks})")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        if any(not s for s in self.stop_strings):
            raise InputError("a stop string cannot be empty")


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV rows the session already held (not prefilled again)
    new_tokens: int = 0
    target_passes: int = 0  # verification passes after prefill
    accepted_drafts: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    first_token_s: float = 0.0
    drafted_ahead: int = 0  # trees drafted while the target verified (runtime/decoding/overlap.py)
    kept_ahead: int = 0  # of those, the ones whose guess came true and were verified next
    # the step controller's choices (plain, suffix, draft, draft+suffix): steps taken and tokens committed by each
    steps_by_choice: dict = field(default_factory=dict)
    grammar_tokens: int | None = None  # under a constraint: tokens committed from the grammar's forced chains

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: the first token comes from prefill and is counted in first_token_s instead."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s and self.new_tokens > 1 else 0.0

    @property
    def mean_accepted_per_pass(self) -> float:
        """Tokens one target pass yields: accepted drafts plus the bonus token."""
        return (self.accepted_drafts + self.target_passes) / self.target_passes if self.target_passes else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
                "target_passes": self.target_passes, "tokens_per_s": round(self.tokens_per_s, 2),
                "mean_accepted_per_pass": round(self.mean_accepted_per_pass, 3),
                "time_to_first_token_s": round(self.first_token_s, 4), "prefill_s": round(self.prefill_s, 4),
                "decode_s": round(self.decode_s, 4),
                **({"drafted_ahead": self.drafted_ahead, "kept_ahead": self.kept_ahead} if self.drafted_ahead else {}),
                **({"steps_by_choice": self.steps_by_choice} if self.steps_by_choice else {}),
                **({"grammar_tokens": self.grammar_tokens, "grammar_tokens_per_pass": round(
                    self.grammar_tokens / self.target_passes if self.target_passes else 0.0, 3)}
                   if self.grammar_tokens is not None else {})}


@dataclass
class Result:
    token_ids: list[int]
    text: str
    stats: Stats
    stop_reason: str  # "eos", "stop_string", "max_new_tokens", "cancelled", "closed" (the budget ended a constrained
    # output: complete, its end chosen by closing); "context_full" on an error's partial
    # with a Scores (runtime/decoding/logprobs.py): each token's log-probability; the prompt's from its second token
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Session:
    """One conversation's state, owned by the caller: the target's cache, and the drafter that proposes in it
    with whatever it keeps (its own cache, what it learned)."""

    cache: Cache  # the target's (kvcache.KVCache, coreml.CoreMLCache)
    drafter: Drafter = field(default_factory=NoDrafter)
    suffix_store: SuffixStore | None = None  # where the conversation's outputs go for suffix drafting to continue
    committed: list[int] = field(default_factory=list)
    window: list[int] = field(default_factory=list)  # committed minus the rows a sliding cache evicted

    def begin(self, tokens: list[int]) -> None:
        """The conversation is now `tokens`; the caller brings the cache in line."""
        self.committed = list(tokens)
        self.window = list(tokens)


def speculative_step(target: Runner, session: Session, sampler: Sampler | None = None,
                     guide: Guide | None = None, scores: Scores | None = None) -> tuple[list[int], int]:
    """One target pass. Returns (new committed tokens, number of accepted draft tokens). `guide`: the
    constraint's parser state at the committed tokens (runtime/decoding/constraints.py), advanced here;
    `scores`: where the new tokens' log-probabilities go (None: not asked)."""
    cache, drafter = session.cache, session.drafter
    forced, room = _forced(target, cache, guide)                              # 1. the grammar's forced tokens,
    committed = session.window + forced if forced else session.window       #    then what the drafter drafts
    tree = drafter.propose(committed, room, sampler, cache.feature_rows())    #    after them
    tree = tree.within_paths(cache.lanes)                                     #    a lane per path
    tree = tree.after(session.window[-1], forced) if forced else tree
    masks = None
    if guide is not None:                                                     #    each node masked by its path
        tree, masks = guide.admit(tree, sampler is not None)
    new_tokens, accepted, logits = verify(target, session, tree, sampler, masks, scores)  # 2.-4.
    if guide is not None:
        guide.advance(new_tokens)
    if forced and accepted >= len(forced):  # the drafter took the forced tokens as committed: the rest is its step
        guide.supplied += len(forced)
        drafter.observe(new_tokens[len(forced):], tree.tokens[len(forced):], logits[len(forced):])
        return new_tokens, accepted
    if forced:  # the target spelled the forced text otherwise: the drafter forgets what it took as committed
        guide.supplied += accepted
        drafter.rewind(len(session.window) - len(new_tokens) + accepted)
    drafter.observe(new_tokens, tree.tokens, logits)
    return new_tokens, accepted


def _forced(target: Runner, cache: Cache, guide: Guide | None) -> tuple[list[int], int]:
    """The tokens the grammar forces next, and the nodes left for the drafter's tree after them: a pass takes
    the cache's room, or the most nodes the target verifies at once (a static graph's, CoreML's verify function's)."""
    most = min(cache.room(), target.tree_limit) if target.tree_limit else cache.room()
    forced = guide.forced(min(most - 1, FORCED_TOKENS)) if guide is not None else []
    return forced, most - len(forced)


def verify(target: Runner, session: Session, tree: Tree, sampler: Sampler | None,
           masks: np.ndarray | None = None, scores: Scores | None = None) -> tuple[list[int], int, np.ndarray]:
    """Verifies `tree` in one target pass and commits what it accepts. Returns (new committed tokens,
    accepted draft tokens, the target's logits at the tree's nodes). `masks` [N, V]: the tokens a
    constraint admits after each node (None: all). Seeded sampling accepts as greedy does, the target's
    choice being its seeded draw (runtime/decoding/seeded.py); unseeded, by rejection sampling."""
    cache, topo = session.cache, tree.topology
    out = target.forward(cache, tree.tokens, cache.length + topo.depths,      # 2. verify in one pass
                         topo.ancestor_mask, range(tree.size))
    logits = out.logits if masks is None else np.where(masks, out.logits, -np.inf)
    if sampler is None:                                                       # 3. accept
        path, bonus = accept_greedy(tree.tokens, topo.children, logits.argmax(-1))
    elif sampler.seeded:
        choices = sampler.choices(sampler.rows(logits, session.committed, tree), tree, len(session.window))
        path, bonus = accept_greedy(tree.tokens, topo.children, choices)
    else:
        p_target = sampler.rows(logits, session.committed, tree)
        path, bonus = accept_sampled(tree.tokens, topo.children, p_target, tree.q_draft, sampler.rng, tree.drawn)
    new_tokens = [int(t) for t in tree.tokens[path[1:]]] + [bonus]
    if scores is not None:                                                    #    the rows that chose them
        scores.record(out.logits[path], new_tokens)
    commit(cache, out, path)                                                  # 4. keep the accepted path
    session.committed.extend(new_tokens)
    session.window.extend(new_tokens)
    return new_tokens, len(path) - 1, out.logits


class TextSink:
    """Streams text as tokens arrive, cutting at the first stop string and never showing any part of it."""

    def __init__(self, stream: TextStream, stop_strings: tuple[str, ...], on_text, on_shown=None):
        """`on_shown(tokens)`, before each on_text: how many tokens lie wholly in the text shown with it."""
        self.stream, self.stops, self.on_text, self.on_shown = stream, stop_strings, on_text, on_shown
        self.text = ""  # everything decoded so far
        self.shown = 0  # how much of it on_text has received
        self.token_ends: list[int] = []  # len(text) after each token
        self.stopped_at: int | None = None  # text index where a stop string begins

    def push(self, token: int) -> bool:
        """Adds a token; returns True when a stop string has appeared."""
        searched = len(self.text)  # no stop string lies wholly before this: only one ending after it is new
        self.text += self.stream.push(token)
        self.token_ends.append(len(self.text))
        hits = [i for i in (self.text.find(s, max(0, searched - len(s) + 1)) for s in self.stops) if i >= 0]
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
            if self.on_shown:
                self.on_shown(bisect.bisect_right(self.token_ends, upto))
            if self.on_text:
                self.on_text(self.text[self.shown : upto])
            self.shown = upto


def generate(target: Runner, codec: TextCodec, session: Session, context_ids: list[int],
             config: GenerationConfig, prefill_chunk: int, on_text=None, should_stop=None,
             step=speculative_step, guide: Guide | None = None, scores: Scores | None = None) -> Result:
    """Generates after `context_ids`, the whole conversation so far; what the session already holds
    of it (the longest common prefix) is reused. `on_text(piece)` streams the text; `should_stop()`,
    asked before every target pass, ends the generation early (stop reason "cancelled"). `step`: one
    target pass, as speculative_step (runtime/decoding/overlap.py: with the next tree drafted meanwhile).
    `guide`: config.constraint's parser state before the first new token (Grammars.start), owned by
    the caller; each step takes it (speculative_step's). `scores`: the caller's, filled with the log-probabilities
    of the emitted tokens (and of the prompt's when it asks), read from the passes that chose them."""
    if (guide is None) != (config.constraint is None):
        raise InputError("a constrained generation needs the constraint's guide (Grammars.start), and only it")
    cache = session.cache
    config.sampling.check_vocabulary(target.facts.vocab_size)
    sampler = None if config.sampling.greedy else Sampler(config.sampling, origin=len(context_ids))
    stats = _start(target, session, context_ids, config, prefill_chunk, sampler, guide, scores)
    evicted = len(session.committed) - len(session.window)  # before the first new token
    sink = TextSink(codec.stream(), config.stop_strings, on_text, None if scores is None else scores.show)
    eos = set(codec.spec.eos_token_ids) if config.stop_at_eos or guide is not None else set()
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
        if reason is None and should_stop is not None and should_stop():
            reason = "cancelled"
        if reason is None:
            if cache.room() < 1 and config.kv_policy == "sliding":
                slide(session, config.attention_sinks, target.facts.rope_frequencies)
            if cache.room() < 1:
                full = ContextOverflowError(f"the context is full ({cache.capacity} tokens) after {len(emitted)} "
                                            "new tokens; lower --max-new-tokens or export with a larger --context")
                stats.new_tokens, stats.decode_s = len(emitted), time.perf_counter() - decode_start
                full.partial = Result(token_ids=emitted, text=sink.finish(), stats=stats, stop_reason="context_full")
                raise full
            if sampler is not None:
                sampler.evicted = len(session.committed) - len(session.window) - evicted
            new_tokens, accepted = (step(target, session, sampler, scores=scores) if guide is None
                                    else speculative_step(target, session, sampler, guide, scores))
            stats.target_passes += 1
            stats.accepted_drafts += accepted
    text = sink.finish()
    if guide is not None and (reason == "eos" and guide.closed or
                              reason == "max_new_tokens" and guide.complete_after(len(emitted))):
        reason = "closed"
    if reason == "stop_string":
        emitted = emitted[: sink.tokens_before_stop()]
    stats.new_tokens = len(emitted)
    stats.decode_s = time.perf_counter() - decode_start
    stats.grammar_tokens = None if guide is None else guide.supplied
    _forget_unseen(session, len(context_ids) + len(emitted) + (reason == "eos"))
    return Result(token_ids=emitted, text=text, stats=stats, stop_reason=reason,
                  logprobs=None if scores is None else scores.emitted[: len(emitted)],
                  prompt_logprobs=scores.prompt_tokens if scores is not None and scores.prompt else None)


def _start(target: Runner, session: Session, context_ids: list[int], config: GenerationConfig,
           prefill_chunk: int, sampler: Sampler | None, guide: Guide | None, scores: Scores | None) -> Stats:
    """Checks the prompt, keeps what the session already holds of it, prefills the rest and commits the
    first new token. Under the sliding policy the conversation is one stream: a prompt longer than the
    cache slides as it is read, and a follow-up turn continues a slid cache. A prompt scored (`scores.prompt`)
    is prefilled whole, every row's logits kept."""
    cache, sliding = session.cache, config.kv_policy == "sliding"
    if not context_ids:
        raise InputError("the prompt is empty")
    if len(context_ids) > cache.capacity and not sliding:
        raise ContextOverflowError(
            f"the prompt has {len(context_ids)} tokens but the context holds {cache.capacity}: "
            f"shorten the prompt, export with a larger --context or use --kv-policy sliding")
    if sliding and scores is not None and scores.prompt:
        raise InputError("a prompt's log-probabilities need the whole prompt in the cache: not with the sliding "
                         "KV policy")
    if sliding and target.facts.rope_frequencies is None:
        raise BundleError("this bundle's manifest has no rope frequencies, which the sliding KV policy "
                          "needs: export it again with this edgespec")
    stats = Stats(prompt_tokens=len(context_ids))
    started = time.perf_counter()
    keep = _reuse(session, context_ids, sliding, config.attention_sinks)
    if scores is not None and scores.prompt:  # every row's logits: none of the prompt is kept
        keep = 0
    cache.trim(keep)
    # the rows this request can reach, taken now: a buffer doubled as the answer grows copies every valid
    # row while the answer is timed, as the step it grows in
    cache.reserve(min(len(context_ids) + config.max_new_tokens, cache.capacity))
    session.drafter.rewind(keep)
    stats.cached_tokens = keep
    if sliding:
        logits = _prefill_sliding(target, session, prefill_chunk, config.attention_sinks)
    else:
        scored = None if scores is None or not scores.prompt else \
            (lambda start, rows: scores.record_prompt(rows, context_ids[start + 1 : start + 1 + len(rows)]))
        logits = prefill(target, cache, context_ids[keep:], prefill_chunk, on_rows=scored)
    raw = logits
    if guide is not None:
        logits = np.where(guide.mask(), logits, -np.inf)
    first = int(np.argmax(logits)) if sampler is None else \
        sampler.draw(sampler.distributions(logits[None], session.committed, [[]])[0], len(session.window))
    if scores is not None:
        scores.record(raw[None], [first])
    if guide is not None:
        guide.advance([first])
    session.committed.append(first)
    session.window.append(first)
    session.drafter.observe(session.committed[-1:])
    stats.prefill_s = stats.first_token_s = time.perf_counter() - started
    return stats


def _reuse(session: Session, context_ids: list[int], sliding: bool, sinks: int) -> int:
    """Makes `context_ids` the session's conversation; returns how many of the cache's rows stay valid."""
    prior, window, cache = session.committed, session.window, session.cache
    shift, same = len(prior) - len(window), common_prefix(prior, context_ids)  # shift: tokens slid out
    if sliding and shift > 0 and sinks <= min(same - shift, cache.length) and same < len(context_ids) \
            and window[:sinks] == prior[:sinks] and window[sinks:] == prior[sinks + shift:]:
        # a slid conversation goes on from where it agrees with the cache's rows: past the sinks, window
        # index i holds conversation token i + shift (checked: the turns before slid with these sinks)
        keep = min(same - shift, cache.length)
        session.window = window[:keep] + context_ids[keep + shift:]
        session.committed = list(context_ids)
        return keep
    # otherwise a slid cache holds no prefix of the conversation: nothing of it can be reused
    reusable = window if window == prior else []
    session.begin(context_ids)
    return min(common_prefix(reusable, context_ids), len(context_ids) - 1, cache.length)


def _prefill_sliding(target: Runner, session: Session, chunk: int, sinks: int) -> np.ndarray:
    """Feeds the window's tokens the cache does not hold, in chunks cut to its room, sliding it (as
    generation does) when it is full; returns the last token's logits."""
    cache, window = session.cache, session.window
    logits = None
    while cache.length < len(window):
        if cache.room() < 1:
            slide(session, sinks, target.facts.rope_frequencies)  # drops rows, and their tokens from window
        n = min(chunk, len(window) - cache.length, cache.room())
        logits = prefill(target, cache, window[cache.length : cache.length + n], chunk)
    return logits


def _forget_unseen(session: Session, seen: int) -> None:
    """Forgets what was accepted past the stop, so the next turn continues from what the user saw."""
    unseen = len(session.committed) - seen
    session.committed = session.committed[: len(session.committed) - unseen]
    session.window = session.window[: len(session.window) - unseen]
    session.cache.trim(min(session.cache.length, len(session.window) - 1))


def slide(session: Session, sinks: int, rope_frequencies) -> None:
    """Makes room in a full cache: evicts a quarter of the rows after the attention sinks."""
    cache = session.cache
    count = max(1, (cache.capacity - sinks) // 4)
    if sinks + count > cache.length:
        raise ContextOverflowError(f"the KV cache ({cache.capacity} tokens) is too small to keep "
                                   f"{sinks} attention sinks and slide")
    cache.evict(sinks, count, rope_frequencies)
    del session.window[sinks : sinks + count]
    session.drafter.rewind(sinks)  # drafters rebuild what they kept past the sinks from the new window
