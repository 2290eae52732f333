"""MatMul weights packed a slice of columns at a time (quant/nbits.py), against onnxruntime's own quantizer:
the same bytes, graphs and weights files, whatever layout the weight arrives in."""
import numpy as np
import onnx
import pytest
from edgespec.exporters import weight_stream
from edgespec.exporters.architectures import builder_for
from edgespec.exporters.bundle_writer import save_graph
from edgespec.exporters.sources import resolve_source
from edgespec.quant import apply, nbits
from edgespec.quant.schemes import QuantPolicy, QuantScheme
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer


def _quantizer_output(weight: np.ndarray, bits: int, block: int, symmetric: bool):
    """onnxruntime's MatMulNBitsQuantizer on a one-MatMul graph: its node and initializers."""
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weight.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, weight.shape[1]])],
                              [numpy_helper.from_array(np.ascontiguousarray(weight), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=symmetric, accuracy_level=4)
    quantizer.process()
    out = quantizer.model.model.graph
    return out.node[0], {t.name: numpy_helper.to_array(t) for t in out.initializer}


def _values(kind: str, shape, seed: int) -> np.ndarray:
    """A checkpoint-like [N, K] matrix; "ties": values on the halfway points between levels, where rounding
    half away from zero and half to even part."""
    rng = np.random.default_rng(seed)
    if kind == "ties":
        return (rng.integers(-16, 17, shape) / 2 * 0.37).astype(np.float32)
    return (rng.standard_normal(shape) * rng.uniform(0.001, 5, (shape[0], 1))).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("kind", ["random", "ties"])
def test_columns_packed_in_slices_are_the_quantizers_bytes(bits, symmetric, transposed, kind, monkeypatch):
    """Several slices (the last one short), a checkpoint's [N, K] seen transposed or a C-ordered [K, N]:
    the packed levels, scales and zero points equal onnxruntime's quantizer's, and so does the node."""
    monkeypatch.setattr(nbits, "SLICE_VALUES", 64 * 7)  # 7 columns of K = 64 a slice: 45 columns in 7 slices
    source = _values(kind, (45, 64), bits + 2 * symmetric)
    source[3, :32] = 0.0  # an all-zero block
    weight = source.T if transposed else np.ascontiguousarray(source.T)
    assert weight.flags.f_contiguous == transposed
    packed, scales, zeros = nbits.pack_columns(weight, bits, 32, symmetric)
    node, tensors = _quantizer_output(weight, bits, 32, symmetric)
    np.testing.assert_array_equal(packed, tensors[f"w_Q{bits}"])
    np.testing.assert_array_equal(scales.reshape(tensors["w_scales"].shape), tensors["w_scales"])
    if symmetric:
        assert zeros is None and "w_zero_points" not in tensors
    else:
        np.testing.assert_array_equal(zeros.reshape(tensors["w_zero_points"].shape), tensors["w_zero_points"])
    mine, initializers = nbits.replacement(helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), "w",
                                           weight.shape, packed, scales, zeros, bits, 32, 4)
    assert mine.SerializeToString() == node.SerializeToString()
    assert [t.name for t in initializers] == [n for n in node.input[1:]]


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_table_packed_in_slices_is_the_quantizers(symmetric, monkeypatch):
    """An embedding table for GatherBlockQuantized, a slice of rows at a time: the quantizer's bytes and node."""
    monkeypatch.setattr(nbits, "SLICE_VALUES", 64 * 7)
    rng = np.random.default_rng(5 + symmetric)
    table = rng.standard_normal((45, 64)).astype(np.float32) * rng.uniform(0.01, 3, (45, 1)).astype(np.float32)
    table[3, :32] = 0.0
    table[4, 32:] = 2.5  # a constant block: the asymmetric scale's zero point is its whole value
    graph = helper.make_graph([helper.make_node("Gather", ["embed_tokens", "ids"], ["y"], name="g")], "g",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 64])],
                              [numpy_helper.from_array(table, "embed_tokens")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=symmetric, accuracy_level=4,
                                     op_types_to_quantize=("Gather",), quant_axes=(("Gather", 1),))
    quantizer.process()
    theirs = quantizer.model.model.graph
    node, tensors = nbits.table_replacement(graph.node[0], "embed_tokens", table.shape,
                                            *nbits.pack_table(table, 32, symmetric), 32)
    assert node.SerializeToString() == theirs.node[0].SerializeToString()
    assert [t.SerializeToString() for t in tensors] == [t.SerializeToString() for t in theirs.initializer]


@pytest.mark.parametrize("bits", [4, 8])
def test_a_large_matrix_packs_as_the_kernel_does(bits):
    """Symmetric levels come from numpy's arithmetic, not the kernel's: over millions of values of every
    magnitude, not one byte differs from onnxruntime's quantizer."""
    source = _values("random", (1024, 2048), bits)
    packed, scales, _ = nbits.pack_columns(source.T, bits, 32, True)
    _, tensors = _quantizer_output(source.T, bits, 32, True)
    np.testing.assert_array_equal(packed, tensors[f"w_Q{bits}"])
    np.testing.assert_array_equal(scales.reshape(tensors["w_scales"].shape), tensors["w_scales"])


def test_a_weight_that_would_need_padding_is_not_packed_here():
    assert nbits.packable(np.zeros((64, 8), np.float32), 32)
    assert not nbits.packable(np.zeros((48, 8), np.float32), 32)  # onnxruntime's quantizer pads it
    assert not nbits.packable(np.zeros((64, 8), np.float16), 32)


POLICIES = {
    "int4": QuantPolicy(QuantScheme("int4", 32, True, 4)),
    "int4 head int8": QuantPolicy(QuantScheme("int4", 32, True, 4), (("lm_head", "int8"),)),
    "int4 zero points": QuantPolicy(QuantScheme("int4", 32, False, 4, integer_zero_points=True)),
    "int8": QuantPolicy(QuantScheme("int8", 32, True, 4)),
    "int4 offsets": QuantPolicy(QuantScheme("int4", 32, False, 4)),  # not packed here: the offsets' rewrite
}


@pytest.mark.parametrize("target", ["target", "untied"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_an_export_packed_in_place_writes_the_quantizers_bundle(target, policy, models, tmp_path, monkeypatch):
    """The same graph and weights file, byte for byte, as with every weight given to onnxruntime's quantizer
    through the graph (a tied head read from the table, an untied one from its [out, in] matrix)."""
    model, _, weights = resolve_source(str(models[target]), tmp_path).load_streamed()
    written = {}
    for way in ("in place", "quantizer"):
        if way == "quantizer":
            for module in (weight_stream, apply):  # nothing handed in as an array, nothing packed here
                monkeypatch.setattr(module, "packs_directly", lambda *args: False)
            monkeypatch.setattr(apply, "_packed_here", lambda *args: set())
        folder = tmp_path / way.replace(" ", "_")
        folder.mkdir()
        save_graph(folder, "target", builder_for(model, 256, weights=weights), POLICIES[policy])
        written[way] = ((folder / "target.onnx").read_bytes(), (folder / "target.weights").read_bytes())
        graph = onnx.load(folder / "target.onnx", load_external_data=False).graph
        assert sum(n.op_type == "MatMulNBits" for n in graph.node) > 0
    assert written["in place"][1] == written["quantizer"][1]
    assert written["in place"][0] == written["quantizer"][0]
