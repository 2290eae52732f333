"""Conversations in flight sharing target passes: each one's next pass gathered into one slots pass.

Each conversation generates as it does alone (runtime/decoding/engine.py, on a thread of its own: its
drafter, sampler, constraints and cancellation untouched), through a `SharedTarget` in place of the
target runner. Its `forward` hands the pass to `SharedPasses` and waits: the first conversation waiting
leads, gathers the passes of every conversation that has joined (or as many as the graph has slots, or
those waiting after `patience_s`), runs them in one pass of the slots graph (runtime/execution/slots.py:
each with the bits it gets alone, so no answer changes), and hands each its own result. A conversation
alone runs the single graph's pass, exactly its pass alone. A conversation joins at its next pass and
leaves when it ends (`with shared.target() as target:`); a pass the slots graph cannot take (a mask over
the past, a draft's inexact rows, features to read) runs alone, in turn. With `prefill_apart`, a prompt's
prefill chunks are not shared either: they run at once, back to back, alone (history.md §68).

Everything else a conversation computes (its drafts, sampling, text) runs under one lock, `_cpu`, which it
gives up only while it waits for its pass, and the pass runs under it too: on a machine of a few cores,
several onnxruntime runs at once (drafts beside a target pass, each with a pool of spinning threads) take
the cores from each other (history.md §62, §65), as interleaved generations never did.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..contract.errors import BackendError, EdgespecError
from .model import ModelRunner, Pass, commit
from .sessions import make_session, spinning
from .slots import SlotRunner

# the longest the first conversation waiting holds a pass for the others, which draft one after another
# under the lock: a bound for one stuck outside its passes, not a pace (history.md §65)
PATIENCE_S = 0.25


@dataclass
class _Request:
    args: tuple
    kwargs: dict
    done: bool = False
    result: Pass | None = None
    error: BaseException | None = None
    shareable: bool = field(init=False)

    def __post_init__(self):
        kw = self.kwargs
        self.shareable = (kw.get("past_mask") is None and kw.get("features") is None and kw.get("exact_rows", True)
                          and len(self.args) == 5)


class SharedPasses:
    """The target passes of every conversation that has joined, gathered into passes of `slots`."""

    def __init__(self, runner: ModelRunner, slots: SlotRunner, patience_s: float = PATIENCE_S,
                 prefill_apart: bool = False):
        self.runner, self.slots, self.patience_s = runner, slots, patience_s
        self.prefill_apart = prefill_apart
        self.apart = 0  # prefill chunks run apart
        self._changed = threading.Condition()
        self._queue: list[_Request] = []
        self._members = 0  # conversations joined
        self._running = False
        self._cpu = threading.Lock()  # held by the conversation computing, or by the pass running
        # told (conversations, rows, seconds) of every slots pass, where a caller prices steps by them (§70)
        self.timed: Callable[[int, int, float], None] | None = None
        self.passes = 0  # passes run, and conversation passes they held: their ratio is the mean batch
        self.parts = 0

    @contextmanager
    def target(self):
        """A conversation's target for as long as it generates: its passes are shared from the next one on."""
        with self._changed:
            self._members += 1
        self._cpu.acquire()
        try:
            yield SharedTarget(self)
        finally:
            self._cpu.release()
            with self._changed:
                self._members -= 1
                self._changed.notify_all()

    def members(self) -> int:
        with self._changed:
            return self._members

    def forward(self, args: tuple, kwargs: dict) -> Pass:
        """Called holding `_cpu` (from `target`): gives it up while the pass waits and runs, takes it back."""
        if self.prefill_apart and _prefill_chunk(args):
            # run now, keeping `_cpu`: a chunk already runs the matmuls at full width, so sharing its pass
            # saves little, and a prompt shared one chunk a round waits a round of every other
            # conversation's compute per chunk before its first token (history.md §65, §68)
            self.apart += 1
            return self.runner.forward(*args, **kwargs)
        request, batch = _Request(args, kwargs), None
        self._cpu.release()
        try:
            with self._changed:
                self._queue.append(request)
                self._changed.notify_all()
                while not request.done:
                    if not self._running and self._queue and self._queue[0] is request:
                        batch = self._gather(request)
                        break
                    self._changed.wait()
            if batch is not None:
                with self._cpu:
                    self._run(batch)
        finally:
            self._cpu.acquire()
        return self._result(request)

    def _gather(self, leader: _Request) -> list[_Request]:
        """Called by the leader, holding the lock: waits for the others' passes, then takes its batch."""
        batch = [leader]
        if leader.shareable:
            self._changed.wait_for(lambda: self._ready() >= min(self._members, self.slots.slots),
                                   timeout=self.patience_s)
            batch = [r for r in self._queue if r.shareable][: self.slots.slots]  # the leader first: it heads the queue
        for r in batch:
            self._queue.remove(r)
        self._running = True
        return batch

    def _ready(self) -> int:
        return sum(r.shareable for r in self._queue)

    def _run(self, batch: list[_Request]) -> None:
        """Runs `batch` (its first request the leader's, whose thread this is) and hands each request its
        result. An error the pass raises ends the leader's call with it, and each other one's with a
        BackendError that points there."""
        try:
            if len(batch) == 1:
                batch[0].result = self.runner.forward(*batch[0].args, **batch[0].kwargs)
            else:
                self._run_shared(batch)
        finally:
            with self._changed:
                for r in batch[1:]:
                    if r.result is None and r.error is None:
                        r.error = BackendError("the shared target pass this conversation was in failed; the "
                                               "conversation that ran it raised the error")
                self.passes += 1
                self.parts += len(batch)
                for r in batch:
                    r.done = True
                self._running = False
                self._changed.notify_all()

    def _run_shared(self, batch: list[_Request]) -> None:
        parts, placed = [], []
        for r in batch:
            try:
                parts.append(self.slots.layout(*r.args))
                placed.append(r)
            except EdgespecError as err:  # this conversation's pass is refused, not the others'
                r.error = err
        if not parts:
            return
        started = time.perf_counter()
        outs = self.slots.run(parts)
        if self.timed is not None:
            self.timed(len(parts), sum(p.layout.rows for p in parts), time.perf_counter() - started)
        for r, out in zip(placed, outs):
            r.result = out

    @staticmethod
    def _result(request: _Request) -> Pass:
        if request.error is not None:
            raise request.error
        return request.result


def _prefill_chunk(args: tuple) -> bool:
    """A pass of several tokens that asks for one row's logits: a prompt's chunk (runtime/execution/model.py
    `prefill`), where a verify pass asks for every node's."""
    return len(args) == 5 and len(args[1]) > 1 and len(args[4]) == 1


class SharedTarget:
    """The target runner as one conversation sees it: its passes go through `SharedPasses`, all else is the
    runner's."""

    def __init__(self, shared: SharedPasses):
        self._shared = shared

    def __getattr__(self, name):
        return getattr(self._shared.runner, name)

    def forward(self, *args, **kwargs) -> Pass:
        return self._shared.forward(args, kwargs)


def open_shared(folder, target, runner: ModelRunner, threads: int | None,
                patience_s: float = PATIENCE_S, prefill_apart: bool = False) -> SharedPasses | None:
    """Shared passes over the bundle's slots graph (`target`: the manifest's target entry), on the providers
    `runner`'s session runs on; None when the bundle has no slots graph, or when its passes do not give each
    conversation its bits alone on this device (`keeps_bits`)."""
    if target.slots is None:
        return None
    session = make_session(folder / target.slots.file, tuple(runner.session.get_providers()), threads,
                           spin=spinning(runner.session))  # as the target's own session
    slots = SlotRunner(session, runner)
    return SharedPasses(runner, slots, patience_s, prefill_apart) if keeps_bits(runner, slots) else None


def keeps_bits(runner: ModelRunner, slots: SlotRunner) -> bool:
    """Whether a slots pass gives each conversation the bits of its pass alone here, at the runner's
    `min_rows` (the device's verdict, measured on the single graph): two probe conversations of different
    lengths, a prefill chunk then two one-token steps each, run both ways and compared bit for bit."""
    vocab = runner.facts.vocab_size
    probes = [[(7 * i + 3) % vocab for i in range(9)], [(11 * i + 5) % vocab for i in range(4)]]
    alone = [runner.new_cache(16) for _ in probes]
    shared = [runner.new_cache(16) for _ in probes]
    for step in range(3):
        batch = [ids if step == 0 else [ids[step]] for ids in probes]
        parts, outs = [], []
        for tokens, a, b in zip(batch, alone, shared):
            positions, mask = range(a.length, a.length + len(tokens)), np.tri(len(tokens), dtype=bool)
            outs.append(runner.forward(a, tokens, positions, mask, [len(tokens) - 1]))
            parts.append(slots.layout(b, tokens, positions, mask, [len(tokens) - 1]))
        for tokens, a, b, mine, theirs in zip(batch, alone, shared, slots.run(parts), outs):
            if not np.array_equal(mine.logits, theirs.logits):
                return False
            commit(a, theirs, range(len(tokens)))
            commit(b, mine, range(len(tokens)))
    return True
