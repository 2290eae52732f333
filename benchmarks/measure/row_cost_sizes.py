"""t(rows) / t(1) of a verify pass for targets shaped like larger models, with random int4 weights, and
the speculative speedup those curves imply (a projection, not a measurement of decoding).

    python benchmarks/measure/row_cost_sizes.py [--graphs SIZE:LAYERS,...]  (default: the 1.5B at 2, 8, 14 layers, the 3B at 1, 5)
        [--reference default] [--rows 1-16] [--past 256] [--rounds 8] [--threads 2] [--workdir DIR]
        [--profile 1,8] [--json FILE]

1. Export, one graph at a time (SIZE:LAYERS; LAYERS below the model's own keeps that many of its layers):
   a transformers model of the size's config (LlamaConfig / Qwen2Config, fp32, tied head), written by
   edgespec's exporter as a target graph (`exporters.architectures.builder_for(..., exact_passes=True)` and
   `exporters.bundle_writer.write_model`, int4 symmetric, blocks of 32, one lane, context 1024: what
   `export --draft ngram --quant int4 --context 1024` writes for the target, without the bundle around
   it, whose quality report would also build an fp32 graph). Speed does not depend on the values, so every
   layer shares one randomly initialised layer's tensors in torch, and the written 4-bit weights are
   overwritten with random bytes (every layer distinct in the graph). Then
   `runtime.exactness.fewest_exact_rows` gives the one-token step's rows on this device. Graphs already in
   --workdir are reused. Memory: the exporter holds ~3.6x the graph's fp32 weights while it writes (the
   builder's arrays, the initializer protos and the graph's copy of them, then the quantizer's): the 1.5B
   at 28 layers (6.2 GB fp32) peaked above 22 GB and was killed on a 24 GB machine. Hence fewer layers and:
2. Time every graph (and --reference, a bundle's target) in one process, alternating
   (benchmarks/measure/verify_cost.py's measure): chain passes of 1..16 rows after --past tokens, logits for every row.
3. Depth: where a size has two or more depths, t(rows) = a(rows) + layers * b(rows) is fitted per row
   count (a: embedding, head and per-pass overhead; b: one layer) and extrapolated to the model's own depth
   ("SIZE@28 (extrapolated ...)"). With three depths or more, the deepest is also predicted from the others
   and set beside its measurement: the check of the fit.
4. Project: a chain of k drafted tokens, each accepted with probability a, yields (1 - a^(k+1)) / (1 - a)
   tokens per pass; the speedup over one-token steps is that / (t(k+1) / t(1)), best k. Drafting is taken
   as free (an n-gram drafter) and Python between passes is left out; the ratios are made non-decreasing in
   rows (a running maximum) so that noise cannot offer a cheaper longer pass.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.execution.sessions import make_session
from verify_cost import Form, curves_dict, measure, parse_rows, print_curves, profile, profiled_session  # noqa: E402

from edgespec.defaults import resolve_bundle  # noqa: E402

# the shapes of the public models (their configs on the Hugging Face hub); both tie the head to the embedding
SIZES = {
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, head_dim=128, intermediate_size=8960,
                                   vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    "llama-3.2-3b": ("llama", dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                                   num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                                   vocab_size=128256, rope_theta=500_000.0, rms_norm_eps=1e-5)),
}
# depths that fit the exporter's memory on a 24 GB machine (see 1.): three of the 1.5B's, two of the 3B's
DEFAULT_GRAPHS = "qwen2.5-1.5b:2,qwen2.5-1.5b:8,qwen2.5-1.5b:14,llama-3.2-3b:1,llama-3.2-3b:5"
CONTEXT = 1024
PREFILL_CHUNK = 64


def shared_layer_model(name: str, layers: int):
    """The size's model with `layers` layers that all share one randomly initialised layer's parameters."""
    import torch
    import transformers
    from accelerate import init_empty_weights

    arch, shape = SIZES[name]
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]

    def config(count: int):
        return config_cls(**{**shape, "num_hidden_layers": count}, max_position_embeddings=CONTEXT * 2,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="float32")

    torch.manual_seed(0)
    donor = model_cls(config(1)).eval()  # embedding, one layer, final norm: random init
    with init_empty_weights():  # parameters on the meta device, buffers (rotary frequencies) real
        model = model_cls(config(layers)).eval()
    shared = dict(donor.model.layers[0].named_parameters())
    for layer in model.model.layers:
        for path, param in shared.items():
            owner, _, leaf = path.rpartition(".")
            setattr(layer.get_submodule(owner), leaf, param)
    model.model.embed_tokens.weight = donor.model.embed_tokens.weight
    model.model.norm.weight = donor.model.norm.weight
    model.lm_head.weight = donor.model.embed_tokens.weight
    return model


def randomize_packed(folder: Path, seed: int = 0) -> int:
    """Overwrites the integer tensors (packed 4-bit weights) of target.weights with random bytes; returns
    how many bytes it wrote. Float tensors (scales, norms, rotary tables) keep their values."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(folder / "target.onnx"), load_external_data=False)
    data = np.memmap(folder / "target.weights", dtype=np.uint8, mode="r+")
    rng = np.random.default_rng(seed)
    written = 0
    for tensor in model.graph.initializer:
        if not uses_external_data(tensor) or tensor.data_type not in (onnx.TensorProto.UINT8, onnx.TensorProto.UINT4,
                                                                       onnx.TensorProto.INT8, onnx.TensorProto.INT4):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        offset, length = int(info.get("offset", 0)), int(info["length"])
        data[offset: offset + length] = rng.integers(0, 256, length, dtype=np.uint8)
        written += length
    data.flush()
    del data
    return written


def write_target(name: str, layers: int, folder: Path, threads: int) -> dict:
    """Writes the int4 target graph of `name` with `layers` layers into `folder` and checks exactness;
    returns (and keeps in folder/meta.json) {facts, min_rows, exact, export_seconds, ...}."""
    import torch
    from edgespec.exporters.architectures import builder_for
    from edgespec.exporters.bundle_writer import write_model
    from edgespec.quant.schemes import QuantPolicy, QuantScheme
    from edgespec.runtime.decoding.exactness import fewest_exact_rows

    started = time.perf_counter()
    say = lambda message: print(f"[{time.perf_counter() - started:6.1f}s] {name}:{layers} {message}",  # noqa: E731
                                file=sys.stderr, flush=True)
    model = shared_layer_model(name, layers)
    say("model built (layers share one layer's tensors); writing the int4 graph")
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        builder = builder_for(model, CONTEXT, lanes=1, exact_passes=True)
        facts = builder.facts
        write_model(folder, "target", builder, f"random {name}", QuantPolicy(QuantScheme("int4")))
    del builder, model
    gc.collect()
    randomized = randomize_packed(folder)
    written = time.perf_counter() - started
    say(f"written ({randomized / 1e6:.0f} MB of packed weights randomized); checking exactness")
    runner = ModelRunner(make_session(folder / "target.onnx", ("CPUExecutionProvider",), threads), facts)
    min_rows, compared, differ = fewest_exact_rows(runner)
    del runner
    meta = {"size": name, "layers": layers, "facts": facts.to_dict(), "min_rows": min_rows, "exact": not differ,
            "rows_compared": compared, "export_seconds": round(written, 1),
            "weights_bytes": (folder / "target.weights").stat().st_size}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    say(f"min_rows {min_rows}, {'exact' if not differ else f'{len(differ)} of {compared} rows differ'}")
    return meta


def graph_form(folder: Path, meta: dict, threads: int, past: int, most_rows: int, prefix: str = "") -> Form:
    path = folder / "target.onnx"
    session = profiled_session(path, threads, prefix) if prefix else \
        make_session(path, ("CPUExecutionProvider",), threads)
    runner = ModelRunner(session, ModelFacts.from_dict(meta["facts"]))
    return Form(folder.name, runner, threads, past, most_rows, PREFILL_CHUNK, meta["min_rows"], meta["exact"])


def fit_depths(curves: dict, depths: list[tuple[int, str]], layers: int) -> dict:
    """t(rows) at `layers` layers from the least-squares a + layers * b over the measured `depths`."""
    x = np.array([n for n, _ in depths], float)
    ms = {}
    for label in curves[depths[0][1]]["rows"]:
        slope, intercept = np.polyfit(x, np.array([curves[g]["rows"][label]["ms"] for _, g in depths]), 1)
        ms[label] = intercept + layers * slope
    return {label: {"ms": v, "ratio": v / ms["1"]} for label, v in ms.items()}


def extrapolate(curves: dict, graphs: list[tuple[str, int]], names: dict) -> dict:
    """Per size with two or more measured depths below its own: the fit at the model's own depth, as
    curves_dict's rows (ms and ratio). With three or more, "check": the deepest predicted from the others
    beside its measured ratio."""
    out = {}
    for size in dict.fromkeys(s for s, _ in graphs):
        full = SIZES[size][1]["num_hidden_layers"]
        depths = sorted((n, names[size, n]) for s, n in graphs if s == size and n != full)
        if len(depths) < 2:
            continue
        fit = {"rows": fit_depths(curves, depths, full), "from_layers": [n for n, _ in depths]}
        if len(depths) >= 3:
            deepest, graph = depths[-1]
            predicted = fit_depths(curves, depths[:-1], deepest)
            fit["check"] = {"layers": deepest, "from_layers": [n for n, _ in depths[:-1]],
                            "predicted_ratio": {k: v["ratio"] for k, v in predicted.items()},
                            "measured_ratio": {k: v["ratio"] for k, v in curves[graph]["rows"].items()}}
        out[f"{size}@{full} (extrapolated from {'+'.join(str(n) for n, _ in depths)} layers)"] = fit
    return out


def print_extrapolated(fits: dict) -> None:
    for name, fit in fits.items():
        check = fit.get("check")
        print(f"\n{name}" + (f"; check: {check['layers']} layers predicted from "
                              f"{'+'.join(map(str, check['from_layers']))} against measured" if check else ""))
        print("| rows | ms per pass | x t(1) |" + (" check: predicted x | measured x |" if check else ""))
        print("| --- | --- | --- |" + (" --- | --- |" if check else ""))
        for label, row in fit["rows"].items():
            extra = f" {check['predicted_ratio'][label]:.2f} | {check['measured_ratio'][label]:.2f} |" if check else ""
            print(f"| {label} | {row['ms']:.2f} | {row['ratio']:.2f} |{extra}")


def projection(curves: dict, acceptances: list[float], most: int) -> dict:
    """Per graph and acceptance a: (best k, tokens per pass, t(k+1)/t(1), speedup). The ratios are made
    non-decreasing in rows first (a running maximum): a pass of more rows costs no less, and choosing the
    best k among noisy ratios would otherwise pick a dip."""
    out = {}
    for name, curve in curves.items():
        ratio, most_so_far = {}, 0.0
        for rows in sorted(int(label) for label in curve["rows"] if label.isdigit()):
            most_so_far = max(most_so_far, curve["rows"][str(rows)]["ratio"])
            ratio[rows] = most_so_far
        out[name] = {}
        for a in acceptances:
            best = (0, 1.0, 1.0, 1.0)
            for k in range(1, most):
                if k + 1 in ratio:
                    tokens = (1 - a ** (k + 1)) / (1 - a)
                    if tokens / ratio[k + 1] > best[3]:
                        best = (k, tokens, ratio[k + 1], tokens / ratio[k + 1])
            out[name][a] = best
    return out


def print_projection(table: dict, acceptances: list[float]) -> None:
    print("\nPROJECTION (not measured decoding): the best chain of k drafted tokens at per-token acceptance a; "
          "speedup over one-token steps = (1 - a^(k+1)) / (1 - a) / (t(k+1)/t(1)), the ratios as a running maximum "
          "over rows; drafting free, Python left out")
    print("| graph | " + " | ".join(f"a = {a}" for a in acceptances) + " |")
    print("| --- |" + " --- |" * len(acceptances))
    for name, row in table.items():
        cells = [f"{s:.2f}x (k {k}, {tok:.2f} tok/pass, pass x{r:.2f})" if k else "1.00x (k 0: plain)"
                 for k, tok, r, s in (row[a] for a in acceptances)]
        print(f"| {name} | " + " | ".join(cells) + " |")


def parse_graphs(text: str) -> list[tuple[str, int]]:
    graphs = []
    for part in filter(None, text.split(",")):
        size, _, layers = part.partition(":")
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}: {', '.join(SIZES)}")
        graphs.append((size, int(layers) if layers else SIZES[size][1]["num_hidden_layers"]))
    return graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--graphs", default=DEFAULT_GRAPHS,
                        help=f"SIZE:LAYERS, comma-separated; sizes: {', '.join(SIZES)}")
    parser.add_argument("--reference", default="default",
                        help="a bundle whose target is timed alongside ('default'; 'none' for none)")
    parser.add_argument("--rows", default="1-16")
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=3, help="passes per visit (the first is dropped)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/edgespec-row-cost"))
    parser.add_argument("--export-only", action="store_true")
    parser.add_argument("--profile", default=None, help="rows to profile per graph, e.g. '1,8'")
    parser.add_argument("--profile-passes", type=int, default=10)
    parser.add_argument("--acceptance", default="0.5,0.6,0.7,0.8")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    graphs = parse_graphs(args.graphs)
    metas, folders, names = {}, {}, {}
    for size, layers in graphs:
        folder = args.workdir / f"{size}-{layers}l"
        meta_file = folder / "meta.json"
        metas[folder.name] = json.loads(meta_file.read_text()) if meta_file.is_file() else \
            write_target(size, layers, folder, args.threads)
        folders[folder.name], names[size, layers] = folder, folder.name
        gc.collect()
    if args.export_only:
        return
    rows = parse_rows(args.rows)
    sizes = [(n, True) for n in rows]
    forms = [graph_form(folders[g], metas[g], args.threads, args.past, max(rows)) for g in folders]
    reference = None if args.reference == "none" else resolve_bundle(args.reference)
    if reference is not None:
        forms.append(Form.from_bundle(reference, args.threads, args.past, max(rows)))
    print(f"past {args.past}, {args.threads} threads, {len(forms)} graphs alternating, {args.rounds} rounds",
          file=sys.stderr)
    results = measure(forms, sizes, args.rounds, args.block)
    for g, m in metas.items():
        print(f"{g}: {m['layers']} layers, int4 weights {m['weights_bytes'] / 1e6:.0f} MB, "
              f"exported in {m['export_seconds']:.0f} s")
    print_curves(forms, sizes, results)
    curves = curves_dict(forms, sizes, results)
    fits = extrapolate(curves, graphs, names)
    print_extrapolated(fits)
    acceptances = [float(a) for a in args.acceptance.split(",")]
    table = projection({**curves, **fits}, acceptances, max(rows))
    print_projection(table, acceptances)
    report = {"threads": args.threads, "past": args.past, "metas": metas, "curves": curves, "extrapolated": fits,
              "projection": {n: {str(a): dict(zip(("k", "tokens_per_pass", "pass_ratio", "speedup"), v))
                                 for a, v in row.items()} for n, row in table.items()}}
    del forms
    gc.collect()
    if args.profile:
        profiled = sorted({int(r) for r in args.profile.split(",")})
        makers = [lambda prefix, g=g: graph_form(folders[g], metas[g], args.threads, args.past, max(profiled), prefix)
                  for g in folders]
        if reference is not None:
            makers.append(lambda prefix: Form.from_bundle(reference, args.threads, args.past, max(profiled), prefix))
        report["profile"] = profile(makers, profiled, args.profile_passes)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
