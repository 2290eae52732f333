"""`edgespec inspect`: a bundle's manifest in readable form, and whether this device keeps speculation exact."""
from __future__ import annotations

from pathlib import Path

import onnxruntime

from edgespec.runtime.contract.errors import InexactRowsError
from edgespec.runtime.contract.manifest import SCHEMA_VERSION, open_bundle
from edgespec.runtime.execution.device import machine_key
from edgespec.runtime.pipeline import Pipeline


def print_bundle(folder: Path) -> None:
    """The manifest in readable form; opening the bundle verifies every checksum."""
    manifest = open_bundle(folder)
    print(f"bundle {folder}")
    print(f"  schema version {SCHEMA_VERSION}, written by edgespec {manifest.edgespec_version} "
          f"on {manifest.created}, device profile {manifest.profile.name}")
    for other in manifest.other_profiles:
        graphs = ", ".join(g.file for g in (other.target, other.draft) if g is not None)
        print(f"  also for the {other.profile.name} profile: " + (f"its own {graphs}" if graphs else "the same graphs"))
    for role, entry in (("target", manifest.target), ("draft", manifest.draft)):
        if entry is None:
            continue
        f = entry.facts
        print(f"  {role}: {entry.source}")
        print(f"    {f.architecture}, {f.num_layers} layers, hidden {f.hidden_size}, heads {f.num_heads}/"
              f"{f.num_kv_heads} kv, head dim {f.head_dim}, vocab {f.vocab_size}, context {f.max_context}")
        print(_described(f"    graph {entry.graph.file} + {', '.join(entry.graph.weights)}, quantization ",
                         _quantization, entry.graph.quantization))
        for name, spec in entry.graph.inputs.items():
            if not name.startswith("past_"):
                print(_described(f"      in  {name:16s} ", _io, spec))
        layers = sum(1 for n in entry.graph.inputs if n.startswith("past_key_"))
        if layers:  # Medusa heads keep no cache
            print(f"      in  past_key/value_0..{layers - 1} (token-major KV cache, valid rows only)")
        for name, spec in entry.graph.outputs.items():
            print(_described(f"      out {name:16s} ", _io, spec))
    if manifest.draft is None:
        print(f"  drafter: {manifest.drafter.value} (training-free)")
    elif manifest.draft.tokenizer is not None:
        print(f"  drafter: {manifest.drafter.value} (the draft's own tokenizer {manifest.draft.tokenizer.file}: "
              "its tokens are decoded to text and encoded with the target's)")
    if manifest.quality:
        print(_described("  quality vs the fp32 export ", _quality, manifest.quality))
    recorded = manifest.exactness
    if recorded:
        where = "this device" if recorded.get("machine") == machine_key() else "another device"
        print(f"  exactness: checked at export on {where} (onnxruntime {recorded.get('onnxruntime')}): "
              f"{recorded.get('rows')} rows, {recorded.get('differ')} differ"
              + (f", one-token steps run {recorded['min_rows']} row(s)" if "min_rows" in recorded else "")
              + ("" if where == "this device" else "; checked again here on first use"))
    tree = manifest.tree
    print(f"  tree: {tree.size} nodes, depth {tree.max_depth}, parents {list(tree.parents)}")
    print(f"  prefill chunk: {manifest.prefill_chunk} tokens")
    tok = manifest.tokenizer
    print(f"  tokenizer: {tok.file}, chat template: {tok.chat_template or 'none'}, eos ids {list(tok.eos_token_ids)}, "
          f"add BOS: {tok.add_bos_token}")
    in_packages = {package.file: [n for n in manifest.files if n.startswith(package.file + "/")]
                   for package in manifest.coreml}
    if manifest.coreml:
        print("  CoreML packages (run on macOS through coremltools; verified here by checksum):")
    for package in manifest.coreml:
        names = in_packages[package.file]
        size = sum((folder / name).stat().st_size for name in names)
        functions = ", ".join(f"{name} {nodes} tokens" for name, nodes in package.functions.items())
        print(f"    {package.file}: {package.role}, KV as {package.kv}, {functions}; {package.compression} weights, "
              f"compute units {package.compute_units}, {package.capacity} KV rows; {size / 1e6:.2f} MB in {len(names)} files")
    packed = {name for names in in_packages.values() for name in names}
    total = sum((folder / name).stat().st_size for name in manifest.files)
    print(f"  files ({total / 1e6:.1f} MB), sha256 verified:")
    for name, digest in manifest.files.items():
        if name not in packed:
            print(f"    {name:24s} {(folder / name).stat().st_size / 1e6:10.2f} MB  {digest[:16]}")


def check_exact(folder: Path) -> None:
    """Runs runtime/decoding/exactness.py's checks on the bundle's target here; raises InexactRowsError if a row differs."""
    pipeline = Pipeline(folder)
    compared, differ = pipeline.check_exact()
    where = f"onnxruntime {onnxruntime.__version__} on this CPU"
    if differ:
        worst = max(m.max_abs_diff for m in differ)
        kinds = ", ".join(sorted({m.check for m in differ}))
        raise InexactRowsError(f"{len(differ)} of {compared} rows differ from plain decoding's bits ({kinds}; largest "
                               f"difference {worst:.3g}) with {where}: greedy speculative output may differ from "
                               "plain decoding here; decode with --no-speculate, and report it with your CPU model")
    rows = pipeline.target.min_rows
    print(f"  exact rows: {compared} of {compared} tokens have plain decoding's bits in prefill chunks, one-token "
          f"steps and a verified tree, with {where}; a one-token step runs "
          + ("one row" if rows == 1 else f"{rows} rows (one alone would round differently here)"))


def _described(head: str, describe, section) -> str:
    """`head` + `describe(section)`; a section the manifest's reader does not check (it only informs) may be
    malformed in a hand-edited manifest: that is said, not raised."""
    try:
        return head + describe(section)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        return f"{head}malformed in the manifest ({type(err).__name__}: {err})"


def _quantization(q: dict) -> str:
    detail = "" if "block_size" not in q else \
        f" (block {q['block_size']}, {'symmetric' if q['symmetric'] else 'asymmetric'}, accuracy level {q['accuracy_level']})"
    kept = sorted({s for s in q.get("tensors", {}).values()} - {q.get("scheme")})
    return f"{q.get('scheme')}{detail}" + (f", some tensors {'/'.join(kept)} by policy" if kept else "")


def _io(spec: dict) -> str:
    return f"{spec['dtype']:8s} {spec['shape']}"


def _quality(quality: dict) -> str:
    ppl, agree = quality["perplexity"], quality["greedy_agreement"]
    text = (f"({quality['heldout_tokens']} held-out tokens, {agree['tokens']} greedy tokens):\n"
            f"    perplexity {ppl['fp32']:.3f} -> {ppl['quantized']:.3f} ({ppl['increase_percent']:+.1f}%), "
            f"greedy top-1 agreement {agree['top1_agreement']:.1%}")
    if "draft_agreement" in quality:
        d = quality["draft_agreement"]
        text += f"\n    draft agrees with the target: {d['fp32']:.1%} in fp32, {d['quantized']:.1%} quantized"
    return text
