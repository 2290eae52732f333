"""`edgespec plan`: how a memory budget is split for a bundle, the trade-offs another split offers, and
what this device measured of its stages."""
from __future__ import annotations

import json

from edgespec.defaults import resolve_bundle
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.execution import prepacked, stream_costs
from edgespec.runtime.execution.budget import DEFAULT_CONTEXT, MemoryPlan, mib, parse_size, plan_memory, trade_offs
from edgespec.runtime.execution.paths import cache_dir
from edgespec.runtime.execution.stage_build import bundle_key, device_measures
from edgespec.runtime.pipeline import check_threads, default_prepared_dir, default_threads, packed_copies


def cmd_plan(args) -> None:
    folder = resolve_bundle(args.bundle)
    budget = None if args.memory_budget is None else parse_size(args.memory_budget)
    manifest = open_bundle(folder)
    # what this device measured of the stages (their packed sizes, their costs), as a run would plan with
    check_threads(args.threads)
    threads = args.threads or manifest.profile.threads or default_threads()  # as a run on this bundle takes
    measures = device_measures(manifest, default_prepared_dir(), cache_dir(), args.evict_page_cache, threads)
    splits = trade_offs(manifest, folder, budget, args.context, *measures) if budget is not None else \
        [plan_memory(manifest, folder, None, args.context, *measures)]
    plan = splits[0]
    packed = _packed_disk(manifest, folder) if plan.stage_bytes else None
    figures = _figures(manifest, measures, args.evict_page_cache, threads) if budget is not None else None
    if args.json:
        print(json.dumps({**plan.__dict__, "total": plan.total, "packed_copies": packed, "figures": figures,
                          "trade_offs": [_split_dict(p) for p in splits]}))
        return
    print(plan.describe())
    if args.context is None and budget is not None:
        print(f"context floor: the default, {DEFAULT_CONTEXT} tokens or the most a split of this budget holds, "
              "whichever is less (--context N keeps N; a request that needs more gets another split where one "
              "holds it)")
    if len(splits) > 1:
        print(_trade_table(splits))
    if figures is not None:
        print(_figures_line(figures))
    if packed and packed["stages"]:
        written = packed["written_bytes"] / 2**20
        print(f"disk: packed copies of {packed['stages']} stages for this machine in {packed['folder']}: "
              + (f"{written:.1f} MiB" if packed["missing"] == 0 else
                 f"{packed['missing']} not written yet (each about twice its stage's weights, made on first use)"
                 + (f", {written:.1f} MiB written" if written else "")))


def _figures(manifest, measures, evicted: bool, threads: int) -> dict | None:
    """Whether the staged figures are this device's or estimates: the stages' sizes (their packed copies'
    mappings, measured when written, or the bundle's files) and their costs (measured by a first staged run on
    `threads`, cached in `stage_costs_file`, or assumed from the bytes). None for a bundle without stages."""
    if not manifest.target.stages:
        return None
    sizes, costs = measures
    path = stream_costs.cache_path(cache_dir(), bundle_key(manifest), evicted, threads)
    kind = "measured" if sizes is not None else "files" if prepacked.available() else "files, no packed copies here"
    return {"stage_sizes": kind, "threads": threads,
            "stage_costs": "assumed" if costs is None else "measured", "stage_costs_file": str(path)}


def _figures_line(figures: dict) -> str:
    threads = f"{figures['threads']} thread" + ("s" if figures["threads"] > 1 else "")
    path = figures["stage_costs_file"]
    sizes = {"measured": "stage sizes: their packed copies' mappings",
             "files": "stage sizes: the bundle's files until a first run under a budget writes the packed copies"}.get(
        figures["stage_sizes"], "stage sizes: the bundle's files (no packed copies on this system)")
    costs = (f"stage costs measured on {threads}, cached in {path}: delete it to measure again"
             if figures["stage_costs"] == "measured" else
             f"stage costs assumed from their bytes until a first run that streams on {threads} measures them "
             f"into {path}")
    estimated = figures["stage_sizes"] == "files" or figures["stage_costs"] == "assumed"
    return (f"figures: {'estimates, until measured: then the plan may change' if estimated else 'measured here'} "
            f"({sizes}; {costs})")


def _split_dict(plan: MemoryPlan) -> dict:
    return {"pinned_stages": list(plan.pinned_stages), "streamed_bytes_per_pass": plan.streamed_bytes_per_pass,
            "context": plan.context, "pass_seconds": plan.pass_seconds, "total": plan.total}


def _trade_table(splits: list[MemoryPlan]) -> str:
    """The plan's split (first, marked) and the others of the same budget: what each pins, what it streams per
    pass, the context it leaves and the plain decoding its stage costs predict."""
    rows = ["splits of this budget (* the plan):",
            f"  {'stages pinned':>14}  {'streamed per pass':>17}  {'context':>7}  expected plain decoding"]
    for i, p in enumerate(splits):
        pinned = f"{len(p.pinned_stages)} of {len(p.stage_bytes)}" if p.streams else "all (resident)"
        speed = "as resident" if p.pass_seconds is None else f"{1 / p.pass_seconds:.1f} tokens/s"
        streamed = mib(p.streamed_bytes_per_pass)
        rows.append(f"{'*' if i == 0 else ' '} {pinned:>14}  {streamed:>17}  {p.context:>7}  {speed}")
    return "\n".join(rows)


def _packed_disk(manifest, folder) -> dict | None:
    """The packed copies a staged run maps on this machine (Linux), and the disk they take."""

    if not prepacked.available():
        return None
    copies = packed_copies(manifest)
    return {"folder": str(default_prepared_dir() / prepacked.machine_key()), "stages": len(copies),
            "missing": sum(size is None for _, size in copies), "written_bytes": sum(size or 0 for _, size in copies)}
