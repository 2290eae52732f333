"""Generations in flight taking target passes in turn: `edgespec serve`'s interleaving.

Where the bundle has a slots graph (exported with slots: exporters/slots.py), the generations in flight
share their target passes instead (`shared_passes_of`, `generate_sharing`: runtime/execution/shared_passes.py):
each conversation's next pass joins the others' in one pass, each with the bits it gets alone (history.md
§65). Without one, several conversations cannot share a pass with those bits (history.md §62: onnxruntime's
attention takes several sequences with a past only at one new token each, and that one-query path rounds
unlike an exact pass's two slots). So each generation keeps its own passes, exactly those it runs alone,
and the generations in flight run them one at a time, in turn: a generation holds the turn from its
start (prefill included) to its next target pass, then hands it to the one that has waited longest. A new request's prefill waits for one pass of each
generation ahead of it, not for their ends; no answer changes, whatever runs beside it (each pass
reads only its own conversation's caches, drafter and sampler).

`Turns` is the order (a ticket lock: first come, first served); each generation's `Turn` holds it and
counts the seconds it held it, which is what the generation cost the others. Touched from the
generation threads; its own lock guards it.
"""
from __future__ import annotations

import copy
import threading
import time

from edgespec.runtime.decoding.controller import Controller, alone
from edgespec.runtime.decoding.engine import Result
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.execution.shared_passes import SharedPasses, open_shared
from edgespec.runtime.pipeline import Pipeline


class Turns:
    """Who runs now: tickets served in the order they were drawn."""

    def __init__(self):
        self._changed = threading.Condition()
        self._drawn = 0  # tickets handed out
        self._serving = 0  # the ticket whose holder runs

    def acquire(self) -> None:
        with self._changed:
            ticket = self._drawn
            self._drawn += 1
            self._changed.wait_for(lambda: self._serving == ticket)

    def release(self) -> None:
        with self._changed:
            self._serving += 1
            self._changed.notify_all()

    def waiting(self) -> int:
        """Generations waiting for the turn (beside the one holding it)."""
        with self._changed:
            return max(0, self._drawn - self._serving - 1)


class Turn:
    """One generation's hold on the turns: `with turn:` from its start to its end, `pass_on()` between its
    target passes."""

    def __init__(self, turns: Turns):
        self.turns = turns
        self.held_s = 0.0  # seconds this generation held the turn before the current hold
        self.since = 0.0  # when the current hold began

    def __enter__(self) -> Turn:
        self.turns.acquire()
        self.since = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.held_s += time.perf_counter() - self.since
        self.turns.release()

    def pass_on(self) -> None:
        """Lets every generation waiting now run one turn first (a no-op when none waits)."""
        if self.turns.waiting():
            self.__exit__()
            self.__enter__()


def shared_passes_of(pipeline: Pipeline, prefill_apart: bool = False) -> SharedPasses | None:
    """Shared passes over the bundle's slots graph, where it has one and its target runs as one graph in
    memory (not streamed in stages, not CoreML); None otherwise. `prefill_apart`: SharedPasses'."""
    if not isinstance(pipeline.target, ModelRunner):
        return None
    return open_shared(pipeline.folder, pipeline.manifest.target, pipeline.target, pipeline.target_threads,
                       prefill_apart=prefill_apart)


def generate_sharing(pipeline: Pipeline, shared: SharedPasses, batch_priced: bool = False, **generate) -> Result:
    """`pipeline.generate(**generate)` with this generation's target passes shared with the others in flight.
    `batch_priced`: its step controller prices each greedy step against the whole shared pass (the others
    aboard as plain steps), not as alone, at the slots passes' own timed seconds once there are some
    (runtime/decoding/controller.py; history.md §68, §70)."""
    if generate.get("session") is None:  # its own, so that its controller can be told who shares its passes
        generate["session"] = pipeline.new_session(generate.pop("speculate", True))
    drafter = generate["session"].drafter
    with shared.target() as target:
        mine = copy.copy(pipeline)  # the same loaded models and state; only its target passes go elsewhere
        mine.target = target
        if isinstance(drafter, Controller) and batch_priced:
            drafter.sharing = lambda: shared.members() - 1
            shared.timed = drafter.measured.record_shared  # the pipeline's, shared by its controllers
        try:
            return mine.generate(**generate)
        finally:
            if isinstance(drafter, Controller):
                drafter.sharing = alone
