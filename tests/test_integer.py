"""int8 matmuls computed in integers (quant/integer.py): close to x . W, and every row's bits the same at
any row count, so an exact pass needs no padding row."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from edgespec.quant.integer import quantize_columns, replace_matmul, smoothing_scales
from onnx import TensorProto, helper, numpy_helper


def matmul_model(weight: np.ndarray, activation_max=None) -> ort.InferenceSession:
    k, n = weight.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", n])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    replace_matmul(model, model.graph.node[0], weight, activation_max)
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w"))
    onnx.checker.check_model(model)
    assert not any(node.op_type == "MatMul" for node in model.graph.node)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_columns_round_trip_within_half_a_step():
    weight = np.random.default_rng(0).standard_normal((64, 40)).astype(np.float32)
    weight[:, 3] = 0.0  # a dead channel stays exactly zero
    weight[:, 4] = np.abs(weight[:, 4])  # one sign only: zero must still be on the grid
    q, scale, zero = quantize_columns(weight)
    restored = (q.astype(np.float64) - zero) * scale
    assert np.all(np.abs(restored - weight) <= scale * 0.5 + 1e-7)
    assert np.all(restored[:, 3] == 0)


def test_smoothing_moves_range_without_changing_the_product():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((32, 8))
    x = rng.standard_normal((5, 32)) * np.where(np.arange(32) == 7, 50.0, 1.0)  # one outlier channel
    s = smoothing_scales(np.abs(x).max(axis=0), weight).astype(np.float64)
    assert np.allclose((x / s) @ (weight * s[:, None]), x @ weight)
    def outlier_share(v):  # the outlier channel's range against a typical channel's
        ranges = np.abs(v).max(axis=0)
        return ranges[7] / np.median(ranges)
    assert outlier_share(x / s) < outlier_share(x) / 2
    assert np.all(smoothing_scales(np.zeros(32), weight) == 1)  # a channel never seen is left alone


@pytest.mark.parametrize("smooth", [False, True])
def test_rewritten_matmul_is_close_to_x_times_w(smooth):
    rng = np.random.default_rng(2)
    k, n = 96, 40
    weight = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    x = rng.standard_normal((1, 6, k)).astype(np.float32)
    x[..., 5] *= 30  # the activation outlier smoothing is for
    session = matmul_model(weight, np.abs(x[0]).max(axis=0) if smooth else None)
    y, expected = session.run(None, {"x": x})[0], x @ weight
    assert np.abs(y - expected).max() < 0.02 * np.abs(expected).max()


def test_every_row_has_the_same_bits_at_any_row_count():
    rng = np.random.default_rng(3)
    k, n = 576, 960  # SmolLM2's q/k/v shape, where MatMulNBits' one-row kernel rounds differently
    weight = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    session = matmul_model(weight, np.abs(rng.standard_normal(k)).astype(np.float32))
    x = rng.standard_normal((1, 7, k)).astype(np.float32)
    x[0, 2] = 0  # an all-zero row: no division by zero, and zeros out
    whole = session.run(None, {"x": x})[0]
    assert np.all(whole[0, 2] == 0)
    for rows in range(1, 7):
        for start in range(0, 7 - rows + 1):
            part = session.run(None, {"x": np.ascontiguousarray(x[:, start : start + rows])})[0]
            assert np.array_equal(part[0], whole[0, start : start + rows]), (rows, start)
