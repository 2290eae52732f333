"""Asymmetric block quantization with float offsets reproduces weights that lie on such a grid."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgespec.quant.offsets import quantize_block_minmax, replace_matmul


def q4_1_grid(k, n, seed=0):
    """Weights as a Q4_1 GGUF stores them: per block of 32 inputs, w = d * q + m with q in 0..15."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k // 32, 32))
    q[..., 0], q[..., 1] = 0, 15  # min-max quantization puts the extremes on the ends of the grid
    d = rng.uniform(0.001, 0.02, (n, k // 32, 1))
    m = rng.uniform(-0.2, 0.0, (n, k // 32, 1))
    return (q * d + m).reshape(n, k).T.astype(np.float32)  # [K, N]


def dequantize(packed, scales, offsets, bits, block, k, n):
    q = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, k // block, block) if bits == 4 else packed
    zero = 1 << (bits - 1)
    w = (q.astype(np.float64) - zero) * scales.reshape(n, k // block, 1)
    return (w.reshape(n, k).T + np.repeat(offsets, block, axis=0)).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_q4_1_grid_is_recovered_exactly(bits):
    weight = q4_1_grid(128, 48)
    packed, scales, offsets = quantize_block_minmax(weight, bits, 32)
    assert np.abs(dequantize(packed, scales, offsets, bits, 32, 128, 48) - weight).max() < 1e-6


def test_rewritten_matmul_computes_x_times_w():
    k, n = 128, 48
    weight = q4_1_grid(k, n, seed=1)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", n])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    replace_matmul(model, model.graph.node[0], weight, 4, 32, accuracy_level=1)
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w"))
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((1, 3, k)).astype(np.float32)
    y = session.run(None, {"x": x})[0]
    assert np.abs(y - x @ weight).max() < 1e-4


def test_block_size_must_divide_the_input():
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_block_minmax(np.zeros((48, 4), np.float32), 4, 32)
