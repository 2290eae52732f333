"""edgespec against what a user would pick instead: onnxruntime-genai's own export of the same model.

    pip install -e ".[export,peers]"
    python benchmarks/peers.py BUNDLE [BUNDLE ...] [--prompts FILE.jsonl ...] [--max-new-tokens 128]
                               [--rounds 2] [--threads 2] [--json OUT.json] [--perplexity] [--peer-precision int4]

Builds onnxruntime-genai's CPU export of the reference model (SmolLM2-135M-Instruct, from the same
GGUF edgespec's default bundle comes from; int4 unless `--peer-precision`) with its own model builder, once, into the edgespec cache
(`EDGESPEC_CACHE/peers/`). Then, for every prompt set, runs in one sitting and alternating round by
round: onnxruntime-genai greedy, onnxruntime-genai with its n-gram speculation (3-gram, 10 draft
tokens), and each bundle plain and speculative. Every run is a process of its own, so peak RSS is
that system's alone. Prints one table per prompt set: decode tokens/s (first token excluded), time
to first token, peak RSS, tokens per target pass, the ratio to the faster onnxruntime-genai mode, and
whether each bundle's speculative output is identical to its own plain decoding on every prompt.
`--perplexity` first prints each system's perplexity on edgespec's held-out text (the text and
tokenization the bundles' quality.json uses), teacher-forced in one pass: what each int4 costs.

The child processes are this file run with `--child`; nothing else calls it.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edgespec.bench import RU_MAXRSS_PER_MB
from edgespec.runtime.paths import cache_dir

PEER_NGRAM = {"ngram_size": 3, "max_draft_tokens": 10}  # the mode the fast-engine issue compared against
HERE = Path(__file__).resolve().parent


def build_peer(threads: int, precision: str = "int4") -> Path:
    """onnxruntime-genai's export of the reference model at `precision`, built by its model builder (once)."""
    out = cache_dir() / "peers" / f"ortgenai-smollm2-135m-{precision}"
    if (out / "genai_config.json").is_file():
        return out
    from edgespec.exporters.sources import resolve_source

    hf = cache_dir() / "peers" / "smollm2-135m-hf"
    if not (hf / "config.json").is_file():
        model, tokenizer = resolve_source("default", cache_dir()).load()
        # loaded from a GGUF, dequantized: the weights are plain floats, saved as such
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
    partial = out.with_name(out.name + ".partial")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(partial),
                    "-p", precision, "-e", "cpu", "-c", str(cache_dir() / "peers" / "builder-cache")], check=True)
    config = json.loads((partial / "genai_config.json").read_text())
    session = config["model"]["decoder"].setdefault("session_options", {})
    session["intra_op_num_threads"] = threads
    (partial / "genai_config.json").write_text(json.dumps(config, indent=2))
    partial.replace(out)
    return out


def load_prompts(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def run_peer(folder: Path, prompts: list[list[dict]], max_new_tokens: int, ngram: bool) -> list[dict]:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    if ngram:
        config.overlay(json.dumps({"speculative": PEER_NGRAM}))
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)
    results = []
    for i, messages in enumerate([prompts[0]] + prompts):  # the first run warms up and is dropped
        ids = tokenizer.encode(tokenizer.apply_chat_template(json.dumps(messages), add_generation_prompt=True))
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        generator = og.Generator(model, params)
        started = time.perf_counter()
        generator.append_tokens(ids)
        generator.generate_next_token()
        first = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        done = time.perf_counter()
        tokens = [int(t) for t in generator.get_sequence(0)][len(ids):]
        if i:
            results.append({"tokens": tokens, "ttft_s": first - started, "decode_s": done - first, "passes": None})
    return results


def peer_perplexity(folder: Path, ids: list[int]) -> float:
    """The peer's graph run directly by onnxruntime over `ids` at once (an empty past)."""
    import numpy as np
    import onnxruntime as ort

    from edgespec.quant.report import perplexity_of

    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    head_size = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for value in session.get_inputs():
        if value.name.startswith("past_key_values"):
            feed[value.name] = np.zeros((1, value.shape[1], 0, head_size), np.float32)
    return perplexity_of(session.run(["logits"], feed)[0][0], ids)


def perplexities(peer: Path, bundles: list[Path]) -> None:
    from importlib import resources

    from edgespec.quant.report import perplexity
    from edgespec.runtime.pipeline import Pipeline

    text = resources.files("edgespec").joinpath("data/heldout.txt").read_text(encoding="utf-8")
    for bundle in bundles:
        pipeline = Pipeline(bundle, threads=2)
        ids = pipeline.codec.encode(text)[: pipeline.manifest.target.facts.max_context - 1]
        quality = json.loads((bundle / "quality.json").read_text()) if (bundle / "quality.json").is_file() else {}
        fp32 = quality.get("perplexity", {}).get("fp32")
        print(f"{bundle.name:42s} perplexity {perplexity(pipeline.target, ids):.4f}"
              + (f"   (its fp32 export: {fp32})" if fp32 else ""))
    print(f"{'onnxruntime-genai ' + peer.name.rsplit('-', 1)[-1]:42s} perplexity {peer_perplexity(peer, ids):.4f}")


def run_bundle(folder: Path, prompts: list[list[dict]], max_new_tokens: int, speculate: bool, threads: int) -> list[dict]:
    from edgespec.runtime.engine import GenerationConfig
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(folder, threads=threads)
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    results = []
    for i, messages in enumerate([prompts[0]] + prompts):
        result = pipeline.generate(messages=messages, config=config, speculate=speculate)
        s = result.stats
        if i:
            results.append({"tokens": result.token_ids, "ttft_s": s.first_token_s, "decode_s": s.decode_s,
                            "passes": s.target_passes})
    return results


def child(args) -> None:
    prompts = load_prompts(Path(args.child_prompts))
    if args.child == "peer":
        results = run_peer(Path(args.child_folder), prompts, args.max_new_tokens, ngram=False)
    elif args.child == "peer-ngram":
        results = run_peer(Path(args.child_folder), prompts, args.max_new_tokens, ngram=True)
    else:
        results = run_bundle(Path(args.child_folder), prompts, args.max_new_tokens, args.child == "speculative",
                             args.threads)
    print(json.dumps({"results": results, "peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak RSS since it started. Not getrusage's ru_maxrss: Linux carries that across
    exec from the parent, so a child would report its parent's peak when that was higher."""
    status = Path("/proc/self/status")
    if status.is_file():
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / RU_MAXRSS_PER_MB


def measure(kind: str, folder: Path, prompts: Path, args) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--child-folder", str(folder), "--child-prompts", str(prompts),
               "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{kind} on {folder} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    results = [r for run in runs for r in run["results"]]
    decoded = sum(max(0, len(r["tokens"]) - 1) for r in results)
    passes = [r["passes"] for r in results if r["passes"] is not None]
    return {"tokens_per_s": decoded / sum(r["decode_s"] for r in results),
            "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in results),
            "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
            "tokens_per_pass": (sum(len(r["tokens"]) - 1 for r in results) / sum(passes)) if passes and sum(passes) else None,
            "outputs": [r["tokens"] for r in runs[0]["results"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="*", type=Path)
    parser.add_argument("--prompts", nargs="+", type=Path,
                        default=[HERE.parent / "edgespec" / "data" / "prompts.jsonl", HERE / "edit_prompts.jsonl"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--peer-precision", default="int4", choices=("int4", "int8", "fp32"),
                        help="onnxruntime-genai's export to compare against (its builder's -p)")
    parser.add_argument("--perplexity", action="store_true", help="first print each system's held-out perplexity")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-folder", help=argparse.SUPPRESS)
    parser.add_argument("--child-prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if not args.bundles:
        parser.error("give at least one bundle")
    peer = build_peer(args.threads, args.peer_precision)
    if args.perplexity:
        perplexities(peer, args.bundles)
    systems = [(f"onnxruntime-genai {args.peer_precision}", "peer", peer),
               (f"onnxruntime-genai {args.peer_precision} n-gram 3/10", "peer-ngram", peer)]
    for bundle in args.bundles:
        systems += [(f"{bundle.name} plain", "plain", bundle), (f"{bundle.name} speculative", "speculative", bundle)]
    report = {}
    for prompts in args.prompts:
        runs = {name: [] for name, _, _ in systems}
        for round_ in range(args.rounds):  # alternate the order round by round: drift falls on all alike
            for name, kind, folder in (systems if round_ % 2 == 0 else systems[::-1]):
                runs[name].append(measure(kind, folder, prompts, args))
        table = {name: summarize(r) for name, r in runs.items()}
        best_peer = max(table[systems[0][0]]["tokens_per_s"], table[systems[1][0]]["tokens_per_s"])
        print(f"\n{prompts.name}: {args.max_new_tokens} new tokens, greedy, {args.threads} threads, "
              f"{args.rounds} rounds alternating")
        print(f"{'system':42s} {'tokens/s':>9s} {'x peer':>7s} {'TTFT ms':>8s} {'RSS MB':>7s} {'tok/pass':>8s}  identical")
        for name, kind, folder in systems:
            row = table[name]
            same = ""
            if kind == "speculative":
                same = str(row["outputs"] == table[f"{folder.name} plain"]["outputs"])
            per_pass = f"{row['tokens_per_pass']:.2f}" if row["tokens_per_pass"] else ""
            print(f"{name:42s} {row['tokens_per_s']:9.1f} {row['tokens_per_s'] / best_peer:7.2f} {row['ttft_ms']:8.1f} "
                  f"{row['peak_rss_mb']:7.0f} {per_pass:>8s}  {same}")
            row["identical_to_plain"] = same or None
        report[prompts.name] = {name: {k: v for k, v in row.items() if k != "outputs"} for name, row in table.items()}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
