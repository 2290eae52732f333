"""The draft model's tree under a budget: sized to what a streamed pass costs on this device.

When stages stream, much of a pass is fetching them, the same for one row as for many, so each extra
node costs a smaller share of the pass than it does resident, and a longer tree pays where a resident
one would not. The tree is chosen by tune's program (runtime/decoding/treeopt.py) over the pass costs the stage
costs predict (runtime/execution/stream_costs.py), with the draft's agreement the bundle measured at export:
by rank where it was (quality.json's `draft_agreement_by_rank`), so that a graph with lanes for several
paths gets siblings where a pass is mostly fetching (history.md §64), else the first choice's alone (chains).
Suffix drafting needs none of this: the step controller prices its chains from timed passes.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..contract.drafting import DrafterKind
from ..contract.manifest import Manifest
from ..contract.topology import Topology
from ..execution.budget import MemoryPlan
from ..execution.stream_costs import StreamCosts
from .treeopt import choose_tree

# an extra row's share of a stage's one-row run until passes of that size are timed (runtime/decoding/controller.py)
EXTRA_ROW_SHARE = 0.25


def streamed_pass_seconds(costs: StreamCosts, pinned, max_nodes: int) -> dict[int, float]:
    """Expected seconds of a verify pass of n = 1..max_nodes nodes: the streamed fetches once, the runs per row."""
    fetched = costs.pass_seconds(pinned) - sum(costs.run_seconds)
    return {n: fetched + sum(costs.run_seconds) * (1 + EXTRA_ROW_SHARE * (n - 1)) for n in range(1, max_nodes + 1)}


def tree_for_budget(costs: StreamCosts, pinned, agreement: float | Sequence[float], max_nodes: int, lanes: int,
                    draft_seconds_per_level: float) -> Topology:
    """The tree with the most expected tokens per second of a streamed step, at most `max_nodes` nodes and
    `lanes` root-to-leaf paths; `agreement`: how often the draft's first choice is the target's, or its
    r-th choice for r = 0, 1, ... (then siblings are priced too)."""
    seconds = streamed_pass_seconds(costs, pinned, max_nodes)
    rates = [float(agreement)] if isinstance(agreement, (int, float)) else [float(a) for a in agreement]
    best, _ = choose_tree([rates], seconds, draft_seconds_per_level, max_paths=lanes)
    return best.topology


def draft_agreement(quality: dict | None) -> list[float] | None:
    """How often the draft's r-th choice is the target's, as the export measured it: quality.json's
    `draft_agreement_by_rank` where it has one, else `draft_agreement`'s first choice alone (the quantized
    draft's where there is one); None where it was not measured."""
    by_rank = ((quality or {}).get("draft_agreement_by_rank") or {}).get("quantized")
    if by_rank:
        return [float(a) for a in by_rank]
    agreement = (quality or {}).get("draft_agreement") or {}
    value = agreement.get("quantized", agreement.get("fp32"))
    return None if value is None else [float(value)]


def tree_under_budget(manifest: Manifest, plan: MemoryPlan, costs: StreamCosts | None, max_nodes: int) -> Topology:
    """The tree a draft model fills under `plan`: the manifest's unless stages stream, the draft is a model
    on a static topology and its agreement was measured; then the tree sized to the streamed pass, within
    the rows the plan reserved for a tree and the target's lanes. The draft's one-level cost is priced as
    a target stage's run per byte, times its weights (it runs the same kernels)."""
    agreement = draft_agreement(manifest.quality)
    if (not plan.streams or costs is None or manifest.drafter is not DrafterKind.MODEL or manifest.dynamic is not None
            or agreement is None):
        return manifest.tree
    level = sum(costs.run_seconds) * plan.draft_weights / max(sum(plan.stage_bytes), 1)
    return tree_for_budget(costs, plan.pinned_stages, agreement, max(2, min(max_nodes, plan.tree_slots)),
                           manifest.target.lanes, level)
