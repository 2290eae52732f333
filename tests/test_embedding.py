"""A 4-bit embedding table read from its mapped weights file has onnxruntime's GatherBlockQuantized bits,
in every form the exporter describes; other forms are left to the graph."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from edgespec.exporters.weights import external_table, externalize
from edgespec.runtime.execution.embedding import MappedEmbedding
from onnx import TensorProto, helper

ROWS, WIDTH, BLOCK = 300, 96, 32  # three blocks a row: an odd count, so the zero points' last byte is half used


def _table_graph(levels_type, zero_points: bool, scales_type=TensorProto.FLOAT, block=BLOCK, quantize_axis=1):
    rng = np.random.default_rng(levels_type + zero_points)
    blocks = WIDTH // block
    levels = rng.integers(0, 256, (ROWS, WIDTH // 2), dtype=np.uint8)
    scales = rng.uniform(-0.1, 0.1, (ROWS, blocks)).astype(np.float16 if scales_type == TensorProto.FLOAT16
                                                             else np.float32)
    inits = [helper.make_tensor("embed_tokens_Q4", levels_type, [ROWS, WIDTH], levels.tobytes(), raw=True),
             helper.make_tensor("embed_tokens_scales", scales_type, [ROWS, blocks], scales.tobytes(), raw=True)]
    inputs = ["embed_tokens_Q4", "input_ids", "embed_tokens_scales"]
    if zero_points:
        zeros = rng.integers(0, 256, -(-ROWS * blocks // 2), dtype=np.uint8)  # packed over the whole tensor
        inits.append(helper.make_tensor("embed_tokens_zero_points", levels_type, [ROWS, blocks], zeros.tobytes(),
                                        raw=True))
        inputs.append("embed_tokens_zero_points")
    node = helper.make_node("GatherBlockQuantized", inputs, ["hidden_out"], domain="com.microsoft",
                            block_size=block, gather_axis=0, quantize_axis=quantize_axis)
    out_type = TensorProto.FLOAT16 if scales_type == TensorProto.FLOAT16 else TensorProto.FLOAT
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "n"])],
                              [helper.make_tensor_value_info("hidden_out", out_type, [1, "n", WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("levels_type,zero_points", [(TensorProto.UINT4, True), (TensorProto.UINT4, False),
                                                     (TensorProto.INT4, False), (TensorProto.INT4, True)])
def test_a_mapped_4bit_table_has_the_operators_bits(tmp_path, levels_type, zero_points):
    model = _table_graph(levels_type, zero_points)
    externalize(model, tmp_path / "stage.weights")  # every part external, the small zero points too
    onnx.save_model(model, tmp_path / "stage.onnx")
    table = external_table(model, "embed_tokens")
    assert table["dtype"] == {TensorProto.UINT4: "uint4", TensorProto.INT4: "int4"}[levels_type]
    assert ("zero_points" in table) == zero_points
    session = ort.InferenceSession(str(tmp_path / "stage.onnx"), providers=["CPUExecutionProvider"])
    embedding = MappedEmbedding(tmp_path, table, reset_every=64)
    for ids in (np.arange(ROWS)[None], np.array([[7, 7, 299, 0, 150]])):
        expected = session.run(None, {"input_ids": ids})[0]
        np.testing.assert_array_equal(embedding.lookup(ids).view(np.uint32), expected.view(np.uint32))
    stored = sum(int({e.key: e.value for e in t.external_data}["length"]) for t in model.graph.initializer)
    assert MappedEmbedding.table_bytes(table) == stored
    assert MappedEmbedding.resident_bound(table, 4) <= MappedEmbedding.table_bytes(table)


@pytest.mark.parametrize("change", ["fp16 scales", "quantized across rows"])
def test_a_table_the_reader_does_not_compute_as_the_operator_is_left_to_the_graph(tmp_path, change):
    model = _table_graph(TensorProto.UINT4, True, scales_type=TensorProto.FLOAT16) if change == "fp16 scales" \
        else _table_graph(TensorProto.UINT4, True, quantize_axis=0, block=32)
    externalize(model, tmp_path / "stage.weights")
    assert external_table(model, "embed_tokens") is None
