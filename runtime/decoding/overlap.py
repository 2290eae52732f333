"""Drafting while the target verifies (PEARL's post-verify): the draft and the target run at once, each on
its own processor or its own cores.

While the target verifies tree k, a worker thread drafts tree k + 1 from the outcome most likely to
happen: every node on the tree's first-child path accepted, and as the bonus token the draft's own next
token after it. When verification commits exactly that, tree k + 1 is ready the moment the pass ends;
otherwise it is dropped and the draft rewinds and drafts from what was committed, as a sequential step
would. onnxruntime releases the GIL while a session runs, so the two passes overlap in one process.

Lossless as the sequential step is: the target verifies every tree whatever drafted it. Under sampling,
the worker draws from a random stream of its own, and a kept tree was drawn from the draft's distribution
given exactly the committed tokens, so acceptance sees the q_draft it was drawn from (tests/test_overlap.py).

A feature-reading draft (EAGLE) drafts ahead of the target's features: the rows it has not seen verified
take its own predicted features (drafters.catch_up), and are fed again with the target's once they are
known, so drafting ahead lowers a kept tree's acceptance a little and never its correctness.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..execution.runner import Runner
from .drafters import Drafter
from .engine import Session, verify
from .logprobs import Scores
from .sampling import Sampler
from .tree import Tree


@dataclass(frozen=True)
class Ahead:
    """A tree drafted before its root was committed: valid if the window becomes `window`."""

    window: list[int]
    tree: Tree


def likely_path(tree: Tree) -> list[int]:
    """The tokens after the root along each node's first child: the drafter's most likely continuation
    (drafters order siblings most likely first)."""
    children, node, tokens = tree.topology.children, 0, []
    while children[node]:
        node = children[node][0]
        tokens.append(int(tree.tokens[node]))
    return tokens


class Overlap:
    """One generation's overlapped steps: `step` replaces engine.speculative_step; `settle` ends it."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-draft")
        self.worker_sampler: Sampler | None = None  # the worker's random stream, spawned from the generation's
        self.ready: Ahead | None = None
        # the draft has seen committed tokens [0, trusted) with the target's features (None: all it holds)
        self.trusted: int | None = None
        self.kept = 0  # trees drafted ahead that were used
        self.drafted_ahead = 0

    def step(self, target: Runner, session: Session, sampler: Sampler | None = None,
             scores: Scores | None = None) -> tuple[list[int], int]:
        """One target pass with the next tree drafted meanwhile. Returns (new committed tokens, accepted drafts)."""
        cache, drafter, window = session.cache, session.drafter, list(session.window)
        if sampler is not None and self.worker_sampler is None:
            self.worker_sampler = sampler.spawn()
        if sampler is not None:
            self.worker_sampler.evicted = sampler.evicted
        tree = self.ready.tree if self.ready is not None and self.ready.window == window else None
        if tree is None:                                                          # 1. draft, unless drafted ahead
            drafter.rewind(len(window) if self.trusted is None else self.trusted)
            tree = drafter.propose(window, cache.room(), sampler, cache.feature_rows())
            self.trusted = len(window)  # fed now with the target's features: the worker need not feed them again
        else:
            self.kept += 1
        tree = tree.within_paths(cache.lanes)
        ahead = self._draft_ahead(drafter, window, tree, cache.room(), cache.feature_rows())
        new_tokens, accepted, logits = verify(target, session, tree, sampler, None, scores)  # 2.-4., drafting meanwhile
        self.ready = None if ahead is None else ahead.result()                  # 5. the drafter is idle again
        drafter.observe(new_tokens, tree.tokens, logits)
        return new_tokens, accepted

    def _draft_ahead(self, drafter: Drafter, window: list[int], tree: Tree, room: int,
                     target_features) -> Future | None:
        """Starts drafting the tree that follows if `tree`'s likely path and the draft's next token are committed."""
        path = likely_path(tree)
        room_after = room - len(path) - 1  # the target cache after committing the path and the bonus token
        if room_after < 1 or not path:  # a root alone: no drafted token to guess past
            return None
        trusted = len(window) if self.trusted is None else self.trusted
        self.trusted = len(window)  # the worker feeds the whole window with the target's features
        self.drafted_ahead += 1

        def work() -> Ahead | None:
            drafter.rewind(trusted)
            lead = drafter.propose(window + path, 2, self.worker_sampler, target_features)
            if lead.size < 2:  # nothing to guess the bonus token with
                return None
            guess = window + path + [int(lead.tokens[1])]
            return Ahead(guess, drafter.propose(guess, room_after, self.worker_sampler, target_features))

        return self.pool.submit(work)

    def settle(self, session: Session) -> None:
        """Ends the generation: the draft forgets what it drafted ahead; the worker thread stops."""
        self.pool.shutdown(wait=True)  # a step cut short (an error) may have left the worker drafting
        self.ready = None
        if self.trusted is not None:
            session.drafter.rewind(min(self.trusted, len(session.window)))
