"""The command line's grammar: every command and its options. What each command does is in cli.py."""
from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgespec", description="The `edgespec` command line.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_export, _add_generate, _add_chat, _add_bench, _add_tune, _add_inspect, _add_stage, _add_distill,
                _add_plan, _add_serve, _add_doctor, _add_calibrate, _add_demo):
        add(sub)
    return parser


def _bundle_arg(p, optional=False):
    if optional:
        p.add_argument("bundle", nargs="?", default="default", help="bundle folder, or 'default'")
    else:
        p.add_argument("bundle", help="bundle folder, or 'default'")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def _spin_arg(p):
    p.add_argument("--spin", default="auto", choices=("auto", "on", "off"),
                   help="whether onnxruntime's threads spin between a pass's operators: off on a CPU other "
                        "processes keep busy; on; auto (default: the target and the draft spin, the draft not "
                        "beside a streamed target). docs/profiles.md")


def _budget_arg(p):
    p.add_argument("--memory-budget", default=None,
                   help="at most this much memory for weights, KV caches and scratch (e.g. 300MB, 1.5GiB)")
    p.add_argument("--evict-page-cache", action="store_true",
                   help="drop streamed stages from the OS page cache too when they are released, where the "
                        "memory limit counts the cache (containers, devices without spare memory); slower "
                        "where memory is free")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="under a memory budget, the fewest tokens of context the caches must hold (default: 1024, "
                        "or the most the budget holds): the budget beyond it goes to speed (stages kept resident), "
                        "the context gets what is left; a request that needs more gets another split that holds it")


def _backend_arg(p):
    p.add_argument("--backend", default="auto", choices=("auto", "onnx", "coreml"),
                   help="coreml: the bundle's CoreML packages on macOS (exported with --format onnx,coreml), through "
                        "the same decoding as onnx; auto (default): coreml for a bundle of the apple profile where "
                        "CoreML runs, else onnx")


def _placement_arg(p):
    p.add_argument("--placement", default="profile", choices=("profile", "auto", "overlapped"),
                   help="where the draft and the target run: profile (default: the bundle profile's first provider "
                        "for each role, one after the other on every core); auto (what `edgespec calibrate` measured "
                        "fastest here, measured first if not cached); overlapped (the draft drafts the next tree "
                        "while the target verifies, the cores split between them)")
    p.add_argument("--profile", default=None,
                   help="which of the bundle's device profiles to run: its providers and graphs (default: the first)")


def _sampling_args(p):
    # unset: greedy for generate and bench; chat and generate --chat take the model's generation_config,
    # else llama.cpp's defaults (docs/cli.md, "Sampling defaults")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: greedy, but for chat)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="CTRL-style penalty on tokens already in the context (sampling: needs --temperature > 0)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtracted from a token's logit per time it is in the output (-2..2; sampling)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="subtracted from a token's logit once it is in the output (-2..2; sampling)")
    p.add_argument("--seed", type=int, default=None, help="the same seed reproduces the same output")


def _generation_args(p, max_new=128):
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--no-speculate", action="store_true", help="plain decoding of the same bundle")
    p.add_argument("--kv-policy", default="error", choices=("error", "sliding"),
                   help="when the context fills the cache: stop with an error (default), or keep 4 attention "
                        "sinks and the most recent tokens (StreamingLLM)")
    _sampling_args(p)
    _constraint_args(p)


def _constraint_args(p):
    constrain = p.add_mutually_exclusive_group()  # constrained decoding: the output matches one of these
    constrain.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this JSON schema")
    constrain.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constrain.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    constrain.add_argument("--choice", action="append", metavar="TEXT",
                           help="the output is one of these strings (repeat the flag for each)")
    constrain.add_argument("--grammar", metavar="FILE", help="the output matches this Lark grammar (its rule `start`)")


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a target (+ draft) model to a device bundle")
    p.add_argument("model", help="Hugging Face folder, GGUF file, hub id, or 'default'")
    p.add_argument("--draft", required=True,
                   help="draft model (same forms as MODEL), or a training-free drafter: ngram, recycling, ngram+recycling, "
                        "suffix (suffix drafting alone, as --suffix)")
    p.add_argument("--out", required=True, help="bundle folder to write")
    p.add_argument("--tree", default=None,
                   help="chain:K, topk:BxD, parents:-1,0,..., auto (measured on this device, as `tune` does) "
                        "or dynamic:N (a draft model grows each step's tree within N nodes). Default: chain:4 "
                        "for a draft model; chain:11 for an n-gram drafter, cut unless the context's last tokens "
                        "occurred before (at depth 5; at depth 1 with int4/int8 weights, where every node costs)")
    p.add_argument("--context", type=int, default=2048, help="maximum context in tokens")
    p.add_argument("--profile", action="append", default=None,
                   help="device profile (targets/; default cpu); repeat it for one bundle that serves several: "
                        "profiles that need other shapes (static for NPUs) get graphs of their own")
    p.add_argument("--prefill-chunk", type=int, default=64, help="tokens per prefill pass")
    p.add_argument("--quant", default="int4",
                   help="weights: int4 (the default: what a 1B-8B model runs in on a laptop), int8, fp16 or fp32")
    p.add_argument("--draft-quant", default=None, help="the draft's scheme (default: as --quant)")
    p.add_argument("--block", type=int, default=32, help="int4/int8 block size: 16, 32, 64, 128 or 256")
    p.add_argument("--asymmetric", action="store_true",
                   help="int4/int8 with an exact float offset per block (reproduces a Q4_1 GGUF; NPUs need symmetric)")
    p.add_argument("--integer-zero-points", action="store_true",
                   help="int4/int8 asymmetric with MatMulNBits' own integer zero points (its fast kernels)")
    p.add_argument("--integer-matmul", action="store_true",
                   help="int8 computed in integers row by row (MatMulInteger): a one-token step needs no padding row")
    p.add_argument("--gguf-blocks", action="store_true",
                   help="a GGUF target: keep its Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks as they are (--quant applies "
                        "to the rest)")
    p.add_argument("--accuracy-level", type=int, default=4,
                   help="MatMulNBits activations: 4 = int8 (fast), 1 = fp32")
    p.add_argument("--quant-policy", default=None,
                   help='JSON {"tensors": {"lm_head": "int8", "layers.0.*": "fp32"}} for the target')
    p.add_argument("--stages", type=int, default=0,
                   help="also write the target as stages with this many groups of layers, so that a memory budget "
                        "smaller than its weights streams them (0: single graph only)")
    p.add_argument("--lookup", type=int, default=0,
                   help="with a draft model: also draft up to this many tokens by prompt lookup (continuing the "
                        "context where its suffix occurred before), grafted onto the model's tree (0: off)")
    p.add_argument("--slots", type=int, default=0,
                   help="also write the target as a slots graph of this many conversations per pass: `serve` then "
                        "shares the target passes of the requests in flight, each with its bits alone (0: none)")
    p.add_argument("--lanes", type=int, default=None,
                   help="root-to-leaf paths the target graph verifies in one pass (default: the tree's paths, with "
                        "the lookup chain's; every lane's attention runs on every pass, trees with more are cut)")
    p.add_argument("--suffix", action="store_true",
                   help="suffix drafting beside the drafter: continuations of the longest earlier occurrence of the "
                        "context's suffix, in the conversation and in earlier outputs, and each step's tree (down to "
                        "a plain step) chosen from the measured pass costs and acceptance (replaces --lookup)")
    p.add_argument("--lookup-quote", type=int, default=0,
                   help="with a draft model: draft up to this many lookup tokens (more than --lookup, which may be 0) "
                        "where the context's last 4 tokens occurred before, as when the answer quotes its input "
                        "(0: as --lookup)")
    p.add_argument("--format", default="onnx",
                   help="onnx, or onnx,coreml: also CoreML packages for Apple devices (static shapes, fp16, KV "
                        "caches as states; needs the [coreml] extra)")
    p.add_argument("--coreml-kv", default="state,io",
                   help="CoreML KV caches: state (iOS 18 / macOS 15), io (passed in and out, older systems), or both")
    p.add_argument("--coreml-compress", default="int8",
                   help="CoreML weights: fp16, int8 (affine, per block of 32; per channel in the io fallback), int4 "
                        "(affine, per block of 32; iOS 18) or palette4 (16 values per 16 channels; iOS 18)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, streamed")
    _bundle_arg(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _generation_args(p)
    _backend_arg(p)
    _placement_arg(p)
    _spin_arg(p)
    _budget_arg(p)


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat")
    _bundle_arg(p, optional=True)
    _generation_args(p, max_new=256)
    _backend_arg(p)
    _placement_arg(p)
    _spin_arg(p)
    _budget_arg(p)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="plain vs speculative decoding in one run")
    _bundle_arg(p)
    asked = p.add_mutually_exclusive_group()
    asked.add_argument("--prompts", help="JSONL file: one object per line with 'messages' or 'prompt'")
    asked.add_argument("--prompt", metavar="TEXT",
                       help="one prompt instead of the prompts file: a user message where the bundle has a chat "
                            "template (as generate --prompt --chat), else plain text")
    p.add_argument("--plain-only", action="store_true",
                   help="plain decoding alone: no speculative runs, no speedup")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the prompts this many times; each round's speedup is printed beside the total's")
    p.add_argument("--json", action="store_true")
    _sampling_args(p)
    _constraint_args(p)
    p.add_argument("--schema-in-prompt", action="store_true",
                   help="each output must match the JSON schema its prompt states after 'Schema:' (strict), as in "
                        "benchmarks/workloads/extraction.jsonl")
    _backend_arg(p)
    _placement_arg(p)
    _spin_arg(p)
    _budget_arg(p)


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="choose the tree for this device from measured acceptance and cost")
    _bundle_arg(p)
    p.add_argument("--prompts", help="calibration prompts (JSONL, as for bench)")
    p.add_argument("--max-nodes", type=int, default=12, help="largest tree considered")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dry-run", action="store_true", help="report, but leave the bundle unchanged")
    p.add_argument("--json", action="store_true")


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="print a bundle's manifest and verify its checksums")
    p.add_argument("bundle", help="bundle folder, or 'default'")
    p.add_argument("--check-exact", action="store_true",
                   help="also check, on this device, that the target gives every token plain decoding's bits in "
                        "any pass (what makes speculation lossless)")


def _add_stage(sub) -> None:
    p = sub.add_parser("stage", help="cut an exported bundle's target into stages (for memory budgets), in place")
    p.add_argument("bundle", help="bundle folder")
    p.add_argument("--stages", type=int, required=True,
                   help="groups of layers (as export --stages); 0 removes the stages. Each weight stays stored once")


def _add_distill(sub) -> None:
    p = sub.add_parser("distill", help="train a draft model aligned to a target, on this machine's CPU")
    p.add_argument("target", help="Hugging Face folder, GGUF file, hub id, or 'default'")
    p.add_argument("--out", required=True, help="folder for the run and the finished draft (a Hugging Face folder)")
    p.add_argument("--minutes", type=float, default=60.0, help="time budget for data and training together")
    p.add_argument("--corpus", action="append",
                   help="local text or code (file or folder, repeatable) for prompts and teacher forcing; "
                        "default: this Python's standard library")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--design", default="cut", choices=("cut", "small", "eagle", "eagle3"),
                   help="cut: the target's first layers plus a trained adapter layer; small: a new narrow decoder; "
                        "eagle: one layer that also reads the target's final hidden state (the target's graph "
                        "then returns it); eagle3: a head in the published EAGLE-3 layout over three of the "
                        "target's layers (SGLang, vLLM and `export --draft` read it)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="train on the target data (the `data` folder) of an earlier run instead of making new data; "
                        "--minutes then covers features and training")
    p.add_argument("--init", default=None, metavar="DRAFT_DIR",
                   help="start training from a draft that edgespec distill wrote (same design): its weights and "
                        "its head tokens")
    p.add_argument("--drafting-steps", type=int, default=1,
                   help="eagle and eagle3 designs: train each row as the runtime drafts it at steps 1..N, reading "
                        "the draft's own earlier features (deeper chains and trees accept more; each step costs a pass)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the design's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where torch trains the draft (and makes the data with --data-engine torch)")
    p.add_argument("--data-engine", default=None, choices=("onnx", "torch"),
                   help="what answers the prompts and gives the target's features: onnx runs the target as a "
                        "bundle does (quantized, onnxruntime's CPU kernels, many answers per pass); torch runs "
                        "the float model with transformers on --device. Default: onnx on the CPU, torch on cuda")
    p.add_argument("--data-quant", default="int4", choices=("int4", "int8", "fp32"),
                   help="the onnx engine's weights: int4 is the default bundle's (exact offsets, int8 head); "
                        "match the bundle the draft will ship in")
    p.add_argument("--slots", type=int, default=32,
                   help="answers made at once (the onnx engine's sequences per pass, torch's batch)")
    p.add_argument("--prompts", type=int, default=6000,
                   help="training prompts composed for target answers (a GPU answers tens of thousands in minutes)")
    p.add_argument("--train-batch", type=int, default=16,
                   help="training windows per step (a GPU takes 64 or more)")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="how a memory budget is split for a bundle, and the context that fits")
    _bundle_arg(p)  # --threads: the stages' costs a run on that many threads measured
    _budget_arg(p)
    p.add_argument("--json", action="store_true")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="a local OpenAI-compatible server (needs the serve extra)")
    _bundle_arg(p, optional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on API requests; repeat it for several clients, "
                        "each with a conversation of its own")
    p.add_argument("--queue", type=int, default=8,
                   help="requests that may wait beside those in flight; more get 429")
    p.add_argument("--interleave", type=int, default=4, metavar="N",
                   help="generations in flight at once, taking target passes in turn, so a new request's first "
                        "token waits one pass of each, not their ends (default 4; 1: one after another; "
                        "with --memory-budget, as many as fit)")
    p.add_argument("--kept-conversations", type=int, default=4, metavar="N",
                   help="clients whose conversation (its KV caches) is kept for follow-ups (default 4; 0: none)")
    p.add_argument("--shared-speculation", choices=("alone", "batch"), default="alone",
                   help="with a slots graph (export --slots): 'alone' (default) prices each step's tree as if "
                        "its conversation ran alone; 'batch' prices a greedy step's tree against the whole "
                        "shared pass, at the slots passes' timed seconds (not the default: benchmarks/history.md §68, §70)")
    p.add_argument("--shared-prefill", choices=("apart", "together"), default="apart",
                   help="with a slots graph: a new prompt's prefill chunks run back to back alone ('apart', "
                        "default: first tokens sooner, benchmarks/history.md §68) or ride in the shared passes "
                        "('together')")
    p.add_argument("--max-body", default="4MiB", metavar="SIZE",
                   help="the largest request body accepted, e.g. 4MiB (default); a larger one gets 413")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the bundle folder's name, 'default' for the default)")
    p.add_argument("--memory-budget", default=None,
                   help="at most this much memory for weights, KV caches and scratch (e.g. 300MB, 1.5GiB)")
    _backend_arg(p)
    _placement_arg(p)
    _spin_arg(p)


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="the providers, cores and memory here, and where each profile would run")
    p.add_argument("bundle", nargs="?", default=None, help="also say where this bundle would run")
    p.add_argument("--strict", action="store_true", help="exit 2 if a provider the profile names is missing")


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure where the draft and the target run fastest here; cached per device and bundle")
    _bundle_arg(p, optional=True)
    p.add_argument("--prompts", help="JSONL file of calibration prompts (default: three built-in ones)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--profile", default=None,
                   help="which of the bundle's device profiles to place (default: the first it was exported for)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="a short chat reply from the default bundle")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=96)
