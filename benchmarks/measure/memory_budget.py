"""Tokens/s and peak RSS against the memory budget, plain and speculative, for a bundle with stages.

    python benchmarks/measure/memory_budget.py BUNDLE [--fractions 1.0,0.75,0.5,0.25] [--context 2048]
        [--workloads chat=benchmarks/workloads/chat.jsonl,edit=benchmarks/edit_prompts.jsonl] [--first 3]
        [--page-cache kept,evicted] [--max-new-tokens 64] [--rounds 1] [--plot benchmarks/memory_budget.svg]
        [--json-out ROWS.json]
    python benchmarks/measure/memory_budget.py --replot ROWS.json [ROWS.json ...] --plot benchmarks/memory_budget.svg

Each budget is the plan's fixed part (runtime, draft, scratch, KV for `--context` tokens, the floor the
planner keeps) plus a fraction of the target's resident weights as this machine holds them (the packed
copies' mappings, prepared first: they are larger than the bundle's files); "none" is the unconstrained
run. Every point is its own process (`edgespec bench --json --context N`), so its peak RSS is its own,
and runs once per workload (`--first` prompts of each file) and per page-cache policy: "kept" leaves
released stages in the OS page cache, "evicted" passes --evict-page-cache (a streamed stage is read from
storage again on every pass). A streaming point's first run measures the stage costs the plan uses and
caches them per policy; run the script twice where a plan made with assumed costs must be excluded.
With --rounds R every point runs R times, the points taken in turn each round, so that a budgeted point and
the unconstrained one of the same workload run minutes apart, not a sweep apart: each row then holds the
median of its rounds and `plain_of_resident`, the median of its plain tokens/s over the same round's
unconstrained plain tokens/s (the ratio a loaded, shared machine can still measure).
Needs matplotlib for the plot (pip install 'edgespec[bench]').

--limit-memory (Linux, root, cgroup v1 memory controller) runs each budgeted point inside a memory cgroup
limited to the budget, which counts the page cache too, after the bundle's and the packed stages' files
are dropped from the page cache.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.execution.budget import plan_memory
from edgespec.runtime.execution.stage_build import packed_graphs, resident_stage_bytes
from edgespec.runtime.pipeline import default_prepared_dir

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("bundle", nargs="?")
parser.add_argument("--fractions", default="1.0,0.75,0.5,0.25", help="of the target's weights, beside the fixed part")
parser.add_argument("--context", type=int, default=2048, help="the context floor every budget holds (tokens)")
parser.add_argument("--workloads", default="chat=benchmarks/workloads/chat.jsonl,edit=benchmarks/edit_prompts.jsonl",
                    help="NAME=JSONL pairs, comma-separated")
parser.add_argument("--first", type=int, default=None, help="only the first N prompts of each workload")
parser.add_argument("--page-cache", default="kept,evicted", help="policies to run each budget under: kept, evicted")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--rounds", type=int, default=1, help="run every point this many times, in turn (medians)")
parser.add_argument("--threads", type=int, default=None)
parser.add_argument("--plot", default=None)
parser.add_argument("--json-out", default=None, help="also write the rows to this file")
parser.add_argument("--limit-memory", action="store_true")
parser.add_argument("--replot", nargs="+", default=None, metavar="ROWS.json",
                    help="draw --plot from the rows earlier runs wrote with --json-out, running nothing")
args = parser.parse_args()
if (args.bundle is None) == (args.replot is None):
    parser.error("give a bundle to measure, or --replot with rows to draw")
CGROUP = Path("/sys/fs/cgroup/memory/edgespec-memory-budget")


def drop_from_page_cache(*folders: Path) -> None:
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def limited(command: list[str], budget: int, folder: Path) -> list[str]:
    """`command` run inside a memory cgroup of `budget` bytes, page cache included."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(budget))
    drop_from_page_cache(folder, default_prepared_dir())
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "limited", *command]


def prompts_file(path: str, scratch: Path) -> str:
    if args.first is None:
        return path
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()][: args.first]
    subset = scratch / f"{Path(path).stem}-first{args.first}.jsonl"
    subset.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(subset)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "plain" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in measured))
    policies = list(dict.fromkeys(r["page_cache"] for r in measured if r["budget_mib"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in workloads:
        for policy, style in zip(policies, ("-", "--")):
            points = sorted((r for r in measured if r["workload"] == name and r["page_cache"] == policy
                             and r["budget_mib"]), key=lambda r: r["budget_mib"])
            x = [r["budget_mib"] for r in points]
            left.plot(x, [r["plain"] for r in points], "o" + style, label=f"{name} plain, cache {policy}")
            left.plot(x, [r["speculative"] for r in points], "s" + style, label=f"{name} speculative, cache {policy}")
            right.plot(x, [r["peak_rss_mib"] for r in points], "o" + style, label=f"{name}, cache {policy}")
    budgets = sorted({r["budget_mib"] for r in measured if r["budget_mib"]})
    right.plot(budgets, budgets, "k-", lw=0.8, label="budget")
    right.plot(budgets, [1.05 * b for b in budgets], "k:", lw=0.8, label="budget + 5%")
    left.set_xlabel("memory budget (MiB)"), left.set_ylabel("tokens/s"), left.legend(fontsize=7)
    right.set_xlabel("memory budget (MiB)"), right.set_ylabel("peak RSS (MiB)"), right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def run_point(folder: Path, prompts: str, budget: int | None, policy: str) -> dict:
    """One `edgespec bench` process at `budget` (None: unconstrained): its report's figures, or its refusal."""
    command = [sys.executable, "-m", "edgespec.cli", "bench", str(folder), "--json", "--prompts", prompts,
               "--max-new-tokens", str(args.max_new_tokens)] \
        + (["--threads", str(args.threads)] if args.threads else []) \
        + (["--memory-budget", str(budget), "--context", str(args.context)] if budget else []) \
        + (["--evict-page-cache"] if budget and policy == "evicted" else [])
    if budget and args.limit_memory:
        command = limited(command, budget, folder)
    done = subprocess.run(command, capture_output=True, text=True)
    point = {"budget_mib": None if budget is None else round(budget / 2**20, 1)}
    if done.returncode != 0:
        return {**point, "refused": done.stderr.strip().splitlines()[-1]}
    report = json.loads(done.stdout)
    return {**point, "peak_rss_mib": report["peak_rss_mb"], "plain": report["plain"]["tokens_per_s"],
            "speculative": report["speculative"]["tokens_per_s"], "speedup": report["speedup"],
            "per_pass": report["speculative"]["mean_accepted_per_pass"], "identical": report["identical_greedy"]}


def show(name: str, label: str, policy: str, r: dict) -> None:
    if "refused" in r:
        print(f"{name} {label} {policy}: {r['refused']}", flush=True)
        return
    over = "" if r["budget_mib"] is None else f" ({r['peak_rss_mib'] / r['budget_mib']:.0%} of budget)"
    print(f"{name:>5} weights {label:>5} {policy:>7}  budget {str(r['budget_mib']):>6} MiB  peak RSS "
          f"{r['peak_rss_mib']:6.1f} MiB{over}  plain {r['plain']:6.1f}  speculative {r['speculative']:6.1f} "
          f"tokens/s ({r['speedup']:.2f}x, {r['per_pass']:.2f} per pass, identical {r['identical']})", flush=True)


def summary(name: str, label: str, policy: str, runs: dict) -> dict:
    """A point's row: the median of its rounds (the highest peak RSS), plain against the same round's
    unconstrained plain."""
    done = [r for r in runs[(name, label, policy)] if "refused" not in r]
    row = {"workload": name, "fraction": label, "page_cache": policy, "rounds": len(runs[(name, label, policy)])}
    if not done:
        return {**row, **runs[(name, label, policy)][-1]}
    resident = runs[(name, "none", "kept")]
    ratios = [r["plain"] / alone["plain"] for r, alone in zip(runs[(name, label, policy)], resident)
              if "plain" in r and "plain" in alone]
    return {**row, "budget_mib": done[0]["budget_mib"], "peak_rss_mib": max(r["peak_rss_mib"] for r in done),
            **{key: round(statistics.median(r[key] for r in done), 3)
               for key in ("plain", "speculative", "speedup", "per_pass")},
            "identical": all(r["identical"] for r in done),
            "plain_of_resident": round(statistics.median(ratios), 3) if ratios else None}


def measure() -> list[dict]:
    folder = Path(args.bundle)
    manifest = open_bundle(folder)
    stage_bytes = None
    if manifest.target.stages:  # what the plan on this machine counts: the packed copies' mappings
        packed_graphs(manifest, folder, default_prepared_dir())
        stage_bytes = resident_stage_bytes(manifest, default_prepared_dir())
    full = plan_memory(manifest, folder, None, args.context, stage_bytes)
    at_floor = full.total - (full.target_kv + full.draft_kv) + args.context * (full.target_kv_per_token
                                                                               + full.draft_kv_per_token)
    fixed = at_floor - full.target_weights
    print(f"target weights {full.target_weights / 2**20:.1f} MiB resident, fixed part {fixed / 2**20:.1f} MiB "
          f"(KV for {args.context} tokens)", flush=True)
    workloads = dict(item.split("=", 1) for item in args.workloads.split(","))
    policies = args.page_cache.split(",")
    runs: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        points = [(name, prompts_file(path, Path(scratch)), label, policy)
                  for name, path in workloads.items() for label in ["none"] + args.fractions.split(",")
                  for policy in (["kept"] if label == "none" else policies)]
        for _ in range(args.rounds):
            for name, prompts, label, policy in points:
                budget = None if label == "none" else int(fixed + float(label) * full.target_weights)
                runs.setdefault((name, label, policy), []).append(run_point(folder, prompts, budget, policy))
                show(name, label, policy, runs[(name, label, policy)][-1])
    return [summary(name, label, policy, runs) for name, label, policy in runs]


rows = measure() if args.replot is None else [row for path in args.replot for row in json.loads(Path(path).read_text())]
if args.replot is None:
    print(json.dumps(rows))
if args.json_out:
    Path(args.json_out).write_text(json.dumps(rows, indent=1) + "\n")
if args.plot and any("plain" in r for r in rows):
    plot(rows, args.plot)
