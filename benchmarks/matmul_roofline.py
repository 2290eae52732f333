"""The floor under fp32 decoding here: only SmolLM2-135M's matmuls (same shapes, random weights), one row.

    python benchmarks/matmul_roofline.py
Every decode step must read all weights once; this times exactly that in onnxruntime, nothing else.
"""
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(HIDDEN, 960), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # qkv, o, gate+up, down

rng = np.random.default_rng(0)
nodes, inits, outputs = [], [], []
for layer in range(LAYERS):
    for j, (k, n) in enumerate(SHAPES):
        name = f"w{layer}_{j}"
        inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.01).astype(np.float32), name))
        nodes.append(helper.make_node("MatMul", ["x" if k == HIDDEN else "x_inter", name], [f"y_{name}"]))
        outputs.append(helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, None))
inits.append(numpy_helper.from_array((rng.standard_normal((HIDDEN, VOCAB)) * 0.01).astype(np.float32), "head"))
nodes.append(helper.make_node("MatMul", ["x", "head"], ["logits"]))
outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, None))
graph = helper.make_graph(nodes, "matmuls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, HIDDEN]),
                                             helper.make_tensor_value_info("x_inter", TensorProto.FLOAT, [1, INTER])],
                          outputs, inits)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
model.ir_version = 8
onnx.save(model, "/tmp/edgespec_matmuls.onnx", save_as_external_data=True, location="edgespec_matmuls.bin")
weight_bytes = sum(int(np.prod(t.dims)) * 4 for t in inits)
feed = {"x": np.ones((1, HIDDEN), np.float32), "x_inter": np.ones((1, INTER), np.float32)}
for threads in (1, 2):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession("/tmp/edgespec_matmuls.onnx", options, providers=["CPUExecutionProvider"])
    for _ in range(3):
        session.run(None, feed)
    start = time.perf_counter()
    for _ in range(20):
        session.run(None, feed)
    seconds = (time.perf_counter() - start) / 20
    print(f"{threads} thread(s): {seconds * 1000:.1f} ms per pass = {1 / seconds:.1f} passes/s "
          f"({weight_bytes / seconds / 1e9:.1f} GB/s over {weight_bytes / 1e6:.0f} MB of weights)")
