"""onnxruntime-genai's int4 graph stepped by plain onnxruntime (RESULTS.md §29): its per-token time with
and without spinning thread pools, to compare with edgespec's graph step for step.

    python benchmarks/ortgenai_graph_step.py [MODEL_ONNX]     (default: /tmp/ortgenai/int4/model.onnx,
                                                                built as in benchmarks/ortgenai_baseline.py)
"""
import sys, time, numpy as np, onnxruntime as ort
path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ortgenai/int4/model.onnx"
sess = {}
for spin in ("0", "1"):
    o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.log_severity_level = 3
    o.add_session_config_entry("session.intra_op.allow_spinning", spin)
    sess[spin] = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
def decode(s, P0=40, steps=100):
    pk = {f"past_key_values.{l}.{kind}": np.zeros((1, 3, 0, 64), np.float32) for l in range(30) for kind in ("key", "value")}
    ids = np.full((1, P0), 5, np.int64)
    outs = [o.name for o in s.get_outputs()]
    feed = dict(pk, input_ids=ids, attention_mask=np.ones((1, P0), np.int64))
    r = s.run(None, feed)
    times = []
    for step in range(steps):
        pres = dict(zip(outs, r))
        total = P0 + step + 1
        feed = {f"past_key_values.{l}.{kind}": pres[f"present.{l}.{kind}"] for l in range(30) for kind in ("key", "value")}
        feed.update(input_ids=np.array([[5]], np.int64), attention_mask=np.ones((1, total), np.int64))
        t0 = time.perf_counter(); r = s.run(None, feed); times.append(time.perf_counter() - t0)
    return np.median(times) * 1e3
for rep in range(2):
    for spin, s in sess.items():
        print(f"ORT-genai graph, plain onnxruntime loop, spin {spin}: {decode(s):.2f} ms per token (past 40..140)", flush=True)
