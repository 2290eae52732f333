"""What a verify pass of the target costs by its rows, t(rows) / t(1), for one bundle or for several weight
forms of the same model measured in one process, alternating; where an extra row's cost goes; and a draft
model's pass beside it.

    python benchmarks/measure/verify_cost.py [BUNDLE ...] [--past 256] [--rows 1-16] [--rounds 10] [--threads N]
        [--profile 1,8] [--unpadded] [--draft] [--json FILE]

Every pass is a chain of `rows` tokens after `past` cached ones with logits for every row, as a verify pass
(and `edgespec.tune.pass_seconds`) runs it. rows = 1 is the one-token step as this device runs it: padded to
the bundle's `min_rows` (its exactness verdict here, runtime/decoding/exactness.py: 2 unless this device's check
proves one row exact). `--unpadded` adds "1*", one row at one row whatever the verdict (not an exact pass
where min_rows is 2): the kernels' own curve.

Timing: each round visits every bundle and every row count, the order rotated from round to round; a
(bundle, rows) visit runs `--block` passes and drops the first (it binds inputs of a new shape). t(rows) is
the median over rounds of each visit's median; the ratio is the median over rounds of t(rows) / t(1) within
the same round, with its interquartile range (drift between rounds cancels). "outside" is a pass's time
outside onnxruntime's run (pass_feed, binding, Python), median per pass.

--profile R1,R2: onnxruntime's profiler (SessionOptions.enable_profiling) on a second session of each
bundle, passes of R1 and R2 rows: ms per pass by operator, the nodes whose output is vocabulary-wide (the
head) apart, and what each extra row adds. The profiler's own cost (a few us a node) inflates the totals;
compare the per-row deltas.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.contract.topology import Topology
from edgespec.runtime.decoding.exactness import verdict_here
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import ModelRunner, prefill
from edgespec.runtime.execution.paths import cache_dir
from edgespec.runtime.execution.sessions import make_session
from edgespec.runtime.pipeline import default_threads

from edgespec.defaults import resolve_bundle


def parse_rows(text: str) -> list[int]:
    """'1-16' or '1,2,4,8' or a mix."""
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    if 1 not in out:
        out.insert(0, 1)
    return sorted(set(out))


def profiled_session(path: Path, threads: int, prefix: str) -> ort.InferenceSession:
    """make_session's CPU options (spinning within a run, stopped after it), with the profiler on."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class Form:
    """One target graph, its runner with this device's min_rows, and a cache prefilled to `past` tokens."""

    def __init__(self, name: str, runner: ModelRunner, threads: int, past: int, most_rows: int, chunk: int,
                 min_rows: int, exact: bool, quality: dict | None = None):
        self.name, self.runner, self.threads, self.past, self.exact = name, runner, threads, past, exact
        self.runner.min_rows = min_rows
        facts = runner.facts
        self.cache = KVCache(facts, past + most_rows + 1, lanes=runner.lanes)
        rng = np.random.default_rng(0)
        prefill(runner, self.cache, list(rng.integers(3, facts.vocab_size, past)), chunk)
        self.prefill_runs = math.ceil(past / min(chunk, runner.pass_limit or chunk))
        self.tokens = list(rng.integers(3, facts.vocab_size, most_rows))
        self.quality = quality or {}

    @classmethod
    def from_bundle(cls, folder: Path, threads: int | None, past: int, most_rows: int,
                    profile_prefix: str = "") -> "Form":
        """A bundle's single target graph, min_rows from its exactness verdict on this device."""
        m = open_bundle(folder)
        if m.target.graph is None:
            raise SystemExit(f"{folder}: a staged target; measure its single graph")
        threads = threads or m.profile.threads or default_threads()
        path = folder / m.target.graph.file
        session = profiled_session(path, threads, profile_prefix) if profile_prefix else \
            make_session(path, m.profile.verify, threads, role="the target")
        runner = ModelRunner(session, m.target.facts)
        verdict = verdict_here(m.exactness, m.files.get(m.target.graph.file, ""), runner, cache_dir())
        quality = folder / "quality.json"
        return cls(folder.name, runner, threads, past, most_rows, m.prefill_chunk, verdict.min_rows, verdict.exact,
                   json.loads(quality.read_text()) if quality.is_file() else None)

    def run(self, rows: int, pad: bool = True) -> tuple[float, float]:
        """One chain pass of `rows` tokens, logits for each; (wall seconds, seconds inside onnxruntime).
        pad=False: one row at one row ("1*") whatever the verdict."""
        topology = Topology(tuple(range(-1, rows - 1)))
        runner = self.runner
        keep, runner.min_rows = runner.min_rows, runner.min_rows if pad else 1
        inside = runner.run_seconds
        start = time.perf_counter()
        runner.forward(self.cache, self.tokens[:rows], self.past + topology.depths, topology.ancestor_mask,
                       range(rows))
        wall = time.perf_counter() - start
        runner.min_rows = keep
        return wall, runner.run_seconds - inside

    def perplexity(self) -> str:
        ppl = self.quality.get("perplexity")
        return f"{ppl['quantized']:.4f} ({ppl['increase_percent']:+.2f}%)" if ppl else "-"


def measure(forms: list[Form], sizes: list, rounds: int, block: int, warm: bool = True) -> dict:
    """{form name: {size: (t median, ratio median, ratio q1, ratio q3, outside median)}}, alternating.
    `warm`: first one pass of every form and size, untimed."""
    per_round = defaultdict(list)  # (form, size) -> [round median]
    outside = defaultdict(list)
    for form in forms if warm else ():  # every form and shape once, untimed
        for size in sizes:
            form.run(*size)
    for r in range(rounds):
        order = forms[r % len(forms):] + forms[: r % len(forms)]
        for form in order:
            row_order = sizes[r % len(sizes):] + sizes[: r % len(sizes)]
            if r % 2:
                row_order.reverse()
            for size in row_order:
                times = [form.run(*size) for _ in range(block)][1:]
                per_round[form.name, size].append(statistics.median(t for t, _ in times))
                outside[form.name, size] += [t - inside for t, inside in times]
    out = {}
    for form in forms:
        base = per_round[form.name, (1, True)]
        table = {}
        for size in sizes:
            ratios = [t / b for t, b in zip(per_round[form.name, size], base)]
            q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            table[size] = (statistics.median(per_round[form.name, size]), statistics.median(ratios), q1, q3,
                           statistics.median(outside[form.name, size]))
        out[form.name] = table
    return out


def size_label(size) -> str:
    rows, pad = size
    return f"{rows}" if pad else f"{rows}*"


def print_curves(forms: list[Form], sizes: list, results: dict) -> None:
    for form in forms:
        print(f"\n{form.name}: min_rows {form.runner.min_rows} ({'exact' if form.exact else 'NOT exact'} "
              f"here), {form.threads} threads, perplexity {form.perplexity()}")
        print("| rows | ms per pass | x t(1) | IQR of x | outside onnxruntime us |")
        print("| --- | --- | --- | --- | --- |")
        for size in sizes:
            t, ratio, q1, q3, outside = results[form.name][size]
            print(f"| {size_label(size)} | {t * 1000:.2f} | {ratio:.2f} | {q1:.2f}-{q3:.2f} | {outside * 1e6:.0f} |")
    if len(forms) > 1:
        print("\nratios side by side (x t(1) of the same graph; t(1) in ms in the header)")
        print("| rows | " + " | ".join(f"{f.name} ({results[f.name][(1, True)][0] * 1000:.2f})" for f in forms) + " |")
        print("| --- |" + " --- |" * len(forms))
        for size in sizes:
            print(f"| {size_label(size)} | " + " | ".join(f"{results[f.name][size][1]:.2f}" for f in forms) + " |")


def curves_dict(forms: list[Form], sizes: list, results: dict) -> dict:
    """measure's figures as JSON: per graph, per rows label, ms and the ratio to t(1)."""
    keys = ("ms", "ratio", "ratio_q1", "ratio_q3", "outside_ms")
    return {f.name: {"threads": f.threads, "min_rows": f.runner.min_rows, "exact": f.exact,
                     "perplexity": f.quality.get("perplexity"),
                     "rows": {size_label(s): {k: v * 1000 if k.endswith("ms") else v
                                              for k, v in zip(keys, results[f.name][s])} for s in sizes}}
            for f in forms}


def op_times(profile_file: str, vocab: int, skip_runs: int) -> list[dict[str, float]]:
    """Per run after the first `skip_runs`: {op (head: prefixed for vocabulary-wide outputs): ms}, plus
    '(run)' the whole run and '(between nodes)' the run outside any node."""
    events = json.loads(Path(profile_file).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    out, i = [], 0
    for run in runs:
        ops = defaultdict(float)
        end = run["ts"] + run["dur"]
        while i < len(nodes) and nodes[i]["ts"] < run["ts"]:
            i += 1
        while i < len(nodes) and nodes[i]["ts"] <= end:
            node = nodes[i]
            shapes = node["args"].get("output_type_shape") or [{}]
            dims = next(iter(shapes[0].values()), []) if shapes and shapes[0] else []
            head = bool(dims) and dims[-1] == vocab
            ops[("head:" if head else "") + node["args"].get("op_name", "?")] += node["dur"] / 1000
            i += 1
        ops["(between nodes)"] = run["dur"] / 1000 - sum(ops.values())
        ops["(run)"] = run["dur"] / 1000
        out.append(dict(ops))
    return out[skip_runs:]


def profile(makers, rows: list[int], passes: int) -> dict:
    """Per graph: {rows: {op: median ms per pass}} from onnxruntime's profiler. `makers`: functions that take
    a profile file prefix and return a Form on a profiled session (profiled_session), one at a time."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, make in enumerate(makers):
            form = make(f"{tmp}/p{k}")
            warm = 3
            for n in rows:
                for _ in range(warm + passes):
                    form.run(n)
            profile_file = form.runner.session.end_profiling()
            per_run = op_times(profile_file, form.runner.head_size, form.prefill_runs)
            table = {}
            for i, n in enumerate(rows):
                runs = per_run[i * (warm + passes) + warm: (i + 1) * (warm + passes)]
                table[n] = {op: statistics.median(r.get(op, 0.0) for r in runs) for op in {o for r in runs for o in r}}
            found[form.name] = table
            print_profile(form.name, table, rows)
            del form
    return found


def print_profile(name: str, table: dict, rows: list[int]) -> None:
    lo, hi = rows[0], rows[-1]
    extra = hi - lo
    ops = sorted(table[hi], key=lambda op: -(table[hi][op] - table[lo].get(op, 0.0)) if not op.startswith("(run")
                 else math.inf)
    total_extra = table[hi]["(run)"] - table[lo]["(run)"]
    print(f"\n{name}: onnxruntime's profile, ms per pass (median), {lo} against {hi} rows")
    print(f"| op | {lo} row(s) | {hi} rows | per extra row | share of the extra rows' cost |")
    print("| --- | --- | --- | --- | --- |")
    for op in ops:
        a, b = table[lo].get(op, 0.0), table[hi][op]
        if max(a, b) < 0.005:
            continue
        share = (b - a) / total_extra if total_extra else 0.0
        print(f"| {op} | {a:.3f} | {b:.3f} | {(b - a) / extra:+.3f} | {share:.0%} |")


def draft_costs(folder: Path, args, target_t1: float) -> None:
    """The bundle's draft model (if any): one pass of 1, 2 and 4 nodes, against the target's t(1)."""
    from edgespec.runtime.pipeline import Pipeline

    from edgespec.tune import pass_seconds

    pipeline = Pipeline(folder, args.threads)
    if pipeline.draft is None:
        return
    chunk = pipeline.manifest.prefill_chunk
    draft = pass_seconds(pipeline.draft, chunk, (1, 2, 4), args.past, args.repeats)
    for n, s in draft.items():
        print(f"draft  N={n:3d}  {s * 1000:7.2f} ms per pass  ({s / target_t1:.3f} of the target's t(1))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("bundles", nargs="*", default=["default"], help="bundle folders, or 'default'")
    parser.add_argument("--past", type=int, default=256, help="cached tokens before each pass")
    parser.add_argument("--rows", default="1-16", help="row counts: '1-16', '1,2,4,8'")
    parser.add_argument("--rounds", type=int, default=10, help="rounds over every bundle and row count")
    parser.add_argument("--block", type=int, default=4, help="passes per visit (the first is dropped)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: the profile's)")
    parser.add_argument("--unpadded", action="store_true", help="also one row at one row (1*)")
    parser.add_argument("--no-curve", action="store_true", help="skip the timed curves (with --profile)")
    parser.add_argument("--profile", default=None, help="rows to profile, e.g. '1,8'")
    parser.add_argument("--profile-passes", type=int, default=15, help="profiled passes per row count")
    parser.add_argument("--draft", action="store_true", help="also time the bundle's draft model's passes")
    parser.add_argument("--repeats", type=int, default=30, help="--draft: passes per size")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()

    folders = [resolve_bundle(b) for b in args.bundles]
    names = [f.name for f in folders]
    if len(set(names)) != len(names):
        raise SystemExit("bundles must have distinct folder names")
    rows = parse_rows(args.rows)
    sizes = [(n, True) for n in rows] + ([(1, False)] if args.unpadded else [])
    report = {"past": args.past, "onnxruntime": ort.__version__, "bundles": [str(f) for f in folders]}
    if not args.no_curve:
        forms = [Form.from_bundle(f, args.threads, args.past, max(rows)) for f in folders]
        print(f"past {args.past} tokens; {len(forms)} graph(s) alternating, {args.rounds} rounds x {args.block - 1} "
              f"passes per (graph, rows); onnxruntime {ort.__version__}", file=sys.stderr)
        results = measure(forms, sizes, args.rounds, args.block)
        print_curves(forms, sizes, results)
        report["curves"] = curves_dict(forms, sizes, results)
        t1 = {f.name: results[f.name][(1, True)][0] for f in forms}
        del forms
        if args.draft:
            for folder in folders:
                draft_costs(folder, args, t1[folder.name])
    if args.profile:
        profiled = sorted({int(r) for r in args.profile.split(",")})
        makers = [lambda prefix, f=f: Form.from_bundle(f, args.threads, args.past, max(profiled), prefix)
                  for f in folders]
        report["profile"] = profile(makers, profiled, args.profile_passes)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
