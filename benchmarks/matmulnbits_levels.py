"""MatMulNBits on this CPU: speed by accuracy level, and whether a row's result depends on the pass's shape.

    python benchmarks/matmulnbits_levels.py
For SmolLM2's gate/up shape (K=576, N=3072), int4 block 32 symmetric: microseconds per call at M=1, 2
and 8 rows; and whether row 0 computed alone (M=1) or beside other rows (M=2, 8) has the same bits.
"""
import logging
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

logging.disable(logging.INFO)
K, N = 576, 3072
rng = np.random.default_rng(0)
weight = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
                          [numpy_helper.from_array(weight, "w")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
model.ir_version = 10
x = rng.standard_normal((8, K)).astype(np.float32)
for level in (1, 2, 4):
    quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), bits=4, block_size=32,
                                     is_symmetric=True, accuracy_level=level)
    quantizer.process()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(quantizer.model.model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    timings = {}
    for m in (1, 2, 8):
        for _ in range(20):
            session.run(None, {"x": x[:m]})
        start = time.perf_counter()
        for _ in range(300):
            session.run(None, {"x": x[:m]})
        timings[m] = (time.perf_counter() - start) / 300 * 1e6
    rows = {m: session.run(None, {"x": x[:m]})[0][0] for m in (1, 2, 8)}
    print(f"accuracy level {level}: " + ", ".join(f"M={m} {t:.0f} us" for m, t in timings.items())
          + f"; row 0 alone == beside others: {np.array_equal(rows[1], rows[8])}; M=2 == M=8: {np.array_equal(rows[2], rows[8])}")
