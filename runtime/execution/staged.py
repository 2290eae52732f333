"""The target run as stages (embedding, groups of layers, head) when its weights do not fit the budget.

`StageWindow` keeps the pinned stages resident and streams the others through two slots. Every pass
visits the stages in the same order, so least-recently-used would miss every time; instead, while one
stage computes, the next is fetched by a background thread, and the streamed stage behind is released.
With one slot (a budget with no room for two) a streamed stage is fetched when its turn comes, after
the one before is released. When every stage is pinned, each is fetched once. Which stages are pinned
may change between passes (`repin`): under a budget, the KV room a short conversation does not use yet
keeps more of them resident (runtime/execution/budget.py `MemoryPlan.pinned_while`).

A stage is either
- `prepacked.PrepackedStage` (Linux): its session maps onnxruntime's packed copy of the
  weights, written once per machine. Fetching maps the pages in, releasing drops them from the
  process (the OS may keep them cached): a stage costs its bytes and nothing more, the sessions are
  made once, and the kernels are the single graph's;
- `MappedStage` (float stages elsewhere, streamed): its weights stay in the bundle's file, mapped, and
  its session reads them unpacked (measured: fp32 passes half as fast as from packed weights);
- `LoadedStage`: a session made from the file on fetch and dropped on release (where packed weights
  cannot be mapped: quantized stages, and pinned float stages).

On Linux every weight form, quantized ones included, is a PrepackedStage (runtime/execution/stage_build.py).

Within one budget plain and speculative decoding run the same stages, so speculation stays exact.
Packed stages compute the single graph's bits at every budget; unpacked kernels round differently.

`StagedRunner.forward` has ModelRunner's signature and returns the same Pass: the engine, drafters and
the budget's KV caches do not know whether the target streams.
"""
from __future__ import annotations

import mmap
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import onnxruntime as ort

from ..contract.errors import InputError
from ..contract.facts import ModelFacts
from ..contract.graph import FEATURES_OUT, MIN_ROWS, GraphSignature
from ..contract.manifest import GraphSpec
from . import stream_costs
from .embedding import MappedEmbedding
from .kvcache import KVCache
from .model import Pass, pass_feed, run_bound
from .sessions import make_session
from .stream_costs import StreamCosts


class Stage(Protocol):
    def fetch(self) -> ort.InferenceSession:
        """Makes the stage resident (called on the loader thread) and returns its session."""

    def release(self) -> None:
        """Gives the stage's memory back; a later fetch makes it resident again."""


class LoadedStage:
    def __init__(self, load: Callable[[], ort.InferenceSession]):
        self.load, self.session = load, None

    def fetch(self) -> ort.InferenceSession:
        if self.session is None:
            self.session = self.load()
        return self.session

    def release(self) -> None:
        self.session = None


class MappedStage:
    def __init__(self, folder: Path, spec: GraphSpec, providers: tuple, threads: int):
        if not spec.tensors or len(spec.weights) != 1:
            raise InputError(f"{spec.file} lists no mappable tensors")
        with open(Path(folder) / spec.weights[0], "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # the session reads these buffers for as long as it lives: they are kept with it
        self.values = {t["name"]: ort.OrtValue.ortvalue_from_numpy(
            np.frombuffer(self.map, np.dtype(t["dtype"]), count=int(np.prod(t["shape"])), offset=t["offset"])
            .reshape(t["shape"])) for t in spec.tensors}
        self.session = make_session(Path(folder) / spec.file, providers, threads, self.values, prepack=False,
                                    spin=False, shared_arena=True)  # it streams; one arena for all stages
        self.pages = np.frombuffer(self.map, np.uint8)[:: mmap.PAGESIZE]

    def fetch(self) -> ort.InferenceSession:
        int(self.pages.max())  # reads one byte per page: the kernel maps them in, readahead fills the cache
        return self.session

    def release(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED)


class StageWindow:
    def __init__(self, stages: list[Stage], pinned, slots: int = 2):
        self.stages, self.count, self.pinned, self.slots = stages, len(stages), set(pinned), slots
        self.resident = min(self.count, len(self.pinned) + slots)
        self.sessions: dict[int, ort.InferenceSession] = {}
        self.pending: dict[int, Future] = {}
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-stage-loader")

    def get(self, i: int) -> ort.InferenceSession:
        if i not in self.sessions:
            future = self.pending.pop(i, None)
            self._release_streamed(keep=i)
            self.sessions[i] = future.result() if future is not None else self.stages[i].fetch()
        self._prefetch(self._next_streamed(i), running=i)
        return self.sessions[i]

    def _next_streamed(self, i: int) -> int:
        """The stage after `i` past the pinned ones: fetched while they compute too, the loader gets their
        time as well as stage i's (history.md §74)."""
        j = (i + 1) % self.count
        while j in self.pinned and j in self.sessions and j != i:
            j = (j + 1) % self.count
        return j

    def repin(self, pinned, slots: int | None = None) -> None:
        """Keeps `pinned` resident from their next fetch on; a stage pinned before and not now is released
        at once, before the caches grow into its room (runtime/execution/budget.py `pinned_while`). `slots`:
        another plan's streaming slots; with fewer, the streamed stages held go at once too."""
        pinned, slots = set(pinned), self.slots if slots is None else slots
        if pinned == self.pinned and slots == self.slots:
            return
        for i in sorted(self.pinned - pinned):
            if self.sessions.pop(i, None) is not None:
                self.stages[i].release()
        if slots < self.slots:
            for i, future in list(self.pending.items()):
                future.result()
                self.stages[i].release()
            self.pending.clear()
            for i in [i for i in self.sessions if i not in pinned]:
                del self.sessions[i]
                self.stages[i].release()
        self.pinned, self.slots = pinned, slots
        self.resident = min(self.count, len(pinned) + slots)

    def _release_streamed(self, keep: int, running: int | None = None) -> None:
        """Makes room for stage `keep`: streamed stages other than it, the one about to run and the one
        being fetched go."""
        while len(self.sessions) + len(self.pending) >= self.resident:
            behind = [s for s in self.sessions if s not in self.pinned and s not in (keep, running)]
            if not behind:
                break
            del self.sessions[behind[0]]
            self.stages[behind[0]].release()

    def _prefetch(self, i: int, running: int) -> None:
        if i in self.sessions or i in self.pending:
            return
        if i not in self.pinned:
            self._release_streamed(keep=i, running=running)
        if len(self.sessions) + len(self.pending) < self.resident:
            self.pending[i] = self.loader.submit(self.stages[i].fetch)

    def close(self) -> None:
        self.loader.shutdown(wait=True)


class StagedRunner:
    def __init__(self, window: StageWindow, facts: ModelFacts, lanes: int, embedding: MappedEmbedding | None = None):
        """With `embedding`, stage 0 is never loaded: the window serves stages 1.. (its index + 1).
        `lanes`: the root-to-leaf paths the stages' graphs attend in (the manifest's)."""
        self.window, self.facts, self.embedding = window, facts, embedding
        self.lanes = lanes
        self.signature = GraphSignature.every_input(facts, lanes)  # each stage takes its own part of the inputs
        self.graph_min_rows = MIN_ROWS
        self.min_rows = MIN_ROWS  # what a one-token step runs: set by the device's check (runtime/decoding/exactness.py)
        self.run_seconds = 0.0  # time inside onnxruntime (and waiting for stages), all passes so far
        # the stages to keep resident while the target's caches hold so many bytes (the plan's
        # `pinned_while`, set by runtime/execution/stage_build.py), and the caches that count
        self.pinning: Callable[[int], tuple[int, ...]] | None = None
        self.caches: weakref.WeakSet[KVCache] = weakref.WeakSet()

    static = None  # stages are written with dynamic shapes only
    pass_limit = None
    tree_limit = None
    reads_features = False  # a target's stages: only a draft reads features

    @property
    def kernels(self) -> str:
        """"packed" where every stage runs the single graph's kernels, else "unpacked": mapped stages round
        unlike them (a one-row step among them too), so the single graph's exactness verdict is not theirs."""
        return "unpacked" if any(isinstance(stage, MappedStage) for stage in self.window.stages) else "packed"

    def new_cache(self, capacity: int, feature_size: int = 0) -> KVCache:
        cache = KVCache(self.facts, capacity, feature_size, lanes=self.lanes)
        self.caches.add(cache)
        return cache

    def measure_costs(self) -> StreamCosts:
        """Each stage's fetch and one-token run on this device (runtime/execution/stream_costs.py), before any pass."""
        cache = self.new_cache(16)
        layout = pass_feed(cache, self.signature, [0], [0], np.ones((1, 1), bool), [0], min_rows=self.min_rows)
        rows = layout.feed["input_ids"].shape[1]
        feed = dict(layout.feed, **{k: np.zeros((1, rows, self.facts.hidden_size), np.float32)
                                    for k in ("hidden", "branch")})

        def run_stage(i: int, session: ort.InferenceSession) -> None:
            run_bound(session, cache, feed, self._outputs(session, rows, len(feed["logit_rows"])))

        return stream_costs.measure(self.window, run_stage)

    def _outputs(self, session: ort.InferenceSession, rows: int, logit_rows: int) -> dict[str, tuple[int, int]]:
        widths = {"hidden_out": self.facts.hidden_size, "branch_out": self.facts.hidden_size,
                  FEATURES_OUT: self.facts.hidden_size, "logits": self.facts.vocab_size}
        return {o.name: (logit_rows if o.name == "logits" else rows, widths[o.name])
                for o in session.get_outputs() if not o.name.startswith("present_")}

    def forward(self, cache: KVCache, tokens, positions, tree_mask: np.ndarray, logit_rows,
                past_mask: np.ndarray | None = None, features: np.ndarray | None = None,
                exact_rows: bool = True) -> Pass:
        if features is not None:
            raise InputError("a staged target reads no features; only a draft does")
        if not exact_rows or past_mask is not None:  # a stage written since history.md §54 takes no attention bias
            raise InputError("a staged target runs exact passes without a mask over the past")
        if self.pinning is not None:  # before the pass: growing the cache must find its room given back
            self.caches.add(cache)
            grows_to = cache.length + max(len(tokens), 2)  # at least the rows the pass layout reserves
            self.window.repin(self.pinning(sum(c.held_bytes(grows_to if c is cache else 0) for c in self.caches)))
        layout = pass_feed(cache, self.signature, tokens, positions, tree_mask, logit_rows, past_mask, exact_rows,
                           self.min_rows)
        feed, rows = dict(layout.feed), layout.feed["input_ids"].shape[1]
        logits, features = None, None
        if self.embedding is not None:
            feed["hidden"] = self.embedding.lookup(feed["input_ids"])
        started = time.perf_counter()
        for i in range(self.window.count):
            session = self.window.get(i)
            values = run_bound(session, cache, feed, self._outputs(session, rows, len(feed["logit_rows"])))
            feed.update({k: values[f"{k}_out"][None] for k in ("hidden", "branch") if f"{k}_out" in values})
            logits = values.get("logits", logits)
            features = values.get(FEATURES_OUT, features)
        self.run_seconds += time.perf_counter() - started
        return Pass(logits=logits[: len(layout.wanted)], path_nodes=layout.path_nodes,
                    features=None if features is None else features[: layout.rows])
