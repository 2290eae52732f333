"""MatMulNBits on this CPU: speed by accuracy level, and whether a row's result depends on the pass's shape.

    python benchmarks/matmulnbits_levels.py
For SmolLM2's gate/up shape (K=576, N=3072), int4 block 32 symmetric: microseconds per call at M=1, 2
and 8 rows; and whether row 0 computed alone (M=1) or beside other rows (M=2, 8) has the same bits.
Then, at accuracy level 4, what each row of a pass costs with 4 and 8 bits and blocks of 32, 64, 128.
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


def quantized_session(bits: int, block: int, level: int) -> ort.InferenceSession:
    quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), bits=bits,
                                     block_size=block, is_symmetric=True, accuracy_level=level)
    quantizer.process()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(quantizer.model.model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def micros(session: ort.InferenceSession, m: int, calls: int = 300) -> float:
    for _ in range(20):
        session.run(None, {"x": x[:m]})
    start = time.perf_counter()
    for _ in range(calls):
        session.run(None, {"x": x[:m]})
    return (time.perf_counter() - start) / calls * 1e6


x = rng.standard_normal((12, K)).astype(np.float32)
for level in (1, 2, 4):
    session = quantized_session(4, 32, level)
    timings = {m: micros(session, m) for m in (1, 2, 8)}
    rows = {m: session.run(None, {"x": x[:m]})[0][0] for m in (1, 2, 8)}
    print(f"accuracy level {level}: " + ", ".join(f"M={m} {t:.0f} us" for m, t in timings.items())
          + f"; row 0 alone == beside others: {np.array_equal(rows[1], rows[8])}; M=2 == M=8: {np.array_equal(rows[2], rows[8])}")

# Every row beyond the second costs about the same at any bit width and block size when the kernel is
# compute-bound (int8 dot products on AVX2 without VNNI): then a tree's nodes are not nearly free.
for bits in (4, 8):
    for block in (32, 64, 128):
        session = quantized_session(bits, block, 4)
        timings = {m: micros(session, m) for m in (2, 4, 6, 8, 12)}
        per_row = (timings[12] - timings[2]) / 10
        print(f"level 4, {bits} bits, block {block}: " + ", ".join(f"M={m} {t:.0f}" for m, t in timings.items())
              + f" us; {per_row:.1f} us per row beyond 2")

# Float zero points (what an exact Q4_1 grid needs) against none, accuracy level 4, same shape.
blocks = K // 32
packed = rng.integers(0, 256, (N, blocks, 16), dtype=np.uint8)
scales = rng.uniform(0.001, 0.01, N * blocks).astype(np.float32)
for label, zero_points in (("no zero points", None), ("float zero points", rng.uniform(0, 15, N * blocks).astype(np.float32))):
    inputs = ["x", "B", "scales"] + (["zero_points"] if zero_points is not None else [])
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "zero_points"))
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=K, N=N, bits=4, block_size=32,
                            accuracy_level=4)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
    print(f"accuracy level 4, {label}: M=2 {micros(session, 2):.0f} us")
