"""Which `Stage` each graph of a staged target becomes on this machine, and the runner they stream through.

Every weight form the bundles use (fp32, int4 with exact offsets, int4 symmetric, int8) runs from
onnxruntime's packed copy, written once per machine and memory-mapped (runtime/execution/prepacked.py) where
mapped pages can be released (Linux): each stage's session is made once, a fetch maps its pages in and
a release drops them, so a streamed stage costs its bytes and no session load (history.md §59: a
quantized stage loaded as a session per fetch cost about eleven times its bytes). Elsewhere streamed
float stages read the bundle's weights in place (MappedStage) and quantized ones are loaded per fetch.
The embedding table is never a stage where the manifest describes it: its rows are read from the
mapped file (runtime/execution/embedding.py).

The caller owns the plan (runtime/execution/budget.py) and passes it in; this module keeps nothing.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache, partial
from pathlib import Path

from ..contract.manifest import GraphSpec, Manifest
from . import prepacked, stream_costs
from .budget import MemoryPlan, embedding_rows, plan_memory
from .heap import heap_trimmer
from .sessions import make_session
from .embedding import MappedEmbedding
from .staged import LoadedStage, MappedStage, Stage, StagedRunner, StageWindow
from .stream_costs import StreamCosts


def window_specs(manifest: Manifest) -> list[GraphSpec]:
    """The target's stages that run as sessions through the window: all but an embedding table the
    manifest describes, which is mapped and indexed instead (runtime/execution/embedding.py)."""
    stages = manifest.target.stages
    return stages[1:] if stages[0].embedding_table is not None else stages


def packed_graphs(manifest: Manifest, folder: Path, prepared_dir: Path) -> dict[int, Path]:
    """This machine's packed copy of every stage of the window, by index, written where missing; empty
    where packed pages cannot be mapped and released."""
    if not prepacked.available():
        return {}
    specs = window_specs(manifest)
    checksums = [prepacked.stage_checksum(manifest.files, spec) for spec in specs]
    graphs = prepacked.prepare([(Path(folder) / spec.file, c) for spec, c in zip(specs, checksums)], prepared_dir)
    return dict(enumerate(graphs))


def resident_stage_bytes(manifest: Manifest, prepared_dir: Path) -> list[int] | None:
    """What each stage of the window holds while fetched on this machine (its packed copy's mapping), as
    measured when it was prepared; None where any is not prepared yet (the plan then counts its files)."""
    if not prepacked.available():
        return None
    found = [prepacked.resident_bytes(prepacked.stage_checksum(manifest.files, spec), prepared_dir)
             for spec in window_specs(manifest)]
    return None if any(b is None for b in found) else found


def build_staged_target(manifest: Manifest, folder: Path, pinned, providers, threads: int,
                        prepared_dir: Path, evict_page_cache: bool, slots: int = 2) -> StagedRunner:
    """The staged target with `pinned` (indices into window_specs) resident and the rest streaming through
    `slots` slots."""
    folder, pinned = Path(folder), set(pinned)
    table = manifest.target.stages[0].embedding_table
    embedding = None if table is None else MappedEmbedding(folder, table, embedding_rows(manifest))
    packed = packed_graphs(manifest, folder, prepared_dir)
    # every stage on every thread, streamed ones too: which are pinned changes between passes (the caches
    # lend their room), and a lent stage verifies trees of many rows (history.md §74)
    # making a stage's session frees what it read on the way (a 3B stage's float scales: 36 MiB), and glibc
    # keeps freed heap: without a trim after each, a 3B target held 215 MiB more than its sessions from
    # its load into its first request (issue 54)
    trim = heap_trimmer()
    stages = []
    for i, spec in enumerate(window_specs(manifest)):
        stages.append(_stage(folder, spec, providers, threads, i in pinned, packed.get(i), evict_page_cache))
        trim()
    return StagedRunner(StageWindow(stages, pinned, slots), manifest.target.facts, manifest.target.lanes, embedding)


def _stage(folder: Path, spec: GraphSpec, providers, threads: int, pinned: bool, packed: Path | None,
           evict: bool) -> Stage:
    # Where packed weights can be mapped and released, every stage uses them, pinned or not, so each budget
    # computes the same bits. Elsewhere streamed float stages read unpacked weights, slower per pass than
    # the packed copy a loaded session makes, which pinned stages keep.
    if packed is not None:
        stage = prepacked.PrepackedStage(packed, providers, threads, evict and not pinned)
        if not pinned:  # making a quantized stage's session maps its pages in: given back until its turn
            stage.release()
        return stage
    if spec.tensors and not pinned:
        return MappedStage(folder, spec, providers, threads)
    return LoadedStage(lambda: make_session(folder / spec.file, providers, threads, spin=False))


def bundle_key(manifest: Manifest) -> str:
    """What names a staged target's measured costs: its stages' checksums."""
    return hashlib.sha256("".join(prepacked.stage_checksum(manifest.files, s) for s in window_specs(manifest))
                          .encode()).hexdigest()


def device_measures(manifest: Manifest, prepared_dir: Path, costs_dir: Path, evicted: bool,
                    threads: int) -> tuple[list[int] | None, StreamCosts | None]:
    """What this device has measured of the bundle's stages, writing nothing: what each packed copy maps
    (None until prepared) and the stages' costs on `threads` (None until a run measured them)."""
    if not manifest.target.stages:
        return None, None
    return (resident_stage_bytes(manifest, prepared_dir),
            stream_costs.load(costs_dir, bundle_key(manifest), evicted, threads, len(window_specs(manifest))))


def plan_on_this_device(manifest: Manifest, folder: Path, budget: int | None, context: int | None,
                        prepared_dir: Path, costs_dir: Path, evicted: bool, threads: int) -> MemoryPlan:
    """The plan with what this device measured: each stage's packed size (prepared first where a budget
    may make the target stream) and, where a run has measured them, the stages' costs."""
    if budget is None or not manifest.target.stages:
        return plan_memory(manifest, folder, budget, context)
    packed_graphs(manifest, folder, prepared_dir)
    return plan_memory(manifest, folder, budget, context,
                       *device_measures(manifest, prepared_dir, costs_dir, evicted, threads))


def build_measured(manifest: Manifest, folder: Path, plan: MemoryPlan, providers, threads: int, prepared_dir: Path,
                   costs_dir: Path, evicted: bool) -> tuple[StagedRunner, MemoryPlan, StreamCosts]:
    """The staged target for `plan`, this device's stage costs, and the plan they price: on a first load
    the plan was made with costs assumed from bytes, so it is made again with the measured ones and the
    target rebuilt where they pin other stages (later loads read the cached costs and keep their plan).
    The target pins more stages while its caches leave the plan's KV room unused (`MemoryPlan.pinned_while`)."""
    runner = build_staged_target(manifest, folder, plan.pinned_stages, providers, threads,
                                 prepared_dir, evicted, plan.stream_slots)
    costs = measured_costs(runner, manifest, costs_dir, evicted, threads)
    if not plan.costs_measured and plan.budget is not None:
        priced = plan_memory(manifest, folder, plan.budget, plan.min_context,
                             resident_stage_bytes(manifest, prepared_dir), costs)
        if (priced.pinned_stages, priced.context, priced.stream_slots) != (plan.pinned_stages, plan.context,
                                                                           plan.stream_slots):
            runner.window.close()
            del runner  # its pinned stages' pages go before the new split maps its own: the budget holds one
            runner = build_staged_target(manifest, folder, priced.pinned_stages, providers, threads,
                                         prepared_dir, evicted, priced.stream_slots)
        plan = priced
    # asked before every pass; the caches' bytes change only as they grow
    runner.pinning = lru_cache(maxsize=16)(partial(plan.pinned_while, costs=costs))
    return runner, plan, costs


def measured_costs(runner: StagedRunner, manifest: Manifest, costs_dir: Path, evicted: bool,
                   threads: int) -> StreamCosts:
    """This device's stage costs for the bundle on the runner's `threads`: cached, or measured now (before
    the runner's first pass)."""
    key, count = bundle_key(manifest), runner.window.count
    costs = stream_costs.load(costs_dir, key, evicted, threads, count)
    if costs is None:
        costs = runner.measure_costs()
        stream_costs.save(costs_dir, key, evicted, threads, costs)
    return costs
