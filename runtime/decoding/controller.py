"""The step controller: each step verifies the tree, down to the root alone (a plain step), with the most
expected tokens per second, from this device's measured pass costs and each source's running acceptance.

Sources: suffix drafting (runtime/decoding/suffix.py), free to ask, so its candidates are computed every step and
scored against what the target commits even when they are not verified; and a main drafter (a draft
model, n-gram or Token Recycling), asked only when what it has yielded per pass pays for its drafting
time and its pass, and tried again now and then when it does not (its acceptance may have changed).

Expected tokens of the suffix tree's first k nodes (most probable first): 1 + the sum over them of the
product, along each node's path, of p_j = rate(match length, depth j) x the trie's probability of the
node given its parent, `rate` counted (with decay) over earlier steps; cost: the measured seconds of a
pass of k + 1 rows. A speculative choice must beat plain's price by MARGIN (runtime/decoding/pricing.py:
choose). Greedy output does not depend on which tree is verified, and sampling stays exact because the
choice depends only on earlier steps.

Never losing to plain decoding: prices can be wrong (a pass's rows, a draft that agrees less than it did,
the controller's own bookkeeping), so each step that asked a source is also timed whole, from propose to
observe, and entered in that source's ledger of what it gained over plain steps (pricing.py: Ledger): the
main drafter's (LEDGERED). A source whose ledger is losing is benched: not asked (no drafting, no pricing)
for a number of steps, then asked once as a probe (pricing.py: Probes). With every source benched a step
costs what a plain step does.

State: the controller owns its measurements (they describe the device and the workload, and outlive a
request: a pipeline's drafter keeps them across turns); the sources own theirs.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .drafters import Drafter
from .lookup import graft_chain
from .pricing import Ledger, Price, Probes, choose
from .sampling import Sampler
from .suffix import SuffixDrafter, SuffixProposal
from .tree import Tree

DECAY = 0.98  # each count keeps this share per new observation: acceptance follows the workload
EXTRA_ROW_PRIOR = 0.25  # a pass's extra row, as a share of a one-row pass, until passes of that size are timed
EXPLORE_EVERY = 16  # a main drafter left out for plain steps this many steps in a row is asked once more
MARGIN = 0.02  # a speculative price must beat plain's by this share (pricing.choose)
PLAIN_SMOOTHING = 0.1  # the moving average of a plain step's whole seconds, while sources are idle
SPIKE = 2.0  # a step is charged at most this many times its price: beyond it, another process preempted it
SOURCES = ("suffix", "draft")  # what can be benched: suffix drafting, the main drafter
# what the ledgers bench: the main drafter, whose steps cost its passes and a row each. Suffix drafting's cost
# is a lookup (tens of microseconds, history.md §57); a ledger of it on a loaded machine weighed preemption
# and benched it where its chains paid (history.md §85)
LEDGERED = ("draft",)


def alone() -> int:
    """No other conversation shares the next pass."""
    return 0


def bucket(value: int, buckets: int = 4) -> int:
    """0 for 1, 1 for 2-3, 2 for 4-7, ... capped at buckets - 1."""
    return min(buckets - 1, max(0, int(value).bit_length() - 1))


class PassCosts:
    """Seconds of a verify pass by its rows, timed in the loop: a moving average per row count (the first
    pass of a shape is left out: onnxruntime allocates for it), read through a line over the counts of
    two rows or more, fitted robustly (Theil-Sen: the median of the pairwise slopes), since a shared
    machine's passes are noisy and a count rarely chosen is rarely timed again; the line also prices
    counts never timed. With one count timed, EXTRA_ROW_PRIOR of a one-row pass per extra row. A one-row
    pass is priced alone: it may take other kernels (docs/exactness.md)."""

    def __init__(self, smoothing: float = 0.1):
        self.smoothing = smoothing
        self.seconds_by_rows: dict[int, float] = {}
        self.seen: set[int] = set()

    def record(self, rows: int, seconds: float) -> None:
        if rows not in self.seen:
            self.seen.add(rows)
            return
        old = self.seconds_by_rows.get(rows)
        self.seconds_by_rows[rows] = seconds if old is None else old + self.smoothing * (seconds - old)

    def seconds(self, rows: int) -> float:
        known = self.seconds_by_rows
        if not known:
            return 1.0 + EXTRA_ROW_PRIOR * (rows - 1)  # in one-row passes: only ratios matter until timed
        one_row = known.get(1) or min(known.values()) / (1 + EXTRA_ROW_PRIOR * (min(known) - 1))
        if rows == 1:
            return one_row
        several = sorted((r, s) for r, s in known.items() if r > 1)
        if len(several) < 2:
            anchor, at = several[0] if several else (1, one_row)
            return max(one_row, at + EXTRA_ROW_PRIOR * one_row * (rows - anchor))
        intercept, slope = theil_sen(*np.array(several, dtype=float).T)
        return max(one_row, intercept + slope * rows)


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope >= 0) of the line through points with at least two distinct x: the median of the
    pairwise slopes, then the median intercept. One wild point does not bend it."""
    i, j = np.triu_indices(len(x), 1)
    apart = x[j] != x[i]
    slope = max(0.0, float(np.median((y[j] - y[i])[apart] / (x[j] - x[i])[apart])))
    return float(np.median(y - slope * x)), slope


class DraftCost:
    """Seconds the main drafter takes a step, from its recent calls: a draft model first catches up on the
    tokens committed since it last ran (more after steps that left it out), so the seconds are fitted
    against those tokens and read at what one step commits when it drafts every step. Its first call
    catches up on the whole prompt: read at one step's tokens as it stands, that would price every step
    as a prompt and leave the drafter out until EXPLORE_EVERY steps later, so until a second count is
    timed the seconds scale with the tokens (history.md §76)."""

    def __init__(self, keep: int = 16):
        self.keep, self.calls = keep, []  # (tokens it caught up on, seconds)

    def record(self, behind: int, seconds: float) -> None:
        self.calls = self.calls[-(self.keep - 1):] + [(behind, seconds)]

    def seconds(self, behind: float) -> float:
        if not self.calls:
            return 0.0
        x, y = np.array(self.calls, dtype=float).T
        if len(set(x)) < 2:  # no slope yet: through the origin, hopeful as a fresh start is (Measurements.fresh)
            return float(y[0] * behind / x[0]) if x[0] > 0 else float(y.min())
        intercept, slope = theil_sen(x, y)
        return max(0.0, intercept + slope * behind)


class DecayedMean:
    """Weighted means per cell over recent observations (older ones fade by DECAY each), starting from
    `prior` worth `weight` observations: acceptance rates (hits per try) and mean costs alike."""

    def __init__(self, shape: tuple[int, ...], prior, weight: float = 2.0):
        self.total = np.broadcast_to(np.asarray(prior, dtype=float) * weight, shape).copy()
        self.weight = np.full(shape, float(weight))

    def add(self, cell, value: float, weight: float = 1.0) -> None:
        self.total[cell] = self.total[cell] * DECAY + value
        self.weight[cell] = self.weight[cell] * DECAY + weight

    def mean(self, cell=0) -> float:
        return float(self.total[cell] / self.weight[cell])


class DepthRates(DecayedMean):
    """Acceptance per [match-length bucket, depth bucket], each depth's prior the depth above it: the
    tokens a step commits score a chain's first depths only, so the deeper ones, until tried, are
    expected to go on as the shallower did (a quote accepted so far tends to stay accepted)."""

    def __init__(self, first_depth_prior: np.ndarray, depths: int, weight: float = 2.0):
        super().__init__((len(first_depth_prior), depths), prior=0.0, weight=0.0)
        self.first_depth_prior, self.prior_weight = first_depth_prior, weight

    def mean(self, cell) -> float:
        length_bucket, depth_bucket = cell
        prior = self.first_depth_prior[length_bucket] if depth_bucket == 0 else self.mean((length_bucket, depth_bucket - 1))
        return float((self.total[cell] + self.prior_weight * prior) / (self.weight[cell] + self.prior_weight))


@dataclass
class SourceCounts:
    """What each choice did, for `bench`: steps taken and tokens committed by each."""
    steps: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, choice: str, tokens: int) -> None:
        self.steps[choice] = self.steps.get(choice, 0) + 1
        self.tokens[choice] = self.tokens.get(choice, 0) + tokens

    def since(self, before: "SourceCounts") -> dict:
        return {c: {"steps": n - before.steps.get(c, 0), "tokens": self.tokens[c] - before.tokens.get(c, 0)}
                for c, n in self.steps.items() if n > before.steps.get(c, 0)}

    def copy(self) -> "SourceCounts":
        return SourceCounts(dict(self.steps), dict(self.tokens))


@dataclass
class Measurements:
    """What the step controller has measured: pass costs (they describe the device) and each source's
    acceptance (the workload). A pipeline keeps one for all its requests, so that each starts from what
    the ones before it measured, as its Token Recycling table and suffix store do."""
    costs: PassCosts
    # the suffix chain's acceptance per [match-length bucket, depth bucket], per unit of the trie's probability
    suffix_rates: DepthRates
    # the main drafter: tokens a pass with its tree yields, its tree's nodes, its last few drafting times
    main_tokens: DecayedMean
    main_size: DecayedMean
    main_draft: DraftCost = field(default_factory=DraftCost)
    # shared passes of the slots graph by the conversations aboard: their seconds by rows, as the slots
    # passes themselves ran (SharedPasses.timed): a slots pass's base is not the single graph's (§68, §70)
    shared_costs: dict[int, PassCosts] = field(default_factory=dict)
    # per source ("suffix", "draft"): what it gained over plain steps, its probes while it does not pay, the
    # steps it stays benched (0: asked every step), whether its next step asking it is a probe; and a plain
    # step's whole seconds with every source idle
    ledgers: dict[str, Ledger] = field(default_factory=lambda: {s: Ledger() for s in SOURCES})
    probes: dict[str, Probes] = field(default_factory=lambda: {s: Probes() for s in SOURCES})
    benched: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    probing: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(SOURCES, False))
    plain_step_s: float | None = None

    def record_plain_step(self, seconds: float) -> None:
        old = self.plain_step_s
        self.plain_step_s = seconds if old is None else old + PLAIN_SMOOTHING * (seconds - old)

    def record_shared(self, conversations: int, rows: int, seconds: float) -> None:
        self.shared_costs.setdefault(conversations, PassCosts()).record(rows, seconds)

    @classmethod
    def fresh(cls, main_size: int) -> "Measurements":
        """Hopeful starts, measured within a few steps (a pessimistic one might never be): a longer match
        is a quote more often (history.md §32), and a main drafter's tree is half accepted."""
        return cls(PassCosts(), DepthRates(np.array([0.4, 0.6, 0.75, 0.85]), depths=4),
                   DecayedMean((1,), prior=1.0 + 0.5 * (main_size - 1)), DecayedMean((1,), prior=float(main_size)))


class Controller:
    """A Drafter that chooses, each step, among a plain step, the suffix drafter's chain (of the best
    length), the main drafter's tree, and where the graph has lanes for it the main tree with the suffix
    chain grafted on.

    `sharing()`: how many other conversations' passes the next pass carries (runtime/execution/
    shared_passes.py sets it while a conversation shares passes). With others aboard, a greedy step is
    priced as the whole pass's tokens per its seconds, the others taken as plain steps (one row, one token
    each): a tree's rows then slow every conversation's step, so speculation is chosen only where its
    extra tokens pay for that (history.md §65, §68). Greedy output does not depend on the tree; a sampled
    step keeps its pricing alone. A shared pass's seconds (waits for the others included) are not timed
    into the pass costs."""

    def __init__(self, suffix: SuffixDrafter | None, main: Drafter | None, lanes: int, measured: Measurements):
        """`measured`: the caller's, shared by its controllers (Measurements.fresh for a new one)."""
        self.suffix, self.main, self.lanes = suffix, main, lanes
        self.measured = measured
        self.counts = SourceCounts()
        self.left_out = 0
        self.main_seen = 0  # the committed tokens the main drafter had when it last drafted
        self._step: tuple | None = None  # (choice, tree, proposal, main nodes, verify start, shared, step start,
        # full: whether the sources were asked, the chosen price's seconds)
        self.sharing: Callable[[], int] = alone
        self.root = Tree.from_parents((-1,), [0]).topology  # a plain step's, made once

    # 1. choose and draft
    def propose(self, committed: list[int], max_nodes: int, sampler: Sampler | None,
                target_features: np.ndarray | None = None) -> Tree:
        started = time.perf_counter()
        shared = self.sharing()
        measured = self.measured
        asked = self._asked()
        if not asked:  # no source pays here: a plain step at a plain step's cost
            tree = Tree(self.root, np.array([committed[-1]], dtype=np.int64))
            self._step = ("plain", tree, None, 0, time.perf_counter(), shared > 0, started, asked, None)
            return tree
        others = shared if sampler is None else 0
        proposal = self.suffix.proposal(committed, max_nodes) if "suffix" in asked else None
        expected, k = self._best_prefix(proposal, others)
        prices = {"plain": self._price(1.0, 1, others)}
        if k:
            prices["suffix"] = self._price(expected, k + 1, others)
        if "draft" in asked:
            main_tokens = measured.main_tokens.mean()
            main_s = measured.main_draft.seconds(main_tokens)  # drafting every step: one step's tokens behind
            size = max(1, round(measured.main_size.mean()))
            prices["draft"] = self._price(main_tokens, size, others, main_s)
            if k and self.lanes > 1:
                prices["draft+suffix"] = self._price(main_tokens + expected - 1, size + k, others, main_s)
        choice = choose(prices, MARGIN)
        if "draft" in asked and choice == "plain" and self.left_out >= EXPLORE_EVERY:
            choice = "draft"
        self.left_out = 0 if "draft" in choice else self.left_out + 1
        tree, main_nodes = self._draft(choice, proposal, k, committed, max_nodes, sampler, target_features)
        self._step = (choice, tree, proposal, main_nodes, time.perf_counter(), shared > 0, started, asked,
                      prices[choice].seconds)
        return tree

    def _asked(self) -> frozenset[str]:
        """The sources this step asks: those the controller has and that are not benched; a bench's last
        step makes the next one that asks its source a probe."""
        measured, asked = self.measured, set()
        for source, present in (("suffix", self.suffix is not None), ("draft", self.main is not None)):
            if not present:
                continue
            if measured.benched[source] > 0:
                measured.benched[source] -= 1
                measured.probing[source] = measured.benched[source] == 0
                continue
            asked.add(source)
        return frozenset(asked)

    def _price(self, tokens: float, rows: int, others: int, drafting_s: float = 0.0) -> Price:
        """A pass of this step's `rows` beside `others` plain steps: the others wait for its drafting too (one
        conversation computes at a time)."""
        costs = self.measured.costs
        if others:  # the slots passes' own seconds for this many conversations, once timed (§70)
            shared = self.measured.shared_costs.get(others + 1)
            costs = shared if shared is not None and shared.seconds_by_rows else costs
        return Price(tokens + others, drafting_s + costs.seconds(rows + others))

    def _rate(self, tokens: float, rows: int, others: int, drafting_s: float = 0.0) -> float:
        return self._price(tokens, rows, others, drafting_s).rate

    def _best_prefix(self, proposal: SuffixProposal | None, others: int = 0) -> tuple[float, int]:
        """(expected tokens, drafted nodes) of the suffix tree's best prefix by expected tokens per pass
        second: its nodes come most probable first, parents before children, so every prefix is a tree."""
        if proposal is None or proposal.tree.size < 2:
            return 1.0, 0
        topology, length_bucket = proposal.tree.topology, bucket(proposal.match_length)
        reach = np.ones(topology.size)
        expected, best = 1.0, (self._rate(1.0, 1, others), 1.0, 0)
        for node in range(1, topology.size):
            rate = self.measured.suffix_rates.mean((length_bucket, bucket(int(topology.depths[node]))))
            reach[node] = reach[topology.parents[node]] * min(1.0, rate * proposal.parent_probability[node])
            expected += reach[node]
            value = self._rate(expected, node + 1, others)
            if value > best[0]:
                best = (value, expected, node)
        return best[1], best[2]

    def _draft(self, choice, proposal, k, committed, max_nodes, sampler, target_features) -> tuple[Tree, int]:
        if choice == "plain":
            return proposal.chain(0) if proposal is not None else Tree.from_parents((-1,), [committed[-1]]), 0
        if choice == "suffix":
            return proposal.prefix(k), 0
        started = time.perf_counter()
        tree = self.main.propose(committed, max_nodes, sampler, target_features).within_paths(self.lanes)
        self.measured.main_draft.record(len(committed) - self.main_seen, time.perf_counter() - started)
        self.main_seen = len(committed)
        main_nodes = tree.size
        if choice == "draft+suffix":
            tree = graft_chain(tree, [int(t) for t in proposal.chain(k).tokens[1:]], max_nodes).within_paths(self.lanes)
        return tree, main_nodes

    # 2. learn from what the target kept
    def observe(self, accepted: list[int], tokens: np.ndarray | None = None, logits: np.ndarray | None = None) -> None:
        if self.main is not None:
            self.main.observe(accepted, tokens, logits)
        if tokens is None or self._step is None:
            return
        choice, tree, proposal, main_nodes, verify_start, shared, step_start, asked, priced_s = self._step
        self._step = None
        if not shared:
            self.measured.costs.record(tree.size, time.perf_counter() - verify_start)
        self.counts.add(choice, len(accepted))
        if not shared:
            self.account(choice, len(accepted), time.perf_counter() - step_start, asked, priced_s)
        if proposal is not None and proposal.tree.size > 1:
            self._score_suffix(proposal, accepted)
        if main_nodes:
            path = self._accepted_nodes(tree, accepted)
            self.measured.main_tokens.add(0, 1 + sum(1 for node in path if node < main_nodes))
            self.measured.main_size.add(0, main_nodes)

    def account(self, choice: str, tokens: int, seconds: float, asked: frozenset[str],
                priced_s: float | None = None) -> None:
        """The step's whole seconds: a step that asked no source times plain decoding's; one that verified
        the main drafter's tree goes into its ledger. A source whose ledger is losing, or whose probe was
        not chosen, is benched until its next probe. A
        step is charged at most SPIKE times its price (a plain step at most SPIKE times their average):
        beyond that another process preempted it, which a shared machine does to any step, and one such
        step must not decide."""
        measured = self.measured
        if not asked:
            plain = measured.plain_step_s
            measured.record_plain_step(seconds if plain is None else min(seconds, SPIKE * plain))
            return
        source = "draft" if "draft" in choice and "draft" in LEDGERED else None
        for probed in asked:
            if measured.probing[probed]:
                measured.probing[probed] = False
                if probed in LEDGERED and probed != source:
                    self._bench(probed)
        if source is None or measured.benched[source] or (measured.plain_step_s is None
                                                          and not measured.costs.seconds_by_rows):
            return  # nothing verified from a source, or no pass timed yet to weigh the step against
        charged = seconds if priced_s is None else min(seconds, SPIKE * priced_s)
        ledger = measured.ledgers[source]
        ledger.add(tokens, charged, measured.plain_step_s or measured.costs.seconds(1))
        if ledger.losing:
            self._bench(source)

    def _bench(self, source: str) -> None:
        measured = self.measured
        ledger = measured.ledgers[source]
        measured.probes[source].after_stretch(paid=ledger.peak > -ledger.floor)
        measured.benched[source] = measured.probes[source].interval
        ledger.reset()

    def _score_suffix(self, proposal: SuffixProposal, accepted: list[int]) -> None:
        """Counts the suffix chain's tokens against the committed ones, as far as those are known."""
        length_bucket = bucket(proposal.match_length)
        for depth, (node, token) in enumerate(zip(proposal.first_path()[1:], accepted), start=1):
            hit = int(proposal.tree.tokens[node]) == token
            self.measured.suffix_rates.add((length_bucket, bucket(depth)), hit, float(proposal.parent_probability[node]))
            if not hit:
                break

    @staticmethod
    def _accepted_nodes(tree: Tree, accepted: list[int]) -> list[int]:
        node, path = 0, []
        for token in accepted[:-1]:
            node = next(c for c in tree.topology.children[node] if int(tree.tokens[c]) == token)
            path.append(node)
        return path

    def rewind(self, length: int) -> None:
        self._step = None
        self.main_seen = min(self.main_seen, length)
        for source in (self.suffix, self.main):
            if source is not None:
                source.rewind(length)
