"""A copy of an `--integer-matmul` int8 bundle whose MatMulInteger weights are int8 (w - 128, zero points
zp - 128) instead of uint8: the same integer sums, so onnxruntime's MLAS may take its u8 x s8 kernels (VNNI;
AMX where the CPU has it). Not an exporter option: on AVX2 without VNNI the u8 x s8 kernel saturates
(history.md §41). The manifest's recorded exactness is dropped, so the runtime checks the new graph itself
(history.md §57: 8 verify rows 1.49-1.52x a one-row pass, against 1.73-1.75x for the uint8 graph).

    python benchmarks/measure/int8_signed_weights.py SRC_BUNDLE DST_BUNDLE
    python benchmarks/measure/verify_cost.py SRC_BUNDLE DST_BUNDLE --rows 1,2,4,8,16 --rounds 16 --block 4
"""
import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
from edgespec.exporters.weights import externalize
from edgespec.runtime.contract.manifest import sha256_file
from onnx import numpy_helper

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("src", type=Path, help="a bundle exported with --quant int8 --integer-matmul")
parser.add_argument("dst", type=Path, help="where the copy is written (must not exist)")
args = parser.parse_args()

shutil.copytree(args.src, args.dst, ignore=shutil.ignore_patterns("target.onnx", "target.weights"))
model = onnx.load(str(args.src / "target.onnx"))  # with its external data
initializers = {t.name: t for t in model.graph.initializer}
changed = set()
for node in model.graph.node:
    if node.op_type != "MatMulInteger":
        continue
    for name in (node.input[1], node.input[3]):  # the weights and their zero points
        if name in changed:
            continue
        tensor = initializers[name]
        if tensor.data_type != onnx.TensorProto.UINT8:
            raise SystemExit(f"{name} is not uint8: give a bundle exported with --integer-matmul")
        signed = numpy_helper.to_array(tensor).astype(np.int16) - 128
        tensor.CopyFrom(numpy_helper.from_array(signed.astype(np.int8), name))
        changed.add(name)
externalize(model, args.dst / "target.weights")
onnx.save_model(model, args.dst / "target.onnx")
manifest = json.loads((args.dst / "manifest.json").read_text())
for name in ("target.onnx", "target.weights"):
    manifest["files"][name] = sha256_file(args.dst / name)
manifest["exactness"]["machine"] = "not-checked"
(args.dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
print(f"{len(changed)} tensors to int8 in {args.dst}")
