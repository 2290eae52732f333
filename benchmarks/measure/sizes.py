"""The models people run, at their sizes: random-weight bodies of Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B, exported by edgespec and by onnxruntime-genai's model builder, each in a process of its own.

    python benchmarks/measure/sizes.py body --size 1b --out DIR        # a bf16 safetensors folder, a tensor at a time
    python benchmarks/measure/sizes.py export --size 1b --work DIR [--genai] [--edgespec-args "--quant int4"]
    python benchmarks/measure/sizes.py decode --work DIR --size 1b [--rounds 3] [--max-new-tokens 64]
    python benchmarks/measure/sizes.py rows --work DIR --size 1b [--past 256] [--rounds 5]
    python benchmarks/measure/sizes.py budget --work DIR --size 3b [--fraction 0.5] [--stages 8]

`body` writes the checkpoint without ever holding it: random values (normal, std 0.02; norms 1) in bf16,
shards of at most 2 GB with their index, the config of the named body with the reference model's
49,152-token vocabulary and its tokenizer (speed and memory do not depend on the values). `export` runs
`edgespec export BODY --draft ngram` (and with --genai, genai's builder at int4 on the same folder),
each as a child process whose peak RSS is read from the kernel (wait4), and prints wall time, peak RSS
and bytes on disk beside the checkpoint's bytes. `decode` alternates plain greedy decoding of the
edgespec bundle and of genai's int4 export in one process, round by round (one prompt, tokens/s after
the first token), and prints the ratio per round and its median. `rows` times the edgespec bundle's target
pass at 1..16 rows after --past tokens (each row count in turn, every round) and prints t(rows)/t(1).
`budget` exports the body again with --stages, then runs `edgespec bench --plain-only` on it resident and
under a budget of --fraction of its weights' bytes, each a child process whose peak RSS the kernel reports,
alternating; it prints tokens/s, their ratio and peak RSS against the budget.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BODIES = {  # Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B: their shapes, the reference model's vocabulary
    "1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0),
    "3b": dict(num_hidden_layers=28, hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, tie_word_embeddings=False, rope_theta=500000.0),
}
VOCAB = 49152
SHARD_BYTES = 2 << 30
PROMPT = "Write a short story about a robot who learns to paint, in five sentences."


def tensors_of(body: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, inter = body["hidden_size"], body["intermediate_size"]
    head_dim = h // body["num_attention_heads"]
    kv = body["num_key_value_heads"] * head_dim
    out = [("model.embed_tokens.weight", (VOCAB, h))]
    for i in range(body["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    out.append(("model.norm.weight", (h,)))
    if not body["tie_word_embeddings"]:
        out.append(("lm_head.weight", (VOCAB, h)))
    return out


def bf16_random(shape, rng) -> bytes:
    if len(shape) == 1:
        values = np.ones(shape, np.float32)
    else:
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def write_shards(out: Path, tensors, rng) -> None:
    """safetensors files written a tensor at a time (the format: an 8-byte header size, a JSON header, the data)."""
    shards, current, size = [], [], 0
    for name, shape in tensors:
        nbytes = 2 * int(np.prod(shape))
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape, nbytes))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name, shape, _ in shard:
                f.write(bf16_random(shape, rng))
    total = sum(2 * int(np.prod(s)) for _, s in tensors)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))


def make_body(size: str, out: Path, tokenizer_from: Path | None = None) -> Path:
    """`tokenizer_from`: a folder whose tokenizer to copy (a machine without the package index), else the
    reference model's, from its GGUF."""
    from transformers import AutoTokenizer

    body = BODIES[size]
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    else:
        from edgespec.exporters.sources import fetch_default_gguf
        from edgespec.runtime.execution.paths import cache_dir

        gguf = fetch_default_gguf(cache_dir())
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB,
                  head_dim=body["hidden_size"] // body["num_attention_heads"], max_position_embeddings=8192,
                  rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                  rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}, **body)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    write_shards(out, tensors_of(body), np.random.default_rng(0))
    print(f"wrote {size} body ({sum(np.prod(s) for _, s in tensors_of(body)) / 1e9:.2f}B parameters) to {out}",
          file=sys.stderr)
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def run_measured(command: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in GiB, exit code) of `command` as a child process."""
    started = time.perf_counter()
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - started, usage.ru_maxrss / 2**20, os.waitstatus_to_exitcode(status)


def export(args) -> None:
    work = Path(args.work)
    body = work / f"body-{args.size}"
    if not (body / "config.json").is_file():
        make_body(args.size, body, args.tokenizer)
    checkpoint = folder_bytes(body)
    rows = []
    bundle = work / f"edgespec-{args.size}"
    command = [str(Path(sys.executable).parent / "edgespec"), "export", str(body), "--draft", "ngram", "--out", str(bundle),
               "--force", *shlex.split(args.edgespec_args)]
    wall, peak, code = run_measured(command)
    rows.append(("edgespec " + args.edgespec_args, wall, peak, code, folder_bytes(bundle) if code == 0 else 0))
    if args.genai:
        genai = work / f"genai-{args.size}-int4"
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(body), "-o", str(genai),
                   "-p", "int4", "-e", "cpu", "-c", str(work / "genai-cache")]
        wall, peak, code = run_measured(command)
        rows.append(("onnxruntime-genai builder -p int4", wall, peak, code, folder_bytes(genai) if code == 0 else 0))
    print(f"\n{args.size} body: checkpoint {checkpoint / 2**30:.2f} GiB")
    print(f"{'exporter':44s} {'wall s':>8s} {'peak GiB':>9s} {'x ckpt':>7s} {'bundle GiB':>10s} exit")
    for name, wall, peak, code, size in rows:
        print(f"{name:44s} {wall:8.1f} {peak:9.2f} {peak * 2**30 / checkpoint:7.2f} {size / 2**30:10.2f} {code}")


def decode(args) -> None:
    """Plain greedy decoding of both exports, alternating in this one process."""
    import onnxruntime_genai as og
    from edgespec import GenerationConfig, load

    work = Path(args.work)
    pipe = load(str(work / f"edgespec-{args.size}"), threads=args.threads)
    messages = [{"role": "user", "content": PROMPT}]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    genai_model = og.Model(str(work / f"genai-{args.size}-int4"))
    tokenizer = og.Tokenizer(genai_model)
    prompt_ids = pipe.codec.encode_chat(messages)

    def genai_rate() -> float:
        params = og.GeneratorParams(genai_model)
        params.set_search_options(do_sample=False, max_length=len(prompt_ids) + args.max_new_tokens)
        generator = og.Generator(genai_model, params)
        generator.append_tokens(prompt_ids)
        first, count = None, 0
        while not generator.is_done() and count < args.max_new_tokens:
            generator.generate_next_token()
            count += 1
            if first is None:
                first = time.perf_counter()
        return (count - 1) / (time.perf_counter() - first)

    def edgespec_rate() -> float:
        result = pipe.generate(ids=prompt_ids, config=config, speculate=False)
        return result.stats.tokens_per_s

    del tokenizer
    ratios = []
    for r in range(args.rounds):
        ours, theirs = edgespec_rate(), genai_rate()
        ratios.append(ours / theirs)
        print(f"round {r + 1}: edgespec plain {ours:.2f} tokens/s, genai int4 greedy {theirs:.2f}, ratio {ours / theirs:.3f}")
    print(f"median ratio {statistics.median(ratios):.3f} over {args.rounds} rounds")


def rows(args) -> None:
    """t(rows) / t(1) of the bundle's target pass, chains of 1..16 rows after `--past` tokens."""
    from edgespec.runtime.contract.manifest import read_manifest
    from edgespec.runtime.execution.model import ModelRunner
    from edgespec.runtime.execution.sessions import make_session

    bundle = Path(args.work) / f"edgespec-{args.size}"
    manifest = read_manifest(bundle)
    runner = ModelRunner(make_session(bundle / manifest.target.graph.file, ("CPUExecutionProvider",),
                                      args.threads or os.cpu_count()), manifest.target.facts)
    counts = list(range(1, 17))
    cache = runner.new_cache(args.past + 32)
    past = [int(t) for t in np.random.default_rng(0).integers(3, manifest.target.facts.vocab_size, args.past + 16)]
    for start in range(0, args.past, 64):
        n = min(64, args.past - start)
        runner.forward(cache, past[start : start + n], range(start, start + n), np.tril(np.ones((n, n), bool)), [n - 1])
        cache.commit(0, n)
    times = {n: [] for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            started = time.perf_counter()
            runner.forward(cache, past[args.past : args.past + n], range(args.past, args.past + n),
                           np.tril(np.ones((n, n), bool)), range(n))
            times[n].append(time.perf_counter() - started)
    base = statistics.median(times[1])
    print(f"{args.size} target, {args.past} tokens of past, median of {args.rounds} rounds: t(1) = {base * 1e3:.1f} ms")
    print("rows    " + " ".join(f"{n:5d}" for n in counts))
    print("t/t(1)  " + " ".join(f"{statistics.median(times[n]) / base:5.2f}" for n in counts))


def budget(args) -> None:
    """Plain decoding of a staged export resident and under a budget of `--fraction` of its weights."""

    work = Path(args.work)
    body, staged = work / f"body-{args.size}", work / f"edgespec-{args.size}-stages{args.stages}"
    edgespec = str(Path(sys.executable).parent / "edgespec")
    if not (staged / "manifest.json").is_file():
        subprocess.run([edgespec, "export", str(body), "--draft", "ngram", "--out", str(staged), "--force",
                        "--stages", str(args.stages)], check=True)
    manifest = json.loads((staged / "manifest.json").read_text())
    weights = sum((staged / f).stat().st_size for f in manifest["target"]["graph"]["weights"])
    limit = int(weights * args.fraction)
    runs = {"resident": [], "budget": []}
    for _ in range(args.rounds):
        for name, extra in (("resident", []), ("budget", ["--memory-budget", str(limit)])):
            out = work / f"bench-{name}.json"
            command = [edgespec, "bench", str(staged), "--plain-only", "--prompt", PROMPT, "--max-new-tokens",
                       str(args.max_new_tokens), "--json", *extra]
            with open(out, "w") as sink:
                started = time.perf_counter()
                child = subprocess.Popen(command, stdout=sink)
                _, status, usage = os.wait4(child.pid, 0)
            if os.waitstatus_to_exitcode(status):
                raise SystemExit(f"{' '.join(command)} failed")
            result = json.loads(out.read_text())
            runs[name].append((result["plain"]["tokens_per_s"], usage.ru_maxrss * 1024, time.perf_counter() - started))
    resident = statistics.median(r[0] for r in runs["resident"])
    budgeted = statistics.median(r[0] for r in runs["budget"])
    peak = max(r[1] for r in runs["budget"])
    print(f"{args.size} int4, {args.stages} stages, weights {weights / 2**20:.0f} MiB, budget {limit / 2**20:.0f} MiB "
          f"({args.fraction:.0%} of the weights)")
    print(f"plain resident {resident:.2f} tokens/s (peak {max(r[1] for r in runs['resident']) / 2**20:.0f} MiB); "
          f"under the budget {budgeted:.2f} tokens/s = {budgeted / resident:.2f} of resident; "
          f"peak RSS {peak / 2**20:.0f} MiB = {peak / limit:.2f} of the budget")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("body", help="write a random-weight body")
    b.add_argument("--size", choices=BODIES, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--tokenizer", type=Path, default=None, help="copy the tokenizer from this folder")

    def mode(name: str, text: str, **numbers) -> argparse.ArgumentParser:
        """A subcommand on a body size and a work folder, with its own numeric options and their defaults."""
        p = sub.add_parser(name, help=text)
        p.add_argument("--size", choices=BODIES, required=True)
        p.add_argument("--work", type=Path, required=True, help="folder for the body and the exports")
        for option, default in numbers.items():
            p.add_argument(f"--{option.replace('_', '-')}", type=type(default) if default is not None else int,
                           default=default)
        return p

    e = mode("export", "export a body with edgespec (and genai's builder)")
    e.add_argument("--genai", action="store_true", help="also genai's builder at int4")
    e.add_argument("--edgespec-args", default="", help="more options for edgespec export, quoted")
    e.add_argument("--tokenizer", type=Path, default=None, help="copy the body's tokenizer from this folder")
    mode("decode", "plain greedy decoding of both exports, alternating", rounds=3, max_new_tokens=64, threads=None)
    mode("rows", "t(rows)/t(1) of the bundle's target pass", past=256, rounds=5, threads=None)
    mode("budget", "plain decoding of a staged export resident and under a budget", fraction=0.5, stages=8,
         rounds=2, max_new_tokens=32)
    args = parser.parse_args()
    if args.command == "body":
        make_body(args.size, args.out, args.tokenizer)
    else:
        {"export": export, "decode": decode, "rows": rows, "budget": budget}[args.command](args)


if __name__ == "__main__":
    main()
