"""onnxruntime's fused GroupQueryAttention on this CPU: are its rows shape-invariant, and what does it cost?

    python benchmarks/gqa_probe.py

SmolLM2's attention shape (9 query heads, 3 kv heads, head dim 64), past and present as separate
tensors (no shared buffer). For random pasts and chains of 2-8 new tokens: whether each token's output
row computed in one call for the whole chain has the same bits as the same token computed in a call of
its own (one row), or of its own plus a padding row after it (two rows, the padding's keys and values
dropped again, as edgespec's one-token steps do). Then microseconds per call by past length: with past
and present as separate tensors (the op copies the past), and sharing one preallocated buffer bound
through IOBinding (nothing copied; onnxruntime-genai's way), with whether the two give the same bits.
"""
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def value_info(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, shape)


node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"],
                        ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=HEADS,
                        kv_num_heads=KV_HEADS)
graph = helper.make_graph(
    [node], "gqa",
    [value_info("q", TensorProto.FLOAT, [1, "s", HEADS * HEAD_DIM]),
     value_info("k", TensorProto.FLOAT, [1, "s", KV_HEADS * HEAD_DIM]),
     value_info("v", TensorProto.FLOAT, [1, "s", KV_HEADS * HEAD_DIM]),
     value_info("past_k", TensorProto.FLOAT, [1, KV_HEADS, "p", HEAD_DIM]),
     value_info("past_v", TensorProto.FLOAT, [1, KV_HEADS, "p", HEAD_DIM]),
     value_info("seqlens_k", TensorProto.INT32, [1]), value_info("total", TensorProto.INT32, [])],
    [value_info("out", TensorProto.FLOAT, [1, "s", HEADS * HEAD_DIM]),
     value_info("present_k", TensorProto.FLOAT, [1, KV_HEADS, "t", HEAD_DIM]),
     value_info("present_v", TensorProto.FLOAT, [1, KV_HEADS, "t", HEAD_DIM])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
options = ort.SessionOptions()
options.intra_op_num_threads = 2
session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)


def attend(q, k, v, past_k, past_v):
    total = past_k.shape[2] + q.shape[1]
    return session.run(None, {"q": q, "k": k, "v": v, "past_k": past_k, "past_v": past_v,
                              "seqlens_k": np.array([total - 1], np.int32), "total": np.array(total, np.int32)})


def random(*shape):
    return rng.standard_normal(shape).astype(np.float32)


for _ in range(6):
    past, length = int(rng.integers(5, 300)), int(rng.integers(2, 9))
    past_k, past_v = random(1, KV_HEADS, past, HEAD_DIM), random(1, KV_HEADS, past, HEAD_DIM)
    q, k, v = random(1, length, HEADS * HEAD_DIM), random(1, length, KV_HEADS * HEAD_DIM), random(1, length, KV_HEADS * HEAD_DIM)
    chain = attend(q, k, v, past_k, past_v)[0][0]
    same = {}
    for rows in (1, 2):
        cache_k, cache_v, outputs = past_k, past_v, []
        for t in range(length):
            pick = [t] * rows  # the token, then (rows == 2) a padding copy of it that no real row sees
            out, cache_k, cache_v = attend(q[:, pick], k[:, pick], v[:, pick], cache_k, cache_v)
            outputs.append(out[0, 0])
            cache_k, cache_v = cache_k[:, :, : past + t + 1], cache_v[:, :, : past + t + 1]
        same[rows] = sum(np.array_equal(o, c) for o, c in zip(outputs, chain))
    print(f"past {past:3d}, chain of {length}: rows equal to the chain's, one-row calls {same[1]}/{length}, "
          f"two-row calls {same[2]}/{length}")

MAX_CONTEXT = 2048


def micros(run, calls: int = 300) -> float:
    for _ in range(20):
        run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls * 1e6


def shared_buffer_call(q, k, v, buffer_k, buffer_v, past: int):
    """A bound call whose past and present are the same [1, kv heads, MAX_CONTEXT, head dim] buffers: the
    new keys/values are written in place after the `past` valid rows."""
    values_k, values_v = ort.OrtValue.ortvalue_from_numpy(buffer_k), ort.OrtValue.ortvalue_from_numpy(buffer_v)
    binding = session.io_binding()
    for name, array in (("q", q), ("k", k), ("v", v), ("seqlens_k", np.array([past + q.shape[1] - 1], np.int32)),
                        ("total", np.array(past + q.shape[1], np.int32))):
        binding.bind_cpu_input(name, array)
    binding.bind_ortvalue_input("past_k", values_k)
    binding.bind_ortvalue_input("past_v", values_v)
    binding.bind_ortvalue_output("present_k", values_k)
    binding.bind_ortvalue_output("present_v", values_v)
    binding.bind_output("out")
    return binding


for past in (16, 256, 1024):
    for rows in (2, 6):
        q, k, v = random(1, rows, HEADS * HEAD_DIM), random(1, rows, KV_HEADS * HEAD_DIM), random(1, rows, KV_HEADS * HEAD_DIM)
        buffer_k, buffer_v = random(1, KV_HEADS, MAX_CONTEXT, HEAD_DIM), random(1, KV_HEADS, MAX_CONTEXT, HEAD_DIM)
        past_k, past_v = buffer_k[:, :, :past].copy(), buffer_v[:, :, :past].copy()
        binding = shared_buffer_call(q, k, v, buffer_k, buffer_v, past)
        shared = micros(lambda: session.run_with_iobinding(binding))
        separate = micros(lambda: attend(q, k, v, past_k, past_v))
        same = np.array_equal(binding.copy_outputs_to_cpu()[2], attend(q, k, v, past_k, past_v)[0])  # outputs in binding order
        print(f"past {past:4d}, {rows} rows: shared buffer {shared:4.0f} us, separate {separate:4.0f} us per call "
              f"(30 layers: {shared * 30 / 1000:.2f} / {separate * 30 / 1000:.2f} ms); same bits: {same}")
