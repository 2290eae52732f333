"""The step controller's arithmetic, pure: a step's price, the choice among prices, and the ledger that keeps
speculation from losing to plain decoding (runtime/decoding/controller.py uses them; the tests check them
with given costs and acceptance, no model).

A price is the tokens a step is expected to commit and the seconds it is expected to take (drafting and the
pass of its rows, from this device's own measurements). The choice takes plain decoding unless another
price beats it by `margin`: prices are estimates, and a speculative step that only ties pays for its
drafting, its rows and the controller's bookkeeping (history.md §85).

A ledger is what one source (the controller keeps one for its draft model) has gained over plain decoding,
in tokens: each step that verified its tokens adds the tokens committed less the plain steps its wall time
would have bought. When it falls below `floor`, the
source is not paying here, whatever the prices said (mispriced rows, a draft that agrees less than
measured, bookkeeping a plain step does not pay): the controller stops asking it, and asks it once as a
probe after `interval` steps, the interval doubling while probes find nothing and back at its first value
once the source has paid again.
"""
from __future__ import annotations

from dataclasses import dataclass

LEDGER_DECAY = 0.98  # each step keeps this share of what the ledger held: it follows the workload
LEDGER_FLOOR = -1.0  # tokens: below this, speculation has lost more than a step's worth
LEDGER_EVIDENCE = 8  # full steps since the last reset before the ledger may judge: one slow pass is not a verdict
PROBE_FIRST, PROBE_MOST = 8, 256  # plain steps between probes: the first interval, the longest


@dataclass(frozen=True)
class Price:
    tokens: float  # expected tokens committed
    seconds: float  # expected seconds: drafting and the pass

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def choose(prices: dict[str, Price], margin: float) -> str:
    """The choice with the highest rate if it beats plain's ("plain" must be among `prices`) by more than
    `margin` (0.02: by 2%); else plain."""
    best = max(prices, key=lambda name: prices[name].rate)
    return best if prices[best].rate > prices["plain"].rate * (1.0 + margin) else "plain"


class Ledger:
    """What speculation gained over plain decoding, in tokens, decayed (see the module's note)."""

    def __init__(self, floor: float = LEDGER_FLOOR, decay: float = LEDGER_DECAY, evidence: int = LEDGER_EVIDENCE):
        self.floor, self.decay, self.evidence = floor, decay, evidence
        self.gained = 0.0
        self.peak = 0.0  # the most it held since the last reset: whether speculation paid in this stretch
        self.steps = 0

    def add(self, tokens: int, seconds: float, plain_seconds: float) -> None:
        """A full step that committed `tokens` in `seconds`, where a plain step takes `plain_seconds`."""
        self.gained = self.gained * self.decay + tokens - seconds / plain_seconds
        self.peak = max(self.peak, self.gained)
        self.steps += 1

    @property
    def losing(self) -> bool:
        return self.steps >= self.evidence and self.gained < self.floor

    def reset(self) -> None:
        self.gained = self.peak = 0.0
        self.steps = 0


class Probes:
    """When a controller asks a benched source again: after `interval` steps, doubled after a stretch in which
    the source never paid, back to the first after one where it did."""

    def __init__(self, first: int = PROBE_FIRST, most: int = PROBE_MOST):
        self.first, self.most = first, most
        self.interval = first

    def after_stretch(self, paid: bool) -> None:
        self.interval = self.first if paid else min(self.most, 2 * self.interval)
