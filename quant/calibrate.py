"""Each matmul input's largest magnitude per channel, measured by running the fp32 graph over a text.

Integer matmuls (integer.py) quantize a row of activations with one scale, so a few channels that are
always large would take the row's precision; their maxima set the smoothing that moves that range into
the weights. The text is quant/data/calibration.txt (written for this; it shares nothing with the
held-out text that quality.json measures on).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
import onnx
import onnxruntime as ort
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.contract.graph import FEATURES, FEATURES_OUT
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import padded_features, pass_feed, run_bound, signature_of

CALIBRATION_TOKENS = 512


def calibration_text() -> str:
    return resources.files("edgespec.quant").joinpath("data/calibration.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Calibration:
    ids: tuple[int, ...]  # the tokens it ran over
    maxima: dict[str, np.ndarray]  # weight name -> max |input| per input channel [K]
    features: np.ndarray | None  # [n, hidden]: the graph's output features, for a draft that reads them


def activation_maxima(model: onnx.ModelProto, facts: ModelFacts, ids: list[int],
                      features: np.ndarray | None = None) -> Calibration:
    """The maxima of every MatMul whose weight is an initializer over one causal pass of `ids` (cut to
    CALIBRATION_TOKENS and to the context); `features` [n, hidden]: the input features of a draft that reads them."""
    ids = list(ids[: min(CALIBRATION_TOKENS, facts.max_context - 1)])
    if not ids:
        raise InputError("the calibration text gave no tokens")
    weights = {t.name: t for t in model.graph.initializer}
    probed = onnx.ModelProto()
    probed.CopyFrom(model)
    inputs: dict[str, tuple[str, int]] = {}  # activation -> (weight, K)
    for node in probed.graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights and node.input[0] not in inputs:
            inputs[node.input[0]] = (node.input[1], weights[node.input[1]].dims[0])
    outputs = {o.name for o in probed.graph.output}
    probed.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                               for name in inputs if name not in outputs)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(probed.SerializeToString(), options, providers=["CPUExecutionProvider"])
    graph = signature_of(session, facts)
    cache = KVCache(facts, len(ids) + 2, lanes=graph.lanes)
    n = len(ids)
    layout = pass_feed(cache, graph, ids, range(n), np.tril(np.ones((n, n), bool)), range(n))
    rows = layout.feed["input_ids"].shape[1]
    feed = dict(layout.feed)
    names = {i.name for i in session.get_inputs()}
    if FEATURES in names:
        feed[FEATURES] = padded_features(None if features is None else features[:n], rows, facts.hidden_size)
    wanted = {name: (rows, k) for name, (_, k) in inputs.items()}
    if FEATURES_OUT in outputs:
        wanted[FEATURES_OUT] = (rows, facts.hidden_size)
    values = run_bound(session, cache, feed, wanted)
    maxima: dict[str, np.ndarray] = {}
    for name, (weight, _) in inputs.items():
        value = np.abs(values[name][:n]).max(axis=0)
        for node in model.graph.node:  # every weight that reads this activation shares its maxima
            if node.op_type == "MatMul" and node.input[0] == name and node.input[1] in weights:
                maxima[node.input[1]] = value
    return Calibration(tuple(ids), maxima, values[FEATURES_OUT][:n] if FEATURES_OUT in values else None)
