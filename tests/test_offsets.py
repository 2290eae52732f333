"""Asymmetric block quantization with float offsets reproduces weights that lie on such a grid."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from edgespec.quant.offsets import on_symmetric_grid, quantize_block_minmax, replace_matmul
from onnx import TensorProto, helper, numpy_helper


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


def q8_0_grid(k, n, seed=0, top=127):
    """Weights as a Q8_0 GGUF stores them: per block of 32 inputs, w = d * q with |q| <= 127, d = amax / 127."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-top, top + 1, (n, k // 32, 32))
    q[..., 0] = top * rng.choice([-1, 1], (n, k // 32))  # the block's largest magnitude sets d
    d = rng.uniform(0.001, 0.02, (n, k // 32, 1)).astype(np.float16).astype(np.float32)  # stored as fp16
    q[0, 0] = 0  # an all-zero block
    return (q * d).astype(np.float32).reshape(n, k).T.copy()


def rewritten(weight, bits):
    k, n = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", n])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    replace_matmul(model, model.graph.node[0], weight, bits, 32, accuracy_level=1)
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w"))
    onnx.checker.check_model(model)
    return model


def run(model, weight):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((1, 3, weight.shape[0])).astype(np.float32)
    return np.abs(session.run(None, {"x": x})[0] - x @ weight).max()


def test_rewritten_matmul_computes_x_times_w():
    weight = q4_1_grid(128, 48, seed=1)
    model = rewritten(weight, 4)
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits", "Reshape", "ReduceSum", "MatMul", "Add"]
    assert run(model, weight) < 1e-4


@pytest.mark.parametrize("bits", [8, 4])
def test_a_symmetric_grid_needs_no_offsets(bits):
    weight = q8_0_grid(128, 48, seed=3, top=(1 << (bits - 1)) - 1)
    packed, scales = on_symmetric_grid(weight, bits, 32)
    q = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(48, 4, 32) if bits == 4 else packed
    recovered = (scales.reshape(48, 4, 1) * (q.astype(np.float32) - (1 << (bits - 1)))).reshape(48, 128).T
    assert np.array_equal(recovered, weight)
    model = rewritten(weight, bits)
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    assert run(model, weight) < 1e-4


def test_a_weight_off_the_grid_keeps_its_offsets():
    weight = q8_0_grid(128, 48, seed=4)
    weight[5, 7] *= 1.001  # one value between two levels of its block
    assert on_symmetric_grid(weight, 8, 32) is None
    assert on_symmetric_grid(q4_1_grid(128, 48), 4, 32) is None
    assert "MatMul" in [n.op_type for n in rewritten(weight, 8).graph.node]


def test_block_size_must_divide_the_input():
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_block_minmax(np.zeros((48, 4), np.float32), 4, 32)
