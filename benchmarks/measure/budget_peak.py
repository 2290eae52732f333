"""Where a budgeted process's peak RSS comes from: per phase of the load and of the first passes, and as
measured from outside.

    python benchmarks/measure/budget_peak.py BUNDLE --memory-budget 260MB [--context N] [--threads N]
        [--prompts benchmarks/workloads/code_edit.jsonl] [--first 2] [--max-new-tokens 64]
    python benchmarks/measure/budget_peak.py BUNDLE --memory-budget 260MB --outside [--rounds 3]
        [--prompts ...] [--max-new-tokens 64]

Phases (default): loads the bundle in this process with the loader's steps wrapped; at the entry and exit of
each step it reads VmHWM, VmRSS, RssAnon and RssFile from /proc/self/status and resets the high-water mark
(`echo 5 > /proc/self/clear_refs`), so each line's "peak" is the highest RSS since the line before: a step
whose transient copy lifts the process above what it keeps shows as a peak above its RSS. Then it
generates the first `--first` prompts plainly and speculatively, one line per request. Linux only.

--outside: runs `edgespec bench BUNDLE --memory-budget ... --json` as a child `--rounds` times and reads
each child's ru_maxrss from os.wait4 (the kernel's account of the whole process, as a container or the OS
sees it), beside the budget and bench's own tokens/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATUS = Path("/proc/self/status")
FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status() -> dict[str, float]:
    """Those fields of /proc/self/status, in MiB."""
    found = {}
    for line in STATUS.read_text().splitlines():
        name, _, value = line.partition(":")
        if name in FIELDS:
            found[name] = int(value.split()[0]) / 1024
    return found


class Marks:
    """A line per mark: the peak since the mark before (the high-water mark is reset after each)."""

    def __init__(self):
        self.reset_ok = self._reset()
        self.worst = 0.0
        self.started = time.perf_counter()

    @staticmethod
    def _reset() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def mark(self, what: str) -> None:
        now = status()
        self.worst = max(self.worst, now["VmHWM"])
        print(f"{time.perf_counter() - self.started:7.2f}s  peak {now['VmHWM']:6.1f}  rss {now['VmRSS']:6.1f}  "
              f"anon {now['RssAnon']:6.1f}  file {now['RssFile']:6.1f}  MiB  {what}", flush=True)
        self._reset()


def wrap(marks: Marks, owner, name: str, label: str | None = None) -> None:
    """Marks before and after every call of owner.name."""
    inner = getattr(owner, name)
    label = label or name

    def wrapped(*args, **kwargs):
        marks.mark(f"> {label}")
        try:
            return inner(*args, **kwargs)
        finally:
            marks.mark(f"< {label}")

    setattr(owner, name, wrapped)


def phases(args) -> None:
    marks = Marks()
    if not marks.reset_ok:
        print("cannot reset the high-water mark here (/proc/self/clear_refs): each line's peak is the process's")
    marks.mark("python started")
    import numpy  # noqa: F401
    import onnxruntime  # noqa: F401
    marks.mark("numpy and onnxruntime imported")
    from edgespec.runtime import pipeline
    from edgespec.runtime.execution import prepacked, stage_build, staged
    from edgespec.runtime.decoding import exactness
    marks.mark("edgespec imported")
    wrap(marks, pipeline, "open_bundle")
    wrap(marks, pipeline, "plan_on_this_device")
    wrap(marks, pipeline, "TextCodec")
    wrap(marks, pipeline, "build_measured")
    wrap(marks, pipeline, "make_session", "make_session (single target or draft)")
    wrap(marks, pipeline, "tree_under_budget")
    wrap(marks, pipeline.Pipeline, "_resolve_exactness")
    wrap(marks, stage_build, "build_staged_target")
    wrap(marks, stage_build, "measured_costs")
    wrap(marks, stage_build, "MappedEmbedding")
    wrap(marks, prepacked.PrepackedStage, "__init__", "PrepackedStage()")
    originals = prepacked.PrepackedStage.fetch, prepacked.PrepackedStage.release
    wrap(marks, prepacked.PrepackedStage, "fetch", "fetch")
    wrap(marks, prepacked.PrepackedStage, "release", "release")
    del exactness, staged
    p = pipeline.Pipeline(args.bundle, threads=args.threads, memory_budget=args.memory_budget, context=args.context)
    marks.mark("loaded")
    # the first passes: a line per request, not per stage fetched
    prepacked.PrepackedStage.fetch, prepacked.PrepackedStage.release = originals
    print(p.memory.describe())
    from edgespec.runtime.decoding.engine import GenerationConfig
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.first]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for i, prompt in enumerate(prompts):
        for speculate in (False, True):
            kind = "speculative" if speculate else "plain"
            ids = p.encode(prompt.get("prompt"), prompt.get("messages"))
            marks.mark(f"> generate #{i} {kind} ({len(ids)} prompt tokens)")
            result = p.generate(ids=ids, config=config, speculate=speculate)
            marks.mark(f"< generate #{i} {kind} ({len(result.token_ids)} tokens)")
    print(f"highest: {marks.worst:.1f} MiB; budget {args.memory_budget} "
          f"= {p.memory.budget / 2**20:.1f} MiB; plan total {p.memory.total / 2**20:.1f} MiB")


def outside(args) -> None:
    command = [sys.executable, "-c", "import sys; from edgespec.cli import main; sys.exit(main())", "bench", args.bundle, "--memory-budget", args.memory_budget,
               "--prompts", args.prompts, "--max-new-tokens", str(args.max_new_tokens), "--json"]
    if args.context:
        command += ["--context", str(args.context)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    from edgespec.runtime.execution.budget import parse_size
    budget = parse_size(args.memory_budget) / 2**20
    print(" ".join(command))
    for r in range(args.rounds):
        with tempfile.TemporaryFile() as out:
            child = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE)
            _, code, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(code)
            out.seek(0)
            text = out.read().decode()
        if child.returncode:
            print(child.stderr.read().decode()[-2000:])
            raise SystemExit(f"bench exited {child.returncode}")
        child.stderr.close()
        report = json.loads(text[text.index("{"):])
        peak = usage.ru_maxrss / 1024  # KiB on Linux
        plain, spec = report["plain"], report.get("speculative") or {}
        print(f"round {r}: peak RSS {peak:.1f} MiB (ru_maxrss from wait4) against a budget of {budget:.1f} MiB: "
              f"{(peak / budget - 1) * 100:+.1f}%; plain {plain.get('tokens_per_s')} tok/s, speculative "
              f"{spec.get('tokens_per_s')} tok/s, identical {report.get('identical_greedy')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("bundle")
    parser.add_argument("--memory-budget", required=True)
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prompts", default="benchmarks/workloads/code_edit.jsonl")
    parser.add_argument("--first", type=int, default=2, help="prompts generated after the load (phases)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--outside", action="store_true", help="bench as a child, its ru_maxrss from wait4")
    parser.add_argument("--rounds", type=int, default=1, help="--outside: children run one after another")
    args = parser.parse_args()
    outside(args) if args.outside else phases(args)


if __name__ == "__main__":
    main()
