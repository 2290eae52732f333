"""Time of one target pass, graph before and after exact tree verification (RESULTS.md §28).

    python benchmarks/tree_pass_cost.py OLD_BUNDLE NEW_BUNDLE

OLD_BUNDLE: a schema-1 bundle (one shared attention sequence, attention_mask [N, P + N]); NEW_BUNDLE:
the same model exported now. Both graphs run alternately in one process at three context lengths, for
a one-token step and for the default bundle's typical tree (a drafted token and a 4-token lookup chain
that disagree at the root: two root-to-leaf paths)."""
import json, sys, time, pathlib, numpy as np, onnxruntime as ort
from edgespec.runtime.facts import ModelFacts
from edgespec.runtime.kvcache import KVCache
from edgespec.runtime.model import pass_feed, MIN_ROWS
from edgespec.runtime.tree import Topology
def old_feed(cache, tokens, positions, tree_mask, logit_rows):
    n = len(tokens); past_len = cache.length; rows = max(n, MIN_ROWS)
    mask = np.zeros((rows, past_len + rows), dtype=bool); mask[:n, :past_len] = True; mask[:n, past_len:past_len + n] = tree_mask
    ids = np.zeros((1, rows), np.int64); ids[0, :n] = tokens; pos = np.zeros((1, rows), np.int64); pos[0, :n] = positions
    for pad in range(n, rows): mask[pad, past_len + pad] = True; pos[0, pad] = positions[-1]
    wanted = np.asarray(logit_rows, np.int64)
    head = np.concatenate([wanted, np.repeat(wanted[-1:], MIN_ROWS - len(wanted))]) if len(wanted) < MIN_ROWS else wanted
    feed = cache.past(); feed.update(input_ids=ids, position_ids=pos, attention_mask=mask, logit_rows=head); return feed
def session(bundle):
    m = json.loads((pathlib.Path(bundle)/"manifest.json").read_text())
    o = ort.SessionOptions(); o.intra_op_num_threads = 2; o.log_severity_level = 3
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(pathlib.Path(bundle)/m["target"]["graph"]["file"]), o, providers=["CPUExecutionProvider"]), ModelFacts(**m["target"]["facts"])
old, facts = session(sys.argv[1]); new, _ = session(sys.argv[2])
tree = Topology((-1, 0, 0, 2, 3, 4))
anc, depth = tree.ancestor_mask, tree.depths
for past in (16, 256, 1024):
    cache = KVCache(facts, 2048); cache.data[:] = 0.05; cache.length = past
    cases = {"one token": ([5], [past], np.ones((1, 1), bool), [0]),
             "tree 2 paths x 5": ([5] * 6, past + depth, anc, range(6))}
    line = f"past {past:5d}:"
    for name, (tok, pos, mask, rows) in cases.items():
        fo = old_feed(cache, tok, pos, mask, rows); fn, _, _ = pass_feed(cache, tok, pos, mask, rows)
        t = {"old": [], "new": []}
        for rep in range(25):
            for k, s, f in (("old", old, fo), ("new", new, fn)):
                t0 = time.perf_counter(); s.run(["logits", "new_kv"], f); t[k].append(time.perf_counter() - t0)
        line += f"  {name}: old {np.median(t['old'])*1e3:6.2f} new {np.median(t['new'])*1e3:6.2f} ms"
    print(line, flush=True)
