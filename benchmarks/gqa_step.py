"""A whole one-token step of the reference target with GroupQueryAttention over shared KV buffers, against
the exported graph's step (RESULTS.md §38's lead, measured end to end).

    python benchmarks/gqa_step.py [--past 256] [--repeats 40] [--bundle BUNDLE --quant int4]

BUNDLE (default: the default bundle) is the reference target exported with the scheme --quant names
(symmetric, block 32, accuracy level 4, as `edgespec export --quant` writes it); the new graph is
quantized the same way.

Builds, in memory, the default target with each layer's attention subgraph replaced by one
GroupQueryAttention node whose past and present are the same [1, kv heads, capacity, head dim] buffer,
bound through IOBinding. Nothing else differs: same weights, rotary op, norms and head. Both graphs run
a one-token step (the token and a padding row) after `past` random tokens, fp32, 2 threads, alternating.
Also checks the new graph against itself: a token's logits decoded one at a time equal, bit for bit,
the same token in a chunk. A measurement only: bundles do not use this graph.
"""
import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from edgespec.defaults import cache_dir, resolve_bundle
from edgespec.exporters.llama import LlamaBuilder
from edgespec.exporters.onnx_builder import FLOAT, INT64
from edgespec.exporters.sources import resolve_source
from edgespec.quant.apply import quantize_model
from edgespec.quant.schemes import QuantPolicy, QuantScheme
from edgespec.runtime.kvcache import KVCache
from edgespec.runtime.model import prefill
from edgespec.runtime.pipeline import Pipeline

parser = argparse.ArgumentParser()
parser.add_argument("--past", type=int, default=256)
parser.add_argument("--repeats", type=int, default=40)
parser.add_argument("--bundle", default="default")
parser.add_argument("--quant", default="fp32")
args = parser.parse_args()
CAPACITY = 2048


class SharedBufferBuilder(LlamaBuilder):
    """Llama layers whose attention is GroupQueryAttention writing into caller-owned buffers."""

    def decoder_layers(self, g, x, branch, layers, nodes):
        f = self.facts
        pos = g.input("position_ids", INT64, [1, nodes])
        seqlens = g.input("seqlens_k", TensorProto.INT32, [1])
        total = g.input("total_sequence_length", TensorProto.INT32, [])
        cos_table, sin_table = self.rope_tables()
        half = f.head_dim // 2
        rope = (g.weight("rope_cos", cos_table[:, :half]), g.weight("rope_sin", sin_table[:, :half]), pos)
        new_kv = []
        for l in layers:
            buffers = [g.input(f"{kind}_{l}", FLOAT, [1, f.num_kv_heads, "capacity", f.head_dim])
                       for kind in ("past_key", "past_value")]
            w = {k: g.weight(f"layers.{l}.{k}", v) for k, v in self.layer_weights(l).items()}
            h, x = self.add_and_norm(g, x, branch, w["input_norm"])
            qkv = g.op("MatMul", [h, w["qkv"]], "qkv")
            sizes = g.const([f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim, f.num_kv_heads * f.head_dim])
            q, k, v = g.op("Split", [qkv, sizes], n_out=3, axis=-1)
            q, k = self.rotate(g, q, rope, f.num_heads), self.rotate(g, k, rope, f.num_kv_heads)
            out, present_key, present_value = g.op(
                "GroupQueryAttention", [q, k, v, buffers[0], buffers[1], seqlens, total], "gqa", n_out=3,
                domain="com.microsoft", num_heads=f.num_heads, kv_num_heads=f.num_kv_heads)
            g.output(present_key, f"present_key_{l}", FLOAT, [1, f.num_kv_heads, "capacity", f.head_dim])
            g.output(present_value, f"present_value_{l}", FLOAT, [1, f.num_kv_heads, "capacity", f.head_dim])
            h, x = self.add_and_norm(g, x, g.op("MatMul", [out, w["o"]], "o_proj"), w["post_norm"])
            branch = self.mlp(g, h, w)
            new_kv += [g.op("Reshape", [k, g.const([-1, f.num_kv_heads, f.head_dim])]),
                       g.op("Reshape", [v, g.const([-1, f.num_kv_heads, f.head_dim])])]
        return x, branch, new_kv


class SharedBufferStep:
    """The new graph with one pair of buffers per layer, bound once; `run` decodes `tokens` after `length` rows."""

    def __init__(self, session: ort.InferenceSession, layers: int, kv_heads: int, head_dim: int):
        self.session = session
        self.values = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kv_heads, CAPACITY, head_dim), np.float32))
                       for _ in range(2 * layers)]
        self.binding = session.io_binding()
        for l in range(layers):
            for j, (past, present) in enumerate((("past_key", "present_key"), ("past_value", "present_value"))):
                self.binding.bind_ortvalue_input(f"{past}_{l}", self.values[2 * l + j])
                self.binding.bind_ortvalue_output(f"{present}_{l}", self.values[2 * l + j])

    def run(self, tokens: list[int], length: int, logit_rows: list[int]) -> np.ndarray:
        n = len(tokens)
        for name, array in (("input_ids", np.array([tokens], np.int64)),
                            ("position_ids", np.arange(length, length + n, dtype=np.int64)[None]),
                            ("seqlens_k", np.array([length + n - 1], np.int32)),
                            ("total_sequence_length", np.array(length + n, np.int32)),
                            ("logit_rows", np.array(logit_rows, np.int64))):
            self.binding.bind_cpu_input(name, array)
        for name in ("logits", "new_kv"):  # their shapes follow the tokens: bound afresh, allocated by onnxruntime
            self.binding.bind_output(name)
        self.session.run_with_iobinding(self.binding)
        return self.binding.get_outputs()[-2].numpy()[0]


pipeline = Pipeline(resolve_bundle(args.bundle), threads=2)
model, _ = resolve_source("default", cache_dir()).load()
builder = SharedBufferBuilder(model, max_context=CAPACITY)
options = ort.SessionOptions()
options.intra_op_num_threads = 2
# as runtime/sessions.py makes them: spinning within a run, stopped at its end, so that the two sessions,
# which take turns, do not spin on each other's cores
options.add_session_config_entry("session.intra_op.allow_spinning", "1")
options.add_session_config_entry("session.force_spinning_stop", "1")
graph = builder.build("gqa_step").to_model()
if args.quant != "fp32":
    quantize_model(graph, QuantPolicy(QuantScheme(args.quant)))
session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
facts = builder.facts
rng = np.random.default_rng(0)

# 1. exactness of the new graph: one token at a time (two rows each) against one chunk
tokens = [int(t) for t in rng.integers(3, facts.vocab_size, 24)]
step = SharedBufferStep(session, facts.num_layers, facts.num_kv_heads, facts.head_dim)
singles = [step.run([t, t], i, [0, 0])[0] for i, t in enumerate(tokens)]  # the padding row's keys are overwritten next
chunked = SharedBufferStep(session, facts.num_layers, facts.num_kv_heads, facts.head_dim)
chunked.run(tokens[:16], 0, [15, 15])
tail = chunked.run(tokens[16:], 16, list(range(8)))
print(f"a token alone (with a padding row) == the same token in a chunk: "
      f"{sum(np.array_equal(a, b) for a, b in zip(singles[16:], tail))}/8")

# 2. a one-token step after `past` tokens, the two graphs alternating
context = [int(t) for t in rng.integers(3, facts.vocab_size, args.past)]
cache = KVCache(pipeline.manifest.target.facts, args.past + 8)
prefill(pipeline.target, cache, context, pipeline.manifest.prefill_chunk)
step = SharedBufferStep(session, facts.num_layers, facts.num_kv_heads, facts.head_dim)
step.run(context, 0, [args.past - 1] * 2)
times = {"current graph": [], "shared-buffer GroupQueryAttention": []}
for _ in range(args.repeats):
    start = time.perf_counter()
    pipeline.target.forward(cache, [5], [args.past], np.ones((1, 1), bool), [0])  # leaves the cache as it was
    times["current graph"].append(time.perf_counter() - start)
    start = time.perf_counter()
    step.run([5, 5], args.past, [0, 0])  # rewrites the same two rows of the buffers each time
    times["shared-buffer GroupQueryAttention"].append(time.perf_counter() - start)
print(f"one-token step after {args.past} tokens, {args.quant}, 2 threads, median of {args.repeats}: "
      + ", ".join(f"{name} {statistics.median(t) * 1000:.2f} ms" for name, t in times.items()))
