"""CoreML packages of the reference model per weight compression: export time, package size, and the
largest logit difference against the fp32 model, measured on the saved programs run in numpy
(exporters/mil_reference.py: fp16 activations, as a device stores them; Linux cannot run CoreML itself).

    python benchmarks/measure/coreml_export.py [MODEL] [--compress fp16,int8,int4,palette4] [--context 2048]
        [--json FILE]

MODEL defaults to the reference model (`default`). The target's stateful package is written for each
compression (prefill 64 tokens, verify the default draft tree's 2), plus the io fallback where the
compression allows it; logits are compared on a 64-token prefill chunk and 8 verify calls after it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from edgespec.exporters.architectures import builder_for
from edgespec.exporters.coreml import NEEDS_IOS18, CoreMLOptions, write_coreml
from edgespec.exporters.mil_reference import reference_logits
from edgespec.exporters.sources import resolve_source
from edgespec.runtime.contract.topology import parse_tree_spec
from edgespec.runtime.execution.paths import cache_dir

TEXT = ("The Neural Engine runs fixed shapes in half precision, so a language model for it is exported with a "
        "static number of tokens per call and a cache of fixed capacity. Speculative decoding drafts a few tokens "
        "with a small model and verifies them with the large one in a single pass; the output is what the large "
        "model alone would have written, only sooner.")


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("--compress", default="fp16,int8,int4,palette4")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model, tokenizer = resolve_source(args.model, cache_dir()).load()
    builder = builder_for(model, args.context)
    ids = tokenizer(TEXT)["input_ids"][:80]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    tree, rows = parse_tree_spec("chain:1"), []
    for compression in args.compress.split(","):
        forms = ("state",) if compression in NEEDS_IOS18 else ("state", "io")
        for kv in forms:
            folder = Path(tempfile.mkdtemp(prefix="coreml-bench-"))
            try:
                started = time.perf_counter()
                packages = write_coreml(folder, "target", builder, tree, 64, CoreMLOptions((kv,), compression), "CPU_ONLY")
                seconds = time.perf_counter() - started
                row = {"compression": compression, "kv": kv, "export_s": round(seconds, 1),
                       "size_mb": round(sum(size_mb(folder / p.file) for p in packages), 1)}
                if kv == "state":
                    got = reference_logits(folder, packages[:1], builder.facts, ids)
                    diff = np.abs(got - expected[: len(got)])
                    row.update(max_logit_diff=round(float(diff.max()), 3), mean_logit_diff=round(float(diff.mean()), 4),
                               argmax_agreement=round(float((got.argmax(-1) == expected[: len(got)].argmax(-1)).mean()), 3),
                               rows=len(got))
                rows.append(row)
                print(json.dumps(row), flush=True)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "context": args.context, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
