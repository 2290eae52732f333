"""peers.py --profile: where one prompt's decoding steps go, per operator, in edgespec and onnxruntime-genai.

Each system runs in a child process of its own (peers.py `--child profile-*`) with onnxruntime's profiler on
its decoder session: edgespec's target through a second session of the bundle's graph made with make_session's
CPU options and `enable_profiling` (verify_cost.profiled_session), genai's through its own config option
(`session_options.enable_profiling`: the profile file's prefix). After a warm-up generation of the same prompt,
one greedy generation is profiled; its one-token steps are the last (new tokens - 1) runs of the session, at the
pasts the prompt reaches. Reported per step: each operator type's median milliseconds and share of the median
run, the run (median and mean), and the wall time of a step with what lies outside onnxruntime's run (the
mean wall time less the mean run: Python, the binding, the runtime's bookkeeping). The profiler costs a few microseconds a node in both, so compare shares
and differences, not totals against unprofiled runs.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def step_ops(profile_file: str, vocab: int, steps: int) -> list[dict[str, float]]:
    """The last `steps` runs of a profile: {op type (the head's vocabulary-wide nodes apart): ms} each."""
    from verify_cost import op_times

    runs = op_times(profile_file, vocab, 0)
    if len(runs) < steps:
        raise SystemExit(f"{profile_file}: {len(runs)} runs profiled, {steps} steps expected")
    return runs[len(runs) - steps:]


def summary(runs: list[dict[str, float]], wall_s: float) -> dict:
    """Per operator type the median over the steps (a step another process preempted inflates one op of it, at
    random: medians survive a shared machine better than means), the run's median and mean, the wall time."""
    ops = sorted({op for r in runs for op in r})
    median = {op: statistics.median(r.get(op, 0.0) for r in runs) for op in ops}
    mean_run = sum(r["(run)"] for r in runs) / len(runs)
    return {"steps": len(runs), "ms_per_step": median, "run_ms_mean": mean_run,
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
    return {"tokens": tokens, **summary(step_ops(str(files[-1]), vocab, len(tokens) - 1), wall)}


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
    runs = step_ops(target.session.end_profiling(), target.head_size, passes)
    return {"tokens": result.token_ids, "steps_by_choice": result.stats.steps_by_choice,
            **summary(runs, result.stats.decode_s)}


def print_profiles(name_of_set: str, past: int, found: dict[str, dict]) -> None:
    """Side by side: each system's ms per step by operator type, and its share of the run."""
    names = list(found)
    ops = sorted({op for f in found.values() for op in f["ms_per_step"] if not op.startswith("(run")},
                 key=lambda op: -max(f["ms_per_step"].get(op, 0.0) for f in found.values()))
    print(f"\n{name_of_set}: one prompt of {past} tokens, ms per one-token step by operator, median over the steps "
          "(share of the median run)")
    print("| op | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for op in ops:
        cells = []
        for f in found.values():
            ms = f["ms_per_step"].get(op, 0.0)
            cells.append(f"{ms:.3f} ({ms / f['ms_per_step']['(run)']:.0%})" if ms else "")
        if any(f["ms_per_step"].get(op, 0.0) >= 0.01 for f in found.values()):
            print(f"| {op} | " + " | ".join(cells) + " |")
    for label, key in (("run, median", None), ("run, mean", "run_ms_mean"), ("wall per step, mean", "wall_ms_per_step"),
                       ("outside the run, mean", "outside_run_ms_per_step")):
        print(f"| **{label}** | " + " | ".join(
            f"{(f['ms_per_step']['(run)'] if key is None else f[key]):.3f}" for f in found.values()) + " |")
    print("| steps | " + " | ".join(str(f["steps"]) for f in found.values()) + " |")
