"""One memory budget: how the bytes a user allows are split between weights, KV caches and scratch.

The plan is arithmetic over what the bundle says (weight files, model facts, tree and prefill sizes);
peak RSS is measured by `bench`, never taken from here.

Speed first above a floor of context: the context the caller asks for (`context`: a request's prompt and
new tokens, or `--context`), else DEFAULT_CONTEXT or the most any split of the budget holds, whichever is
less (`_Split.floor_within`), so that a small speed gain never takes a conversation's room. The
whole target stays resident when it fits beside that floor, and the caches take the rest. Otherwise,
when the bundle carries the target as stages, it streams: the caches get the floor, the stage window
the rest (two slots for the stages that stream through it, and as many stages pinned as then fit,
those whose fetch costs a pass most first: runtime/execution/stream_costs.py), and what the window leaves goes
back to the caches. Where two slots do not fit beside the floor, one does: each streamed stage is then
fetched when its turn comes, never while the one before computes. Below the smallest window (the
largest stage in one slot) beside MIN_CONTEXT, or the context asked for, the budget is refused with the
minimum it needs. `trade_offs` lists the other splits: fewer stages pinned, more context, and what a pass
then costs (with the default floor, those that pin more below it too: what the floor costs in speed).

A stage's bytes are what it holds while fetched on this device (its packed copy's mapping, measured
when prepared: runtime/execution/prepacked.py) where the caller has them, else its files.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..contract.errors import BudgetError
from ..contract.manifest import Manifest
from .embedding import MappedEmbedding
from .stream_costs import StreamCosts

# Of the budget, the share the caches' unused room never lends to stages (MemoryPlan.pinned_while): lending
# it all ran peak RSS up to the budget and past it, the estimated parts running over (history.md §74).
LENDING_MARGIN = 0.05
# The process before any weight: Python, numpy, onnxruntime and tokenizers imported (57 MiB resident on
# x86-64 Linux, measured), plus onnxruntime's thread pools and allocators and the tokenizer once loaded.
RUNTIME_BASE_BYTES = 90 * 2**20
MIN_CONTEXT = 128  # tokens: below this a chat turn does not fit
# The floor kept when the caller names none, capped at the bundle's context and at what the budget holds: a
# system prompt and a few turns of chat, or a page of text (a document, a file to edit, tool results) with
# its answer, fit in it; pinning a stage buys a few percent of speed, and a conversation that outgrows its
# context fails outright, so the context is kept first.
DEFAULT_CONTEXT = 1024
EMBEDDING_ROWS = 64  # rows a mapped embedding table reads before its pages are dropped (embedding_rows)
# Each root-to-leaf path of a verified tree runs in a lane of the target's cache, and each lane holds a
# copy of the committed rows (runtime/execution/kvcache.py); the graph computes every lane's attention on every
# pass. A tree with more paths than the graph's lanes is cut (Tree.within_paths).
MAX_LANES = 4
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'300MB', '1.5GiB', '250000000' -> bytes (KB/MB/GB are decimal, KiB/MiB/GiB binary)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).upper() not in _UNITS:
        raise BudgetError(f"cannot read the memory budget {text!r}: give bytes or a size like 300MB or 1.5GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    budget: int | None  # None: unconstrained (the bundle's full context)
    runtime: int
    target_weights: int
    draft_weights: int
    scratch: int
    target_kv_per_token: int
    draft_kv_per_token: int
    context: int  # tokens both caches hold
    tree_slots: int  # of the context, rows a tree pass may occupy beyond the committed tokens
    stage_bytes: tuple[int, ...] = ()  # the target's stages that load as sessions, when it runs as stages
    pinned_stages: tuple[int, ...] = ()  # of those, the ones that stay loaded; the others stream
    mapped_embedding: int = 0  # at most this much of a memory-mapped embedding table is resident
    suffix_store: int = 0  # suffix drafting's store of earlier outputs (runtime/decoding/suffix.py)
    min_context: int = MIN_CONTEXT  # the floor kept: the caller's, else the default (`_Split.floor_within`)
    pass_seconds: float | None = None  # a streamed one-token pass, expected from the stage costs
    stream_slots: int = 2  # stages streaming at once: the next one fetched while one computes, or 1 (no room)
    costs_measured: bool = False  # pass_seconds from this device's measured costs, not assumed ones

    @property
    def streams(self) -> bool:
        return len(self.pinned_stages) < len(self.stage_bytes)

    @property
    def streamed_bytes_per_pass(self) -> int:
        return sum(s for i, s in enumerate(self.stage_bytes) if i not in self.pinned_stages)

    def pinned_while(self, target_kv: int, costs: StreamCosts) -> tuple[int, ...]:
        """The stages that stay resident while the target's caches hold `target_kv` bytes: the plan keeps
        KV room for its whole context, and until a conversation fills it, the room not used yet pins more
        stages, given back as the caches grow into it (history.md §74). LENDING_MARGIN of the budget is
        not lent: the plan's runtime and scratch are estimates. At the whole context, the plan's pins."""
        if not self.streams or self.budget is None:
            return self.pinned_stages
        lent = self.target_kv - target_kv - int(LENDING_MARGIN * self.budget)
        if lent <= 0:
            return self.pinned_stages
        others = self.total - self.target_weights - self.target_kv  # runtime, draft, scratch, draft KV, store
        room = self.budget - others - self.mapped_embedding - self.target_kv + lent
        return choose_pinned(list(self.stage_bytes), room, costs, self.stream_slots)

    @property
    def target_kv(self) -> int:
        return self.context * self.target_kv_per_token

    @property
    def draft_kv(self) -> int:
        return self.context * self.draft_kv_per_token

    @property
    def total(self) -> int:
        return (self.runtime + self.target_weights + self.draft_weights + self.scratch + self.target_kv + self.draft_kv
                + self.suffix_store)

    def describe(self) -> str:
        lines = [f"memory budget   {'none (the bundle full context)' if self.budget is None else mib(self.budget)}",
                 f"  runtime        {mib(self.runtime):>12}  (interpreter and libraries)",
                 f"  target weights {mib(self.target_weights):>12}  " + (
                     f"at most resident: {len(self.pinned_stages)} of {len(self.stage_bytes)} stages pinned and "
                     f"{self.stream_slots} streaming, {mib(self.streamed_bytes_per_pass)} loaded per pass"
                     + (f", embedding rows mapped (at most {mib(self.mapped_embedding)})" if self.mapped_embedding else "")
                     if self.streams else "resident"),
                 f"  draft weights  {mib(self.draft_weights):>12}  resident",
                 f"  target KV      {mib(self.target_kv):>12}  {self.context} tokens",
                 f"  draft KV       {mib(self.draft_kv):>12}  {self.context} tokens",
                 f"  scratch        {mib(self.scratch):>12}  activations of the largest pass",
                 *([f"  suffix store   {mib(self.suffix_store):>12}  earlier outputs suffix drafting continues"]
                   if self.suffix_store else []),
                 f"  total          {mib(self.total):>12}",
                 f"context that fits: {self.context} tokens ({self.tree_slots} of them reserved for tree nodes; "
                 f"at least {self.min_context} kept)"]
        if self.streams:
            lines.append(f"until a conversation fills its context, the KV room it does not use pins more stages "
                         f"({LENDING_MARGIN:.0%} of the budget kept free)")
        if self.pass_seconds is not None:
            lines.append(f"expected plain decoding: {1 / self.pass_seconds:.1f} tokens/s ("
                         + ("measured stage costs on this device)" if self.costs_measured else
                            "stage costs assumed from their bytes until a run measures them)"))
        return "\n".join(lines)


def _files_bytes(folder: Path, names) -> int:
    return sum((folder / name).stat().st_size for name in names)


def scratch_bytes(manifest: Manifest) -> int:
    """Activations of the largest pass (a prefill chunk or a tree) kept by onnxruntime's arena, and the
    logits numpy receives: every layer's intermediates may be live at once in the planner's worst case.

    A tree attends in one lane per root-to-leaf path (runtime/execution/model.py): the attention's scores have
    a row per slot of every lane, over the whole context. The keys and values live in the caches."""
    f = manifest.target.facts
    nodes, _, slots = largest_tree(manifest)
    rows = max(manifest.prefill_chunk, nodes, 2)
    slot_rows = max(manifest.prefill_chunk, manifest.target.lanes * slots, 2)
    per_layer = (rows * (4 * f.hidden_size + 3 * f.intermediate_size)
                 + slot_rows * (f.num_heads * f.max_context + (f.num_heads + 2 * f.num_kv_heads) * f.head_dim))
    return 4 * (2 * per_layer + rows * f.vocab_size * 2)


def embedding_rows(manifest: Manifest) -> int:
    """Rows a mapped embedding table reads between drops of its pages (runtime/execution/embedding.py):
    EMBEDDING_ROWS, or one pass's rows where a pass takes more. Its resident bound grows with them, and a
    drop costs only the pages read, so they are few."""
    nodes, _, _ = largest_tree(manifest)
    return min(manifest.target.facts.max_context, max(EMBEDDING_ROWS, manifest.prefill_chunk, nodes + 1))


def lanes_for(paths: int) -> int:
    """The lanes a target cache keeps for trees of up to `paths` root-to-leaf paths."""
    return max(1, min(paths, MAX_LANES))


def largest_tree(manifest: Manifest) -> tuple[int, int, int]:
    """(nodes, root-to-leaf paths, slots per path) a verification pass may take at most: the manifest's
    tree, or any tree within a dynamic budget (at worst a star for paths, a chain for depth), plus the
    prompt-lookup or suffix-drafting chain grafted at the root."""
    lookup = manifest.lookup.longest if manifest.lookup else manifest.suffix.max_depth if manifest.suffix else 0
    if manifest.dynamic:
        nodes, paths, depth = manifest.dynamic.budget, manifest.dynamic.budget - 1, manifest.dynamic.max_depth
    else:
        nodes, paths, depth = manifest.tree.size, manifest.tree.leaves, manifest.tree.max_depth
    return nodes + lookup, paths + (1 if lookup else 0), max(depth, lookup) + 1


def plan_memory(manifest: Manifest, folder: Path, budget: int | None, context: int | None = None,
                stage_bytes: list[int] | None = None, costs: StreamCosts | None = None) -> MemoryPlan:
    """`context`: the fewest tokens the caches must hold (a request's, or the caller's floor; default: the
    default floor, `_Split.floor_within`). `stage_bytes`: what each stage of the window holds while fetched
    on this device (default: its files); `costs`: this device's measured stage costs (default: assumed from
    the bytes)."""
    split = _Split(manifest, Path(folder), context, stage_bytes)
    if budget is None:
        return split.plan(None, split.full, split.least)
    split.refuse_below(budget)
    floor = split.floor_within(budget)
    if budget >= split.others + split.resident + floor * split.per_token:
        return split.plan(budget, min(split.full, (budget - split.others - split.resident) // split.per_token), floor)
    costs = costs or StreamCosts.assumed(split.stages)
    room = budget - split.others - floor * split.per_token - split.mapped
    slots = split.slots_within(room)
    return split.streamed(budget, choose_pinned(split.stages, room, costs, slots), costs, slots, floor)


def trade_offs(manifest: Manifest, folder: Path, budget: int, context: int | None = None,
               stage_bytes: list[int] | None = None, costs: StreamCosts | None = None) -> list[MemoryPlan]:
    """The plan, then the other splits of the budget where the bundle has stages: the most stages that
    fit pinned beside the context asked for (with the default floor, beside MIN_CONTEXT: what the default
    costs in speed shows), then fewer and fewer, each giving what it does not pin to the context."""
    best = plan_memory(manifest, folder, budget, context, stage_bytes, costs)
    split = _Split(manifest, Path(folder), context, stage_bytes)
    if len(split.stages) < 3 or budget < split.minimum():
        return [best]
    costs = costs or StreamCosts.assumed(split.stages)
    room = budget - split.others - split.least * split.per_token - split.mapped
    slots = split.slots_within(room)
    most = choose_pinned(split.stages, room, costs, slots)
    order = sorted(most, key=lambda i: (costs.fetch_seconds[i] / split.stages[i], split.stages[i]))
    others = [split.streamed(budget, tuple(sorted(order[k:])), costs, slots, split.least)
              for k in range(len(order) + 1)]
    # every stage pinned is the resident plan again (or a poorer copy of it): listed once, as the plan
    return [best] + [p for p in others if p.streams and (not best.streams or p.pinned_stages != best.pinned_stages)]


class _Split:
    """What a plan is made of, read once from the bundle: the parts that do not depend on the split."""

    def __init__(self, manifest: Manifest, folder: Path, context: int | None, stage_bytes: list[int] | None):
        target = manifest.target
        self.full = target.facts.max_context
        self.asked = context
        # the least context a budget must leave: the one asked for, else MIN_CONTEXT (refused below it)
        self.least = min(MIN_CONTEXT, self.full) if context is None else context
        if isinstance(self.least, bool) or not isinstance(self.least, int) or not 1 <= self.least <= self.full:
            raise BudgetError(f"a context of {context!r} tokens cannot be held: this bundle's is 1 to {self.full} "
                              "(give --context within it)")
        weights = _files_bytes(folder, [target.graph.file, *target.graph.weights])
        draft_weights, draft_kv_token = 0, 0
        if manifest.draft is not None:
            draft_weights = _files_bytes(folder, [manifest.draft.graph.file, *manifest.draft.graph.weights])
            if manifest.drafter.has_model:  # Medusa heads keep no cache
                draft_kv_token = manifest.draft.facts.kv_bytes_per_token() + 4 * manifest.draft.feature_size
        target_kv_token = target.facts.kv_bytes_per_token() * target.lanes + 4 * target.feature_size
        self.per_token = target_kv_token + draft_kv_token
        scratch = scratch_bytes(manifest)
        suffix_store = manifest.suffix.store_bytes if manifest.suffix else 0
        self.others = RUNTIME_BASE_BYTES + draft_weights + scratch + suffix_store
        self.common = dict(runtime=RUNTIME_BASE_BYTES, draft_weights=draft_weights, scratch=scratch,
                           target_kv_per_token=target_kv_token, draft_kv_per_token=draft_kv_token,
                           tree_slots=largest_tree(manifest)[0], suffix_store=suffix_store)
        # an embedding table is mapped and indexed instead of loaded: it costs the rows read, bounded
        table = target.stages[0].embedding_table if target.stages else None
        self.mapped = 0 if table is None else MappedEmbedding.resident_bound(table, embedding_rows(manifest))
        loaded = target.stages[1:] if table else target.stages
        self.stages = list(stage_bytes) if stage_bytes else [_files_bytes(folder, [s.file, *s.weights]) for s in loaded]
        # the single graph packs its weights as the stages do: where the stages' packed size is measured,
        # it is the resident target's too (with the table, which the single graph holds whole)
        table_bytes = 0 if table is None else MappedEmbedding.table_bytes(table)
        self.resident = max(weights, sum(stage_bytes) + table_bytes) if stage_bytes else weights

    def plan(self, budget: int | None, context: int, floor: int) -> MemoryPlan:
        return MemoryPlan(budget=budget, target_weights=self.resident, context=int(context), min_context=floor,
                          **self.common)

    def floor_within(self, budget: int) -> int:
        """The context a plan keeps before it buys speed: the one asked for; else DEFAULT_CONTEXT within the
        bundle's, lowered to the most a split of this budget holds (the resident target, or every stage
        streaming through the slots that fit beside MIN_CONTEXT), never below MIN_CONTEXT."""
        if self.asked is not None:
            return self.asked
        most = (budget - self.others - self.resident) // self.per_token
        if len(self.stages) >= 3:
            slots = self.slots_within(budget - self.others - self.least * self.per_token - self.mapped)
            most = max(most, (budget - self.others - self.mapped - window_bytes(self.stages, (), slots))
                       // self.per_token)
        return max(self.least, min(DEFAULT_CONTEXT, self.full, most))

    def smallest_window(self) -> int:
        return self.mapped + window_bytes(self.stages, (), slots=1) if len(self.stages) >= 3 else self.resident

    def slots_within(self, room: int) -> int:
        """Two streaming slots where they fit in `room` with nothing pinned, else one."""
        return 2 if window_bytes(self.stages, ()) <= room else 1

    def minimum(self) -> int:
        return self.others + self.smallest_window() + self.least * self.per_token

    def refuse_below(self, budget: int) -> None:
        smallest_window, minimum = self.smallest_window(), self.minimum()
        if budget < minimum:
            streaming = "streaming its stages" if len(self.stages) >= 3 else \
                "its target weights all resident (export with --stages to stream them)"
            raise BudgetError(
                f"a memory budget of {mib(budget)} is below this bundle's minimum of {mib(minimum)} with {streaming} "
                f"(target weights {mib(smallest_window)}, draft weights {mib(self.common['draft_weights'])}, KV for "
                f"{self.least} tokens {mib(self.least * self.per_token)}, scratch {mib(self.common['scratch'])}, "
                f"runtime {mib(RUNTIME_BASE_BYTES)}): raise the budget" + (" or ask for less context" if
                                                                           self.least > MIN_CONTEXT else ""))

    def streamed(self, budget: int, pinned: tuple[int, ...], costs: StreamCosts, slots: int,
                 floor: int) -> MemoryPlan:
        weights = self.mapped + window_bytes(self.stages, pinned, slots)
        context = min(self.full, (budget - self.others - weights) // self.per_token)
        return MemoryPlan(budget=budget, target_weights=weights, context=int(context), stage_bytes=tuple(self.stages),
                          pinned_stages=pinned, mapped_embedding=self.mapped, pass_seconds=costs.pass_seconds(pinned),
                          costs_measured=costs.measured, stream_slots=slots, min_context=floor, **self.common)


def window_bytes(stages: list[int], pinned, slots: int = 2) -> int:
    """Weights loaded at once: the pinned stages and the `slots` largest of those that stream."""
    streamed = sorted((s for i, s in enumerate(stages) if i not in pinned), reverse=True)
    return sum(stages[i] for i in pinned) + sum(streamed[:slots])


def choose_pinned(stages: list[int], room: int, costs: StreamCosts | None = None, slots: int = 2) -> tuple[int, ...]:
    """Pins stages while the window still fits in `room` bytes: those whose fetch costs a pass the most
    per byte first, the largest first among equals (every stage, with costs assumed from the bytes)."""
    costs = costs or StreamCosts.assumed(stages)
    pinned: list[int] = []
    for i in sorted(range(len(stages)), key=lambda i: (-costs.fetch_seconds[i] / max(stages[i], 1), -stages[i], i)):
        if window_bytes(stages, pinned + [i], slots) <= room:
            pinned.append(i)
    return tuple(sorted(pinned))
