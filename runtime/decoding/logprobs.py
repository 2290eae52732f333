"""Log-probabilities of the tokens a generation emits, and of its prompt's, as the OpenAI API reports them.

What they are: the log-softmax of the target's own logits at the row that chose the token, before a
constraint's mask, the logit bias, penalties, temperature or truncation (vLLM's default, "raw"): what the
model believes, whatever the request did with it. They are read from the verify pass that accepted the
token, so they cost no extra pass, and for greedy decoding they are plain decoding's to the bit (the
rows are an exact pass's, engine.verify). A prompt's come from its prefill chunks, every row's logits
kept (execution/model.prefill's on_rows).

`Scores` is the caller's: one per generation, passed to engine.generate, filled by engine.verify (the
emitted tokens' rows) and by the prefill (the prompt's), and told by the text sink how many tokens have
been shown, so that a stream can send each token's log-probability with its text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MOST_ALTERNATIVES = 20  # top_logprobs, as OpenAI's API caps it


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at that row with their logprobs, likeliest first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[R, V] -> [R, V] float64."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def scored(logits: np.ndarray, tokens, top: int) -> list[TokenLogprob]:
    """Each row's token's logprob and the row's `top` likeliest tokens (ties: the lower id first)."""
    logprobs = log_softmax(logits)
    entries = []
    for row, token in zip(logprobs, tokens):
        best = ()
        if top:
            candidates = np.argpartition(-row, top - 1)[:top] if top < len(row) else np.arange(len(row))
            order = candidates[np.lexsort((candidates, -row[candidates]))]
            best = tuple((int(t), float(row[t])) for t in order)
        entries.append(TokenLogprob(int(token), float(row[int(token)]), best))
    return entries


@dataclass
class Scores:
    """One generation's log-probabilities: `top` alternatives per token (0..MOST_ALTERNATIVES); `prompt`:
    the prompt's tokens' too (the first has none: nothing comes before it)."""

    top: int = 0
    prompt: bool = False
    emitted: list[TokenLogprob] = field(default_factory=list)  # every committed new token's, past a stop too
    prompt_tokens: list[TokenLogprob] = field(default_factory=list)  # the prompt's second token's on
    shown: int = 0  # tokens whose text the sink has shown (set on the generating thread)
    sent: int = 0  # of those, the ones take_shown has handed out

    def __post_init__(self):
        if isinstance(self.top, bool) or not isinstance(self.top, int) or not 0 <= self.top <= MOST_ALTERNATIVES:
            raise ValueError(f"top logprobs must be an integer in 0..{MOST_ALTERNATIVES} (got {self.top!r})")

    def record(self, logits: np.ndarray, tokens) -> None:
        """logits [k, V]: the rows that chose `tokens` [k], in order."""
        self.emitted.extend(scored(logits, tokens, self.top))

    def record_prompt(self, logits: np.ndarray, following) -> None:
        """logits [k, V] of k prompt rows; following [k]: the prompt token after each (fewer at its end)."""
        self.prompt_tokens.extend(scored(logits[: len(following)], following, self.top))

    def show(self, tokens: int) -> None:
        self.shown = tokens

    def take_shown(self) -> list[TokenLogprob]:
        """The entries of the tokens shown since the last call (on the generating thread, in on_text)."""
        taken = self.emitted[self.sent : self.shown]
        self.sent = max(self.sent, self.shown)
        return taken
