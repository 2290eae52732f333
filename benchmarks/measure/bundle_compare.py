"""Whether two bundles hold the same model: every graph's weights compared by name, byte for byte, the nodes
by kind, and the logits of every row of a text through each graph, bit for bit. What an exporter change
that should leave a bundle's model alone (its file layout, the order it writes in) is checked with.

    python benchmarks/measure/bundle_compare.py OLD_BUNDLE NEW_BUNDLE [--graphs target.onnx,draft.onnx]

Prints one line per graph and exits 1 where anything differs.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from edgespec.runtime.contract.manifest import read_manifest
from edgespec.runtime.decoding.text import TextCodec
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.execution.sessions import make_session
from onnx import numpy_helper

TEXT = ("Speculative decoding drafts several tokens and verifies them in one pass of the target model, "
        "keeping exactly what the target alone would have produced. def f(x):\n    return x * 2\n")


def weights_of(path: Path) -> dict[str, bytes]:
    model = onnx.load(str(path), load_external_data=True)
    return {t.name: numpy_helper.to_array(t).tobytes() for t in model.graph.initializer}


def node_kinds(path: Path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def logits_of(bundle: Path, graph: str, role, ids: list[int]) -> np.ndarray:
    head = np.asarray(json.loads((bundle / role.head_tokens).read_text())) if role.head_tokens else None
    runner = ModelRunner(make_session(bundle / graph, ("CPUExecutionProvider",), 2), role.facts, head)
    facts = role.facts
    cache = runner.new_cache(len(ids) + 2)
    mask = np.tril(np.ones((len(ids), len(ids)), bool))
    # a draft that reads the target's features gets the same made-up ones in both bundles
    features = np.linspace(-1, 1, len(ids) * facts.hidden_size, dtype=np.float32).reshape(len(ids), -1) \
        if runner.reads_features else None
    return runner.forward(cache, ids, range(len(ids)), mask, range(len(ids)), features=features).logits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--graphs", default="target.onnx,draft.onnx")
    args = parser.parse_args()
    manifests = [read_manifest(b) for b in (args.old, args.new)]
    ids = TextCodec(args.new, manifests[1].tokenizer).encode(TEXT)
    same = True
    for graph in args.graphs.split(","):
        role = manifests[1].target if graph.startswith("target") else manifests[1].draft
        if role is None or not (args.old / graph).is_file():
            continue
        old, new = weights_of(args.old / graph), weights_of(args.new / graph)
        differ = sorted(n for n in set(old) | set(new) if old.get(n) != new.get(n))
        kinds = node_kinds(args.old / graph) == node_kinds(args.new / graph)
        rows = np.array_equal(logits_of(args.old, graph, role, ids), logits_of(args.new, graph, role, ids))
        print(f"{graph}: {len(new)} weights, {len(differ)} differ{' (' + ', '.join(differ[:5]) + ')' if differ else ''}; "
              f"nodes by kind {'the same' if kinds else 'DIFFER'}; logits of {len(ids)} rows "
              f"{'identical' if rows else 'DIFFER'}")
        same &= not differ and kinds and rows
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
