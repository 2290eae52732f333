"""The `edgespec` command line."""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from edgespec.bench import load_prompts, print_report, run_bench
from edgespec.defaults import resolve_bundle
from edgespec.doctor import report as doctor_report
from edgespec.inspection import check_exact, print_bundle
from edgespec.runtime import prepacked
from edgespec.runtime.budget import parse_size, plan_memory
from edgespec.runtime.bundle import open_bundle
from edgespec.runtime.engine import GenerationConfig
from edgespec.runtime.errors import ContextOverflowError, EdgespecError
from edgespec.runtime.paths import cache_dir
from edgespec.runtime.pipeline import Pipeline, default_prepared_dir, packed_copies
from edgespec.runtime.sampling import SamplingConfig
from edgespec.tune import export_tuned, tune

DEMO_QUESTION = "What are three good habits for writing clear code? Answer briefly."


def _stats_line(stats) -> str:
    return (f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, "
            f"{stats.mean_accepted_per_pass:.2f} accepted tokens per target pass, "
            f"first token {stats.first_token_s * 1000:.0f} ms]")


def _pipeline(args):
    return Pipeline(resolve_bundle(args.bundle), args.threads, getattr(args, "memory_budget", None),
                    evict_page_cache=getattr(args, "evict_page_cache", False))


def _stream(pipeline, config, speculate, **ask):
    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = pipeline.generate(**ask, config=config, speculate=speculate, on_text=write)
    sys.stdout.write("\n")
    print(_stats_line(result.stats), file=sys.stderr)
    return result


def cmd_export(args) -> None:
    from edgespec.exporters.export import ExportConfig, export

    config = ExportConfig(model=args.model, draft=args.draft, out=Path(args.out), tree=args.tree,
                        context=args.context, profile=args.profile, prefill_chunk=args.prefill_chunk,
                        quant=args.quant, draft_quant=args.draft_quant, block=args.block,
                        symmetric=not (args.asymmetric or args.integer_zero_points),
                        integer_zero_points=args.integer_zero_points, accuracy_level=args.accuracy_level,
                        integer_matmul=args.integer_matmul,
                        quant_policy=Path(args.quant_policy) if args.quant_policy else None,
                        force=args.force, stages=args.stages, lookup=args.lookup, lookup_quote=args.lookup_quote,
                        lanes=args.lanes, cache_dir=cache_dir())
    if args.tree == "auto":
        export_tuned(config)
    else:
        export(config)


# the settings' names as the command line spells them, for errors raised by the configs themselves
FLAGS = {name: "--" + name.replace("_", "-") for name in ("max_new_tokens", "top_p", "top_k", "min_p", "temperature",
                                                           "repetition_penalty", "seed", "kv_policy")}


def _as_flags(err: ValueError) -> ValueError:
    message = str(err)
    for name, flag in FLAGS.items():
        message = message.replace(name, flag)
    return ValueError(message)


def _sampling_config(args):
    try:
        return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    except ValueError as err:
        raise _as_flags(err) from None


def _generation_config(args):
    try:
        return GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop or ()),
                                sampling=_sampling_config(args), kv_policy=args.kv_policy)
    except ValueError as err:
        raise _as_flags(err) from None


def _result_json(result) -> dict:
    return {"text": result.text, "token_ids": result.token_ids, "stop_reason": result.stop_reason,
            "stats": result.stats.to_dict()}


def cmd_generate(args) -> None:
    config = _generation_config(args)  # before minutes of loading
    pipeline = _pipeline(args)
    ask = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    if args.json:
        try:
            result = pipeline.generate(**ask, config=config, speculate=not args.no_speculate)
        except ContextOverflowError as err:
            if err.partial is None:
                raise
            # what was generated before the context filled still reaches stdout, with the error beside it
            print(json.dumps({**_result_json(err.partial), "error": str(err)}))
            raise
        print(json.dumps(_result_json(result)))
    else:
        _stream(pipeline, config, not args.no_speculate, **ask)


def cmd_chat(args) -> None:
    config = _generation_config(args)
    pipeline = _pipeline(args)
    session = pipeline.new_session()
    drafter = pipeline.make_drafter(not args.no_speculate)
    messages = []
    print("edgespec chat — an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            result = pipeline.generate(messages=messages, config=config, session=session, drafter=drafter,
                                       on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        except (EdgespecError, ValueError) as err:
            messages.pop()  # the conversation goes on without the turn that failed
            print(f"\nedgespec: {err}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        print(_stats_line(result.stats), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})


def cmd_bench(args) -> None:
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    prompts = load_prompts(Path(args.prompts) if args.prompts else None)
    if args.rounds < 1:
        raise ValueError("--rounds must be at least 1")
    sampling = _sampling_config(args)
    report = run_bench(_pipeline(args), prompts, args.max_new_tokens, sampling, args.rounds)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)


def cmd_serve(args) -> None:
    try:
        from edgespec.serve import ServeConfig, serve
    except ImportError as err:
        raise ValueError(f"edgespec serve needs the serve extra (pip install 'edgespec[serve]'): {err}") from err
    if args.threads is not None and args.threads < 1:
        raise ValueError("--threads must be at least 1")
    name = args.model_name or ("default" if args.bundle == "default" else Path(args.bundle).resolve().name)
    config = ServeConfig(model=name, host=args.host, port=args.port, api_key=args.api_key, queue=args.queue)
    serve(args.bundle, config, threads=args.threads, memory_budget=args.memory_budget)


def cmd_doctor(args) -> None:
    text, ok = doctor_report(resolve_bundle(args.bundle) if args.bundle else None, args.strict)
    print(text)
    if args.strict and not ok:
        raise ValueError("a provider the profile names is not in this onnxruntime build (doctor --strict)")


def cmd_tune(args) -> None:
    if args.max_nodes < 1 or args.max_nodes > 64:
        raise ValueError("--max-nodes must be between 1 and 64")
    result = tune(resolve_bundle(args.bundle), Path(args.prompts) if args.prompts else None, args.max_nodes,
                  args.max_new_tokens, args.threads, write=not args.dry_run)
    if args.json:
        print(json.dumps(result))
        return
    print("acceptance by depth (rows) and sibling rank: "
          + "; ".join(f"{d}: {row}" for d, row in enumerate(result["acceptance_by_depth_and_rank"], start=1))
          + f"; draft {result['draft_ms_per_level']} ms per level")
    print("pass ms by node count: " + ", ".join(f"{n}: {ms}" for n, ms in result["pass_ms"].items()))
    print(f"chosen tree: parents {result['tree']['parents']} ({result['tree']['size']} nodes)")
    print(f"  predicted {result['predicted_tokens_per_s']} tokens/s ({result['predicted_tokens_per_pass']} per pass), "
          f"measured {result['measured_tokens_per_s']} ({result['measured_tokens_per_pass']} per pass, "
          f"{result['measured_speedup']}x plain in its run)")
    print(f"best chain: {result['best_chain']['size'] - 1} drafted tokens, predicted "
          f"{result['best_chain_predicted_tokens_per_s']}, measured {result['best_chain_tokens_per_s']} tokens/s "
          f"({result['best_chain_speedup']}x plain in its run); plain {result['plain_tokens_per_s']} tokens/s")
    if len(result["speedup_by_lookup"]) > 1:
        print("speedup over plain by lookup (tokens, /tokens while quoting): "
              + ", ".join(f"{k}: {x}x" for k, x in result["speedup_by_lookup"].items())
              + f"; chosen: {result['lookup']}")
    if result["lookup_tokens"]:
        print(f"with a lookup of {result['lookup_tokens']} tokens trees are costed with those nodes and measured "
              f"with them; predictions count the draft model's tokens only")
    print("written into the bundle" if result["written"] else "not written (--dry-run)")


def cmd_inspect(args) -> None:
    folder = resolve_bundle(args.bundle)
    print_bundle(folder)
    if args.check_exact:
        check_exact(folder)


def cmd_distill(args) -> None:
    from edgespec.distill.run import DistillConfig, distill
    from edgespec.distill.train import TrainConfig

    out = distill(DistillConfig(target=args.target, out=Path(args.out), minutes=args.minutes,
                                corpus=tuple(args.corpus or ()), seed=args.seed, design=args.design,
                                threads=args.threads, resume=args.resume, cache_dir=cache_dir(),
                                data_from=None if args.data is None else Path(args.data).resolve(),
                                init=None if args.init is None else Path(args.init).resolve(),
                                training=TrainConfig(drafting_steps=args.drafting_steps, lr=args.lr)))
    print(f"draft model: {out}  (use it with: edgespec export {args.target} --draft {out} --out BUNDLE)")


def cmd_plan(args) -> None:
    folder = resolve_bundle(args.bundle)
    budget = None if args.memory_budget is None else parse_size(args.memory_budget)
    manifest = open_bundle(folder)
    plan = plan_memory(manifest, folder, budget)
    packed = _packed_disk(manifest, folder) if plan.stage_bytes else None
    if args.json:
        print(json.dumps({**plan.__dict__, "total": plan.total, "packed_copies": packed}))
        return
    print(plan.describe())
    if packed and packed["stages"]:
        written = packed["written_bytes"] / 2**20
        print(f"disk: packed copies of {packed['stages']} float stages for this machine in {packed['folder']}: "
              + (f"{written:.1f} MiB" if packed["missing"] == 0 else
                 f"{packed['missing']} not written yet (each about twice its stage's weights, made on first use)"
                 + (f", {written:.1f} MiB written" if written else "")))


def _packed_disk(manifest, folder) -> dict | None:
    """The packed copies a staged run maps on this machine (Linux), and the disk they take."""

    if not prepacked.available():
        return None
    copies = packed_copies(manifest)
    return {"folder": str(default_prepared_dir() / prepacked.machine_key()), "stages": len(copies),
            "missing": sum(size is None for _, size in copies), "written_bytes": sum(size or 0 for _, size in copies)}


def cmd_demo(args) -> None:
    pipeline = _pipeline(argparse.Namespace(bundle="default", threads=args.threads))
    print(f"> {DEMO_QUESTION}", file=sys.stderr)
    _stream(pipeline, GenerationConfig(max_new_tokens=args.max_new_tokens), True,
            messages=[{"role": "user", "content": DEMO_QUESTION}])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_export, _add_generate, _add_chat, _add_bench, _add_tune, _add_inspect, _add_distill, _add_plan,
                _add_serve, _add_doctor, _add_demo):
        add(sub)
    return parser


def _bundle_arg(p, optional=False):
    if optional:
        p.add_argument("bundle", nargs="?", default="default", help="bundle folder, or 'default'")
    else:
        p.add_argument("bundle", help="bundle folder, or 'default'")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def _budget_arg(p):
    p.add_argument("--memory-budget", default=None,
                   help="at most this much memory for weights, KV caches and scratch (e.g. 300MB, 1.5GiB)")
    p.add_argument("--evict-page-cache", action="store_true",
                   help="drop streamed stages from the OS page cache too when they are released, where the "
                        "memory limit counts the cache (containers, devices without spare memory); slower "
                        "where memory is free")


def _sampling_args(p):
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="the same seed reproduces the same output")


def _generation_args(p, max_new=128):
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--no-speculate", action="store_true", help="plain decoding of the same bundle")
    p.add_argument("--kv-policy", default="error", choices=("error", "sliding"),
                   help="when the context fills the cache: stop with an error (default), or keep 4 attention "
                        "sinks and the most recent tokens (StreamingLLM)")
    _sampling_args(p)


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a target (+ draft) model to a device bundle")
    p.add_argument("model", help="Hugging Face folder, GGUF file, hub id, or 'default'")
    p.add_argument("--draft", required=True,
                   help="draft model (same forms as MODEL), or a training-free drafter: ngram, recycling, ngram+recycling")
    p.add_argument("--out", required=True, help="bundle folder to write")
    p.add_argument("--tree", default=None,
                   help="chain:K, topk:BxD, parents:-1,0,..., auto (measured on this device, as `tune` does) "
                        "or dynamic:N (a draft model grows each step's tree within N nodes). Default: chain:4 "
                        "for a draft model; chain:11 for an n-gram drafter, cut at depth 5 unless the answer "
                        "quotes its context (with int4 weights every node costs: chain:5 is faster there)")
    p.add_argument("--context", type=int, default=2048, help="maximum context in tokens")
    p.add_argument("--profile", default="cpu", help="device profile (targets/)")
    p.add_argument("--prefill-chunk", type=int, default=64, help="tokens per prefill pass")
    p.add_argument("--quant", default="fp32", help="weights: fp32, fp16, int8 or int4 (block-wise)")
    p.add_argument("--draft-quant", default=None, help="the draft's scheme (default: as --quant)")
    p.add_argument("--block", type=int, default=32, help="int4/int8 block size: 16, 32, 64, 128 or 256")
    p.add_argument("--asymmetric", action="store_true",
                   help="int4/int8 with an exact float offset per block (reproduces a Q4_1 GGUF; NPUs need symmetric)")
    p.add_argument("--integer-zero-points", action="store_true",
                   help="int4/int8 asymmetric with MatMulNBits' own integer zero points (its fast kernels)")
    p.add_argument("--integer-matmul", action="store_true",
                   help="int8 computed in integers row by row (MatMulInteger): a one-token step needs no padding row")
    p.add_argument("--accuracy-level", type=int, default=4,
                   help="MatMulNBits activations: 4 = int8 (fast), 1 = fp32")
    p.add_argument("--quant-policy", default=None,
                   help='JSON {"tensors": {"embed_tokens": "int8", "layers.0.*": "fp32"}} for the target')
    p.add_argument("--stages", type=int, default=0,
                   help="also write the target as stages with this many groups of layers, so that a memory budget "
                        "smaller than its weights streams them (0: single graph only)")
    p.add_argument("--lookup", type=int, default=0,
                   help="with a draft model: also draft up to this many tokens by prompt lookup (continuing the "
                        "context where its suffix occurred before), grafted onto the model's tree (0: off)")
    p.add_argument("--lanes", type=int, default=None,
                   help="root-to-leaf paths the target graph verifies in one pass (default: the tree's paths, with "
                        "the lookup chain's; every lane's attention runs on every pass, trees with more are cut)")
    p.add_argument("--lookup-quote", type=int, default=0,
                   help="with a draft model: draft up to this many lookup tokens (more than --lookup, which may be 0) "
                        "where the context's last 4 tokens occurred before, as when the answer quotes its input "
                        "(0: as --lookup)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle")
    p.set_defaults(run=cmd_export)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, streamed")
    _bundle_arg(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _generation_args(p)
    _budget_arg(p)
    p.set_defaults(run=cmd_generate)


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat")
    _bundle_arg(p, optional=True)
    _generation_args(p, max_new=256)
    _budget_arg(p)
    p.set_defaults(run=cmd_chat)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="plain vs speculative decoding in one run")
    _bundle_arg(p)
    p.add_argument("--prompts", help="JSONL file: one object per line with 'messages' or 'prompt'")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the prompts this many times; each round's speedup is printed beside the total's")
    p.add_argument("--json", action="store_true")
    _sampling_args(p)
    _budget_arg(p)
    p.set_defaults(run=cmd_bench)


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="choose the tree for this device from measured acceptance and cost")
    _bundle_arg(p)
    p.add_argument("--prompts", help="calibration prompts (JSONL, as for bench)")
    p.add_argument("--max-nodes", type=int, default=12, help="largest tree considered")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dry-run", action="store_true", help="report, but leave the bundle unchanged")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_tune)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="print a bundle's manifest and verify its checksums")
    p.add_argument("bundle", help="bundle folder, or 'default'")
    p.add_argument("--check-exact", action="store_true",
                   help="also check, on this device, that the target gives every token plain decoding's bits in "
                        "any pass (what makes speculation lossless)")
    p.set_defaults(run=cmd_inspect)


def _add_distill(sub) -> None:
    p = sub.add_parser("distill", help="train a draft model aligned to a target, on this machine's CPU")
    p.add_argument("target", help="Hugging Face folder, GGUF file, hub id, or 'default'")
    p.add_argument("--out", required=True, help="folder for the run and the finished draft (a Hugging Face folder)")
    p.add_argument("--minutes", type=float, default=60.0, help="time budget for data and training together")
    p.add_argument("--corpus", action="append",
                   help="local text or code (file or folder, repeatable) for prompts and teacher forcing; "
                        "default: this Python's standard library")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--design", default="cut", choices=("cut", "small", "eagle"),
                   help="cut: the target's first layers plus a trained adapter layer; small: a new narrow decoder; "
                        "eagle: one layer that also reads the target's final hidden state (the target's graph "
                        "then returns it)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="train on the target data (the `data` folder) of an earlier run instead of making new data; "
                        "--minutes then covers features and training")
    p.add_argument("--init", default=None, metavar="DRAFT_DIR",
                   help="start training from a draft that edgespec distill wrote (same design): its weights and "
                        "its head tokens")
    p.add_argument("--drafting-steps", type=int, default=1,
                   help="eagle design: train each row as the runtime drafts it at steps 1..N, reading the draft's "
                        "own earlier features (deeper chains and trees accept more; each step costs a pass)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the design's)")
    p.set_defaults(run=cmd_distill)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="how a memory budget is split for a bundle, and the context that fits")
    p.add_argument("bundle", help="bundle folder, or 'default'")
    _budget_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_plan)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="a local OpenAI-compatible server (needs the serve extra)")
    _bundle_arg(p, optional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on API requests")
    p.add_argument("--queue", type=int, default=8, help="requests that may wait while one generates; more get 429")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the bundle folder's name, 'default' for the default)")
    p.add_argument("--memory-budget", default=None,
                   help="at most this much memory for weights, KV caches and scratch (e.g. 300MB, 1.5GiB)")
    p.set_defaults(run=cmd_serve)


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="the providers, cores and memory here, and where each profile would run")
    p.add_argument("bundle", nargs="?", default=None, help="also say where this bundle would run")
    p.add_argument("--strict", action="store_true", help="exit 2 if a provider the profile names is missing")
    p.set_defaults(run=cmd_doctor)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="a short chat reply from the default bundle")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.set_defaults(run=cmd_demo)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (EdgespecError, ValueError, OSError) as err:
        if args.debug:
            traceback.print_exc()
        print(f"edgespec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nedgespec: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
