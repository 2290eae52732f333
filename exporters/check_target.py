"""The written target as the export's checks (the quality report, the exactness check) run it: the whole graph
where its weights are small, else stages cut from it in place and streamed through a window, so that checking
an 8B target holds a window of its weights, not all of them (history.md §80).

The stages are the restage module's cut of the graph, saved beside it for the checks' time only and reading
the weights where the graph stored them: nothing is copied, and they compute the single graph's bits
(runtime/execution/staged.py), so the checks' verdicts are the whole graph's.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.contract.graph import EXACT_ROWS_KEY, MIN_ROWS
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.execution.sessions import make_session
from edgespec.runtime.execution.staged import LoadedStage, StagedRunner, StageWindow
from edgespec.runtime.pipeline import default_threads

from .bundle_writer import stage_plan
from .restage import boundaries_of, cut_stage, external_bytes, load_graph

PROVIDERS = ("CPUExecutionProvider",)


@dataclass(frozen=True)
class CheckMemory:
    stream_above: int = 2 << 30  # weight bytes above which the checks stream the target (3B int4 stays whole)
    stage_bytes: int = 384 << 20  # about what one streamed stage holds
    resident_bytes: int = 1 << 30  # stages the checks keep loaded, besides the two they stream through


CHECKS = CheckMemory()


def streams(graph: Path, memory: CheckMemory | None = None) -> bool:
    """Whether the checks stream `graph` (its weights above `memory.stream_above`)."""
    return external_bytes(load_graph(Path(graph).parent, Path(graph).name)) > (memory or CHECKS).stream_above


def layers_of_every_kind(kinds: list) -> int:
    """The fewest first layers that hold a layer of each kind in `kinds` (per layer: its attention window
    and rotary table): what the exactness check runs of a streamed target (`checked_target`'s `prefix`)."""
    first = {}
    for layer, kind in enumerate(kinds):
        first.setdefault(kind, layer)
    return max(first.values()) + 1


@contextlib.contextmanager
def checked_target(graph: Path, facts: ModelFacts, memory: CheckMemory | None = None, prefix: int | None = None):
    """A runner of `graph` (ModelRunner's forward) for the export's checks: resident up to
    `memory.stream_above` bytes of weights, else streamed in stages. The stages' files are removed when
    the block ends. `prefix`: a streamed target is run as its embedding, its first `prefix` layers and its
    head, all resident. The exactness check asks whether the kernels give a row the same bits in passes of
    any size; layers of one kind run the same kernels on the same shapes, so a prefix holding every kind
    answers it for the whole graph at the cost of a few layers a pass (history.md §80)."""
    graph, memory = Path(graph), memory or CHECKS
    whole = load_graph(graph.parent, graph.name)
    weights = external_bytes(whole)
    if weights <= memory.stream_above:
        yield ModelRunner(make_session(graph, PROVIDERS, default_threads()), facts)
        return
    staged_facts = facts
    if prefix is not None:
        last = facts.num_layers
        plan = [(range(0, 0), True, False), (range(0, prefix), False, False), (range(last, last), False, True)]
        staged_facts = replace(facts, num_layers=prefix)
    else:
        plan = stage_plan(facts.num_layers, min(facts.num_layers, max(1, math.ceil(weights / memory.stage_bytes))))
    try:
        boundaries = boundaries_of(whole, graph.name)
        cut = [cut_stage(whole, boundaries, facts.hidden_size, layers, embed, head, f"check_stage{i}")
               for i, (layers, embed, head) in enumerate(plan)]
    except ExportError:  # a graph no stage can be cut from (a head reading earlier layers' features): held whole
        yield ModelRunner(make_session(graph, PROVIDERS, default_threads()), facts)
        return
    files = []
    try:
        sizes = []
        for i, stage in enumerate(cut):
            files.append(graph.with_name(f".{graph.stem}.check{i}.onnx"))
            onnx.save_model(stage, files[-1])
            sizes.append(external_bytes(stage))
        pinned = tuple(range(len(plan))) if prefix is not None else _first_that_fit(sizes, memory.resident_bytes)
        # the stages' passes take turns: their activations come from one shared arena (sessions.py)
        stages = [LoadedStage(lambda path=path: make_session(path, PROVIDERS, default_threads(), spin=False,
                                                             shared_arena=True)) for path in files]
        window = StageWindow(stages, pinned)
        runner = StagedRunner(window, staged_facts, _lanes(whole, facts))
        runner.graph_min_rows = int({p.key: p.value for p in whole.metadata_props}.get(EXACT_ROWS_KEY, MIN_ROWS))
        try:
            yield runner
        finally:
            window.close()
    finally:
        for path in files:
            path.unlink(missing_ok=True)


def _first_that_fit(sizes: list[int], room: int) -> tuple[int, ...]:
    """The stages kept loaded: in the order a pass runs them, while they fit in `room`."""
    pinned, used = [], 0
    for i, size in enumerate(sizes):
        if used + size > room:
            break
        pinned.append(i)
        used += size
    return tuple(pinned)


def _lanes(whole: onnx.ModelProto, facts: ModelFacts) -> int:
    """The lanes the graph's KV buffers hold ([1, lanes x kv heads, capacity, head dim])."""
    past = next(i for i in whole.graph.input if i.name == "past_key_0")
    return past.type.tensor_type.shape.dim[1].dim_value // facts.num_kv_heads
