"""The `edgespec` command line."""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from edgespec.bench import load_prompts, one_prompt, print_report, run_bench
from edgespec.calibrate import CALIBRATION_PROMPTS, auto_placement, calibrate, placeable
from edgespec.coreml_backend import coreml_predictor, coreml_refusal, preferred_kv
from edgespec.defaults import resolve_bundle
from edgespec.doctor import report as doctor_report
from edgespec.inspection import check_exact, print_bundle
from edgespec.parser import build_parser
from edgespec.plan_report import cmd_plan
from edgespec.runtime.contract.errors import BudgetError, ContextOverflowError, EdgespecError, InputError
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import CONVERSATION_DEFAULTS, with_defaults
from edgespec.runtime.execution.budget import mib, parse_size
from edgespec.runtime.execution.paths import cache_dir
from edgespec.runtime.execution.placement import Placement, candidates
from edgespec.runtime.pipeline import Pipeline, check_threads, default_threads
from edgespec.tune import export_tuned, tune

DEMO_QUESTION = "What are three good habits for writing clear code? Answer briefly."


def _stats_line(stats) -> str:
    return (f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, "
            f"{stats.mean_accepted_per_pass:.2f} accepted tokens per target pass, "
            f"first token {stats.first_token_s * 1000:.0f} ms]")


def _pipeline(args):
    check_threads(args.threads)  # before --placement auto would calibrate with another count
    backend = getattr(args, "backend", "auto")
    reason = coreml_refusal()  # CoreML runs on macOS only: refused here before anything loads
    if backend == "coreml" and reason is not None:
        raise InputError(reason)
    folder = resolve_bundle(args.bundle)
    profile = getattr(args, "profile", None)
    return Pipeline(folder, args.threads, getattr(args, "memory_budget", None),
                    evict_page_cache=getattr(args, "evict_page_cache", False),
                    placement=_placement(folder, getattr(args, "placement", "profile"), args.threads, profile),
                    profile=profile, context=getattr(args, "context", None), backend=backend,
                    predictor=coreml_predictor if reason is None else None,
                    coreml_kv=preferred_kv() if reason is None else None, spin=getattr(args, "spin", "auto"))


def _placement(folder: Path, mode: str, threads: int | None, profile: str | None) -> Placement | None:
    """--placement: None keeps the profile's providers, one role after the other."""
    if mode == "profile":
        return None
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if mode == "auto":
        return auto_placement(folder, load_prompts(None)[:CALIBRATION_PROMPTS], threads, say, profile)
    manifest = placeable(folder, profile)
    overlapped = [p for p in candidates(manifest.profile, threads or default_threads()) if p.overlap]
    if not overlapped:
        raise InputError("--placement overlapped needs two cores or more (--threads)")
    say(f"placement: {overlapped[0].describe()}")
    return overlapped[0]


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
                        context=args.context, profile=(args.profile or ["cpu"])[0],
                        also_profiles=tuple((args.profile or ["cpu"])[1:]), prefill_chunk=args.prefill_chunk,
                        quant=args.quant, draft_quant=args.draft_quant, block=args.block,
                        symmetric=not (args.asymmetric or args.integer_zero_points),
                        integer_zero_points=args.integer_zero_points, accuracy_level=args.accuracy_level,
                        integer_matmul=args.integer_matmul, gguf_blocks=args.gguf_blocks,
                        quant_policy=Path(args.quant_policy) if args.quant_policy else None,
                        force=args.force, stages=args.stages, lookup=args.lookup, lookup_quote=args.lookup_quote,
                        suffix=args.suffix, lanes=args.lanes, slots=args.slots, cache_dir=cache_dir(),
                        formats=tuple(args.format.split(",")),
                        coreml_kv=tuple(args.coreml_kv.split(",")), coreml_compress=args.coreml_compress)
    if args.tree == "auto":
        export_tuned(config)
    else:
        export(config)


# the settings' names as the command line spells them, for errors raised by the configs themselves
FLAGS = {name: "--" + name.replace("_", "-") for name in ("max_new_tokens", "top_p", "top_k", "min_p", "temperature",
                                                           "repetition_penalty", "frequency_penalty",
                                                           "presence_penalty", "seed", "kv_policy")}
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty", "seed")


def _as_flags(err: ValueError) -> InputError:
    message = str(err)
    for name, flag in FLAGS.items():
        message = message.replace(name, flag)
    return InputError(message)


def _sampling_config(args, defaults: dict | None = None):
    """The flags given, the others from `defaults` (a conversation's: Pipeline.sampling_defaults); none: greedy."""
    try:
        return with_defaults({name: getattr(args, name) for name in SAMPLING_FLAGS}, defaults or {})
    except ValueError as err:
        raise _as_flags(err) from None


def _generation_config(args, defaults: dict | None = None):
    constraint = _constraint(args)
    try:
        return GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop or ()),
                                sampling=_sampling_config(args, defaults), kv_policy=args.kv_policy,
                                constraint=constraint)
    except ValueError as err:
        raise _as_flags(err) from None


def _conversation_config(args, pipeline, config):
    """`config` with the model's own sampling defaults (checked before loading with llama.cpp's)."""
    return replace(config, sampling=_sampling_config(args, pipeline.sampling_defaults))


def _constraint(args) -> ConstraintSpec | None:
    """--json-schema FILE, --json-object, --regex, --choice or --grammar FILE as a ConstraintSpec (None: free text)."""
    if args.regex is not None:
        return ConstraintSpec.regex(args.regex)
    if args.choice:
        return ConstraintSpec.choice(args.choice)
    if args.json_object:
        return ConstraintSpec.json_object()
    for flag, path, make in (("--json-schema", args.json_schema, ConstraintSpec.json_schema),
                             ("--grammar", args.grammar, ConstraintSpec.grammar)):
        if path is not None:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise InputError(f"{flag} {path}: cannot read it ({err})") from err
            try:
                return make(text)
            except InputError as err:
                raise InputError(f"{flag} {path}: {err}") from err
    return None


def _result_json(result) -> dict:
    return {"text": result.text, "token_ids": result.token_ids, "stop_reason": result.stop_reason,
            "stats": result.stats.to_dict()}


def cmd_generate(args) -> None:
    config = _generation_config(args, CONVERSATION_DEFAULTS if args.chat else None)  # before minutes of loading
    pipeline = _pipeline(args)
    if args.chat:
        config = _conversation_config(args, pipeline, config)
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
    config = _generation_config(args, CONVERSATION_DEFAULTS)
    pipeline = _pipeline(args)
    config = _conversation_config(args, pipeline, config)
    if config.constraint is not None and config.close_within_budget:  # up front, not at the first turn
        pipeline.grammars.within(config.constraint, config.max_new_tokens)
    session = pipeline.new_session(not args.no_speculate)
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
            result = pipeline.generate(messages=messages, config=config, session=session,
                                       on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
        except EdgespecError as err:
            messages.pop()  # the conversation goes on without the turn that failed
            print(f"\nedgespec: {err}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        print(_stats_line(result.stats), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})


def cmd_bench(args) -> None:
    if args.max_new_tokens < 1:
        raise InputError("--max-new-tokens must be at least 1")
    prompts = None if args.prompt is not None else load_prompts(Path(args.prompts) if args.prompts else None)
    if args.prompt is not None:
        one_prompt(args.prompt, chat=False)  # an empty one refused before minutes of loading
    if args.rounds < 1:
        raise InputError("--rounds must be at least 1")
    sampling = _sampling_config(args)
    constraint = _constraint(args)
    if constraint is not None and args.schema_in_prompt:
        raise InputError("--schema-in-prompt takes each prompt's schema: give no other constraint with it")
    pipeline = _pipeline(args)
    if prompts is None:  # a chat message where the bundle has a chat template, as generate --chat sends it
        prompts = [one_prompt(args.prompt, pipeline.codec.has_chat_template)]
    report = run_bench(pipeline, prompts, args.max_new_tokens, sampling, args.rounds, constraint,
                       args.schema_in_prompt, plain_only=args.plain_only)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)


def cmd_serve(args) -> None:
    try:
        from edgespec.serve import ServeConfig, serve
    except ImportError as err:
        raise InputError(f"edgespec serve needs the serve extra (pip install 'edgespec[serve]'): {err}") from err
    name = args.model_name or ("default" if args.bundle == "default" else Path(args.bundle).resolve().name)
    try:
        max_body = parse_size(args.max_body)
    except BudgetError as err:
        raise InputError(f"--max-body {args.max_body!r}: give bytes or a size like 4MiB") from err
    config = ServeConfig(model=name, host=args.host, port=args.port, api_keys=tuple(args.api_key), queue=args.queue,
                         interleave=args.interleave, kept_conversations=args.kept_conversations,
                         max_body_bytes=max_body, shared_speculation=args.shared_speculation,
                         shared_prefill=args.shared_prefill)
    serve(_pipeline(args), config)


def cmd_doctor(args) -> None:
    text, ok = doctor_report(resolve_bundle(args.bundle) if args.bundle else None, args.strict)
    print(text)
    if args.strict and not ok:
        raise InputError("a provider the profile names is not in this onnxruntime build (doctor --strict)")


def cmd_calibrate(args) -> None:
    folder = resolve_bundle(args.bundle)
    prompts = load_prompts(Path(args.prompts) if args.prompts else None)
    if args.max_new_tokens < 8:
        raise InputError("--max-new-tokens must be at least 8 to measure decoding")
    say = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr))  # noqa: E731
    result = calibrate(folder, prompts if args.prompts else prompts[:CALIBRATION_PROMPTS], args.threads,
                       args.max_new_tokens, say, args.profile)
    print(json.dumps({**result.to_dict(), "chosen": result.chosen.placement.to_dict()}, indent=1) if args.json
          else result.report())


def cmd_tune(args) -> None:
    if args.max_nodes < 1 or args.max_nodes > 64:
        raise InputError("--max-nodes must be between 1 and 64")
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


def cmd_stage(args) -> None:
    from edgespec.exporters.export import progress
    from edgespec.exporters.restage import restage

    folder = Path(args.bundle)
    manifest = restage(folder, args.stages, progress())
    written = sum((folder / name).stat().st_size for stage in manifest.target.stages for name in stage.weights)
    print(f"{folder}: {len(manifest.target.stages)} stages, {mib(written)} of weights in their files")


def cmd_distill(args) -> None:
    from edgespec.distill.data import DataConfig
    from edgespec.distill.run import DistillConfig, distill
    from edgespec.distill.train import TrainConfig

    out = distill(DistillConfig(target=args.target, out=Path(args.out), minutes=args.minutes,
                                corpus=tuple(args.corpus or ()), seed=args.seed, design=args.design,
                                threads=args.threads, resume=args.resume, cache_dir=cache_dir(),
                                data_from=None if args.data is None else Path(args.data).resolve(),
                                init=None if args.init is None else Path(args.init).resolve(),
                                engine=args.data_engine, data_quant=args.data_quant, device=args.device,
                                prompts=args.prompts, data=DataConfig(batch=args.slots),
                                training=TrainConfig(drafting_steps=args.drafting_steps, lr=args.lr,
                                                     batch=args.train_batch)))
    print(f"draft model: {out}  (use it with: edgespec export {args.target} --draft {out} --out BUNDLE)")


def cmd_demo(args) -> None:
    pipeline = _pipeline(argparse.Namespace(bundle="default", threads=args.threads))
    print(f"> {DEMO_QUESTION}", file=sys.stderr)
    _stream(pipeline, GenerationConfig(max_new_tokens=args.max_new_tokens), True,
            messages=[{"role": "user", "content": DEMO_QUESTION}])


# what each command of the grammar (parser.py) does
COMMANDS = {"export": cmd_export, "generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "tune": cmd_tune,
            "inspect": cmd_inspect, "stage": cmd_stage, "distill": cmd_distill, "plan": cmd_plan, "serve": cmd_serve,
            "doctor": cmd_doctor,
            "calibrate": cmd_calibrate, "demo": cmd_demo}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (EdgespecError, OSError) as err:  # the user's input, or what the system refused (a disk, a port)
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
