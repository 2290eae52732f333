"""peers.py --profile: where one prompt's decoding steps go, per operator, in edgespec and onnxruntime-genai.

Each system runs in a child process of its own (peers.py `--child profile-*`) with onnxruntime's profiler on
its decoder session: edgespec's target through a second session of the bundle's graph made with make_session's
CPU options and `enable_profiling` (verify_cost.profiled_session), genai's through its own config option
(`session_options.enable_profiling`: the profile file's prefix). After a warm-up generation of the same prompt,
one greedy generation is profiled; its one-token steps are the last (new tokens - 1) runs of the session, at the
pasts the prompt reaches. Reported per step: each operator type's floor (the sum over its nodes of each node's
fastest time in any step: a step another process preempted inflates whichever node ran then, so on a shared
machine a median or mean of totals is mostly the others' load) and share of the run's floor, the run (floor,
median and mean), and the wall time of a step with what lies outside onnxruntime's run (the
mean wall time less the mean run: Python, the binding, the runtime's bookkeeping). The profiler costs a few microseconds a node in both, so compare shares
and differences, not totals against unprofiled runs.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def step_nodes(profile_file: str, vocab: int, steps: int) -> list[dict[str, tuple[str, float]]]:
    """The last `steps` runs of a profile: {node: (op type, the head's vocabulary-wide nodes apart; ms)}
    each, with "(run)" the whole run."""
    events = json.loads(Path(profile_file).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    if len(runs) < steps:
        raise SystemExit(f"{profile_file}: {len(runs)} runs profiled, {steps} steps expected")
    runs = runs[len(runs) - steps:]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                    and e["ts"] >= runs[0]["ts"]), key=lambda e: e["ts"])
    out, i = [], 0
    for run in runs:
        found = {"(run)": ("(run)", run["dur"] / 1000)}
        while i < len(nodes) and nodes[i]["ts"] <= run["ts"] + run["dur"]:
            node = nodes[i]
            shapes = node["args"].get("output_type_shape") or [{}]
            dims = next(iter(shapes[0].values()), []) if shapes and shapes[0] else []
            head = "head:" if dims and dims[-1] == vocab else ""
            found[node["name"]] = (head + node["args"].get("op_name", "?"), node["dur"] / 1000)
            i += 1
        out.append(found)
    return out


def summary(runs: list[dict[str, tuple[str, float]]], wall_s: float) -> dict:
    """Per operator type: the sum over its nodes of each node's fastest time in any step ("floor": what the
    step costs where no other process preempted it, which survives a shared machine far better than a mean),
    and the median over the steps of the type's total; the run's floor, median and mean; the wall time."""
    names = {name: op for r in runs for name, (op, _) in r.items()}
    floor: dict[str, float] = {}
    for name, op in names.items():
        floor[op] = floor.get(op, 0.0) + min(r[name][1] for r in runs if name in r)
    floor["(between nodes)"] = floor["(run)"] - sum(v for k, v in floor.items() if k != "(run)")
    totals = [{} for _ in runs]
    for total, r in zip(totals, runs):
        for name, (op, ms) in r.items():
            total[op] = total.get(op, 0.0) + ms
    median = {op: statistics.median(t.get(op, 0.0) for t in totals) for op in floor if op != "(between nodes)"}
    mean_run = sum(t["(run)"] for t in totals) / len(totals)
    return {"steps": len(runs), "ms_per_step": floor, "median_ms_per_step": median, "run_ms_mean": mean_run,
            "wall_ms_per_step": 1000 * wall_s / len(runs), "outside_run_ms_per_step": 1000 * wall_s / len(runs) - mean_run}


def profile_genai(folder: Path, item: dict, max_new_tokens: int, threads: int, out_dir: Path) -> dict:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    options = {"intra_op_num_threads": threads, "enable_profiling": str(out_dir / "genai")}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)
    vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    for _ in range(2):  # a warm-up, then the profiled generation
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(item["ids"]) + max_new_tokens)
        generator = og.Generator(model, params)
        generator.append_tokens(item["ids"])
        generator.generate_next_token()
        first = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        wall = time.perf_counter() - first
        tokens = [int(t) for t in generator.get_sequence(0)][len(item["ids"]):]
        del generator, params
    del model  # onnxruntime writes the profile when the session ends: nothing may hold the model
    files = sorted(out_dir.glob("genai*.json"))
    if not files:
        raise SystemExit(f"onnxruntime-genai wrote no profile into {out_dir}")
    return {"tokens": tokens, **summary(step_nodes(str(files[-1]), vocab, len(tokens) - 1), wall)}


def profile_bundle(folder: Path, item: dict, max_new_tokens: int, threads: int, out_dir: Path,
                   speculate: bool = False) -> dict:
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.pipeline import Pipeline
    from verify_cost import profiled_session

    pipeline = Pipeline(folder, threads=threads)
    target = pipeline.target
    if not hasattr(target, "session"):
        raise SystemExit(f"{folder}: a streamed or CoreML target; profile a bundle whose target is one graph")
    target.session = profiled_session(folder / pipeline.manifest.target.graph.file, pipeline.target_threads,
                                      str(out_dir / "edgespec"))
    kwargs = {k: v for k, v in item.items() if k != "ids"}
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    for warm_up in (True, False):
        result = pipeline.generate(**kwargs, config=config, speculate=speculate, remember=False)
    passes = result.stats.target_passes
    runs = step_nodes(target.session.end_profiling(), target.head_size, passes)
    return {"tokens": result.token_ids, "steps_by_choice": result.stats.steps_by_choice,
            **summary(runs, result.stats.decode_s)}


def print_profiles(name_of_set: str, past: int, found: dict[str, dict]) -> None:
    """Side by side: each system's ms per step by operator type, and its share of the run."""
    names = list(found)
    ops = sorted({op for f in found.values() for op in f["ms_per_step"] if not op.startswith("(run")},
                 key=lambda op: -max(f["ms_per_step"].get(op, 0.0) for f in found.values()))
    print(f"\n{name_of_set}: one prompt of {past} tokens, ms per one-token step by operator: the sum of each node's "
          "fastest time over the steps (share of that floor)")
    print("| op | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for op in ops:
        cells = []
        for f in found.values():
            ms = f["ms_per_step"].get(op, 0.0)
            cells.append(f"{ms:.3f} ({ms / f['ms_per_step']['(run)']:.0%})" if ms else "")
        if any(f["ms_per_step"].get(op, 0.0) >= 0.01 for f in found.values()):
            print(f"| {op} | " + " | ".join(cells) + " |")
    print("| **run, median** | " + " | ".join(f"{f['median_ms_per_step']['(run)']:.3f}" for f in found.values()) + " |")
    for label, key in (("run, floor", None), ("run, mean", "run_ms_mean"), ("wall per step, mean", "wall_ms_per_step"),
                       ("outside the run, mean", "outside_run_ms_per_step")):
        print(f"| **{label}** | " + " | ".join(
            f"{(f['ms_per_step']['(run)'] if key is None else f[key]):.3f}" for f in found.values()) + " |")
    print("| steps | " + " | ".join(str(f["steps"]) for f in found.values()) + " |")
