"""Tokens/s and peak RSS against the memory budget, plain and speculative, for a bundle with stages.

    python benchmarks/memory_budget.py BUNDLE [--fractions 1.0,0.75,0.5,0.25] [--max-new-tokens 64]
                                       [--plot benchmarks/memory_budget.svg]

Each budget is `plan`'s fixed part (runtime, draft, scratch, KV for the full context) plus a fraction
of the target's weights; "none" is the unconstrained run. Every point is its own process (`edgespec
bench --json`), so its peak RSS is its own. Needs matplotlib for the plot (pip install 'edgespec[bench]').

--limit-memory (Linux, root, cgroup v1 memory controller) runs each budgeted point as on a device where
the budget is all the memory there is: inside a memory cgroup limited to the budget, which counts the
page cache too, after the bundle's and the packed stages' files are dropped from the page cache. Streamed
stages are then read from storage on every pass instead of from the OS cache. --evict-page-cache makes
the runtime drop a streamed stage's pages from that cache when it releases them (see `edgespec bench --help`).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from edgespec.runtime.budget import plan_memory
from edgespec.runtime.bundle import open_bundle

parser = argparse.ArgumentParser()
parser.add_argument("bundle")
parser.add_argument("--fractions", default="1.0,0.75,0.5,0.25")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--prompts", default=None)
parser.add_argument("--plot", default=None)
parser.add_argument("--limit-memory", action="store_true")
parser.add_argument("--evict-page-cache", action="store_true", help="passed to every budgeted point")
args = parser.parse_args()
CGROUP = Path("/sys/fs/cgroup/memory/edgespec-memory-budget")


def drop_from_page_cache(*folders: Path) -> None:
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def limited(command: list[str], budget: int) -> list[str]:
    """`command` run inside a memory cgroup of `budget` bytes, page cache included."""
    from edgespec.defaults import cache_dir

    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(budget))
    drop_from_page_cache(folder, cache_dir() / "prepacked")
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "limited", *command]


folder = Path(args.bundle)
full = plan_memory(open_bundle(folder), folder, None)
fixed = full.total - full.target_weights
rows = []
for label in ["none"] + args.fractions.split(","):
    budget = None if label == "none" else int(fixed + float(label) * full.target_weights)
    command = [sys.executable, "-m", "edgespec.cli", "bench", str(folder), "--json",
               "--max-new-tokens", str(args.max_new_tokens)] + (["--prompts", args.prompts] if args.prompts else []) \
        + (["--memory-budget", str(budget)] if budget else []) \
        + (["--evict-page-cache"] if budget and args.evict_page_cache else [])
    if budget and args.limit_memory:
        command = limited(command, budget)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{label}: {done.stderr.strip().splitlines()[-1]}")
        continue
    report = json.loads(done.stdout)
    rows.append({"fraction": label, "budget_mib": None if budget is None else round(budget / 2**20, 1),
                 "peak_rss_mib": report["peak_rss_mb"], "plain": report["plain"]["tokens_per_s"],
                 "speculative": report["speculative"]["tokens_per_s"], "speedup": report["speedup"],
                 "per_pass": report["speculative"]["mean_accepted_per_pass"], "identical": report["identical_greedy"]})
    r = rows[-1]
    print(f"weights {label:>5}  budget {str(r['budget_mib']):>8} MiB  peak RSS {r['peak_rss_mib']:7.1f} MiB  "
          f"plain {r['plain']:6.1f}  speculative {r['speculative']:6.1f} tokens/s  ({r['speedup']:.2f}x, "
          f"{r['per_pass']:.2f} per pass, identical {r['identical']})", flush=True)
print(json.dumps(rows))
if args.plot and rows:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    constrained = [r for r in rows if r["budget_mib"] is not None]
    x = [r["budget_mib"] for r in constrained]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [r["plain"] for r in constrained], "o-", label="plain")
    left.plot(x, [r["speculative"] for r in constrained], "s-", label="speculative")
    left.set_xlabel("memory budget (MiB)"), left.set_ylabel("tokens/s"), left.legend()
    right.plot(x, [r["peak_rss_mib"] for r in constrained], "o-", label="peak RSS")
    right.plot(x, x, "--", label="budget")
    right.plot(x, [1.1 * b for b in x], ":", label="budget + 10%")
    right.set_xlabel("memory budget (MiB)"), right.set_ylabel("MiB"), right.legend()
    fig.tight_layout()
    fig.savefig(args.plot)
