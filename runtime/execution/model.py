"""One model's graph behind a stateless call: the caller passes tokens, positions, mask and cache."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ..contract.errors import BackendError, InputError
from ..contract.facts import ModelFacts
from ..contract.graph import ATTENTION_BIAS, FEATURES, FEATURES_OUT, GraphSignature, StaticShape
from ..contract.topology import Topology
from .kvcache import KVCache
from .sessions import ORT_ERRORS


@dataclass
class Pass:
    logits: np.ndarray  # [R, V] for the requested rows
    path_nodes: np.ndarray  # [B, L]: which new token each slot of each lane holds (its keys/values are there)
    features: np.ndarray | None = None  # [n, hidden] final hidden states, from a graph that returns them

    def lane_of(self, rows: list[int]) -> int:
        """The lane whose first slots hold tree rows `rows` (a root-first path, or a chunk's rows in order)."""
        rows = [int(r) for r in rows]
        if len(rows) <= self.path_nodes.shape[1]:
            for lane, nodes in enumerate(self.path_nodes[:, : len(rows)].tolist()):  # lists: cheaper than numpy here
                if nodes == rows:
                    return lane
        raise InputError(f"rows {list(rows)} are no lane's first slots: keep a root-first path of the tree")


def commit(cache: KVCache, out: Pass, rows) -> None:
    """Keeps tree rows `rows` of pass `out` in the cache: the accepted path after a tree pass (root
    first), or range(n) after a chunk."""
    rows = [int(r) for r in rows]
    cache.commit(out.lane_of(rows), len(rows), None if out.features is None else out.features[rows])


@dataclass(frozen=True)
class PassLayout:
    """How one pass's rows are fed: the graph inputs besides the KV buffers, and what to read back."""
    feed: dict
    rows: int  # real rows n
    wanted: np.ndarray  # the logit rows the caller asked for
    path_nodes: np.ndarray  # [B, L]

    @property
    def lanes(self) -> int:
        return len(self.path_nodes)


class ModelRunner:
    def __init__(self, session: ort.InferenceSession, facts: ModelFacts, head_tokens: np.ndarray | None = None):
        """`head_tokens`: the vocabulary ids a trimmed head's logits cover; `forward` spreads them over the
        full vocabulary with -inf elsewhere, so callers never see the trimming."""
        self.session = session
        self.facts = facts
        self.head_tokens = head_tokens
        self.signature = signature_of(session, facts)
        self.head_size = facts.vocab_size if head_tokens is None else len(head_tokens)
        self.min_rows = self.signature.min_rows  # what a one-token step runs: set by the device's check
        self.run_seconds = 0.0  # time inside onnxruntime, all passes so far: `bench` reports the rest as Python's

    @property
    def lanes(self) -> int:
        return self.signature.lanes

    @property
    def static(self) -> StaticShape | None:
        return self.signature.static

    @property
    def reads_features(self) -> bool:
        return self.signature.reads_features

    @property
    def gives_features(self) -> bool:
        return self.signature.gives_features

    @property
    def graph_min_rows(self) -> int:
        """What the graph guarantees on any device."""
        return self.signature.min_rows

    kernels = "packed"  # onnxruntime prepacks the graph's weights: the kernels its exactness verdict was measured on

    def new_cache(self, capacity: int, feature_size: int = 0) -> KVCache:
        """A cache this graph can run on: `capacity` tokens, or a static graph's own context."""
        if self.static is None:
            return KVCache(self.facts, capacity, feature_size, lanes=self.lanes)
        return KVCache(self.facts, self.static.context, feature_size, lanes=self.lanes, **self.static.buffer())

    @property
    def pass_limit(self) -> int | None:
        """The most tokens one pass takes (a static graph's nodes), None without a limit."""
        return self.signature.pass_limit

    @property
    def tree_limit(self) -> int | None:
        """The most nodes one verified tree takes: a static graph's, as every pass."""
        return self.signature.pass_limit

    def forward(self, cache: KVCache, tokens, positions, tree_mask: np.ndarray, logit_rows,
                past_mask: np.ndarray | None = None, features: np.ndarray | None = None,
                exact_rows: bool = True) -> Pass:
        """Runs n new tokens after the cache's valid rows. The pass writes their keys/values into the
        cache's lanes after the valid rows; `commit` keeps the ones the caller wants.

        tree_mask [n, n]: which new tokens each new token may see (itself included);
        past_mask [n, cache.length]: which cached rows it may see (default: all);
        features [n, hidden]: for a graph that reads them, the features that go with each new token;
        exact_rows: see pass_feed.
        """
        layout = pass_feed(cache, self.signature, tokens, positions, tree_mask, logit_rows, past_mask, exact_rows,
                           self.min_rows)
        feed = layout.feed
        rows = feed["input_ids"].shape[1]
        if self.reads_features:
            feed[FEATURES] = padded_features(features, rows, self.facts.hidden_size)
        outputs = {"logits": (len(feed["logit_rows"]), self.head_size)}
        if self.gives_features:
            outputs[FEATURES_OUT] = (rows, self.facts.hidden_size)
        started = time.perf_counter()
        values = run_bound(self.session, cache, feed, outputs)
        self.run_seconds += time.perf_counter() - started
        logits = values["logits"][: len(layout.wanted)]
        if self.head_tokens is not None:
            full = np.full((len(layout.wanted), self.facts.vocab_size), -np.inf, dtype=logits.dtype)
            full[:, self.head_tokens] = logits
            logits = full
        return Pass(logits=logits, path_nodes=layout.path_nodes,
                    features=values[FEATURES_OUT][: layout.rows] if self.gives_features else None)


def run_bound(session: ort.InferenceSession, cache: KVCache, feed: dict,
              outputs: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Runs `session` with the cache's buffers bound (cache.binding) and the inputs in `feed` that it
    takes; returns the named outputs, each [rows, width] as given, written by onnxruntime straight into
    arrays allocated here."""
    bound = cache.binding(session)
    for name in bound.inputs:
        bound.bind(name, feed[name])
    binding = bound.binding
    arrays = {}
    for name, (rows, width) in outputs.items():
        arrays[name] = np.empty((rows, width), np.float32)
        binding.bind_output(name, "cpu", 0, np.float32, [1, rows, width], arrays[name].ctypes.data)
    try:
        session.run_with_iobinding(binding)
    except ORT_ERRORS as err:
        raise BackendError(f"onnxruntime {ort.__version__} failed in a pass ({type(err).__name__}): {str(err)[:300]} "
                           "(if `edgespec inspect --check-exact` passes on the bundle, this is a bug: please report "
                           "it)") from err
    return arrays


def signature_of(session: ort.InferenceSession, facts: ModelFacts) -> GraphSignature:
    """The graph's signature, from what its session declares."""
    return GraphSignature.read(facts, {i.name: i.shape for i in session.get_inputs()},
                               [o.name for o in session.get_outputs()], session.get_modelmeta().custom_metadata_map)


def padded_features(features: np.ndarray | None, rows: int, hidden: int) -> np.ndarray:
    """[1, rows, hidden]: the given features, then zero rows for the padding tokens."""
    if features is None:
        raise InputError("this draft reads the target's features: pass them with the tokens")
    out = np.zeros((1, rows, hidden), np.float32)
    out[0, : len(features)] = features
    return out


def pass_feed(cache: KVCache, graph: GraphSignature, tokens, positions, tree_mask: np.ndarray, logit_rows,
              past_mask=None, exact_rows: bool = True, min_rows: int | None = None) -> PassLayout:
    """The inputs `graph` takes for one pass, padded to `min_rows` rows if exact (default: the graph's; the
    device's check may lower it). A static-shape graph's rows, slots, logit rows and attention bias are padded
    to its sizes (the padding is never read).

    exact_rows: each root-to-leaf path of `tree_mask` attends in a lane of its own, at the columns
    plain decoding gives it, so every row has plain decoding's bits (exporters/llama.py says why);
    `tree_mask` must then be an ancestor mask, and each row's position is the cache length plus its
    depth. False puts all rows in one lane, at `positions`, masked by `tree_mask` and `past_mask`
    through the attention bias (a draft's passes, whose rows need not match anything).
    A graph without an attention bias (a target's) is refused a pass that would need one (rows that are
    not exact, a mask over the past); a graph of one lane takes no head gathers.
    """
    static, explicit_mask, attention_bias = graph.static, graph.explicit_mask, graph.attention_bias
    exact_min_rows = graph.min_rows if min_rows is None else min_rows
    if not attention_bias and (not exact_rows or past_mask is not None or explicit_mask):
        raise InputError("this graph attends under the op's causal mask alone (a target's graph): it runs exact "
                         "passes without a mask over the past")
    n = len(tokens)
    past_len = cache.length
    min_rows = static.nodes if static else exact_min_rows if exact_rows else 1
    if static and n > static.nodes:
        raise InputError(f"{n} tokens in one pass of a static-shape graph of {static.nodes} nodes")
    rows = max(n, min_rows)
    ids = np.array([[*tokens, *[0] * (rows - n)]], dtype=np.int64)
    tree_mask = np.asarray(tree_mask, dtype=bool)
    paths = [list(range(n))] if not exact_rows or _is_chain(tree_mask) else \
        [list(p) for p in Topology.from_ancestor_mask(tree_mask).root_to_leaf_paths]
    if len(paths) > cache.lanes:
        raise InputError(f"the tree has {len(paths)} root-to-leaf paths but the graph attends in {cache.lanes} "
                         "lanes: cut it with Tree.within_paths")
    paths[0] = paths[0] + list(range(n, rows))  # padding rows go last in the first lane: no real row sees them
    # the attention op's one-query path rounds unlike its multi-query one (5e-7, history.md §41): an exact
    # pass gives it two slots even when its matmuls run one row (the second repeats the first)
    slots = static.nodes if static else max(max(len(path) for path in paths), 2 if exact_rows else 1)
    # unused slots repeat the last token (their rows are never read); unused lanes repeat the first (the
    # graph computes every lane). Lists, then one array: each numpy call costs microseconds after a run.
    lane_nodes = [path + [path[-1]] * (slots - len(path)) for path in paths]
    path_nodes = np.array(lane_nodes + lane_nodes[:1] * (cache.lanes - len(paths)), dtype=np.int64)
    cache.reserve(past_len + slots)
    total = past_len + slots
    # a static graph's bias covers the whole buffer; the op reads only the first `total` columns
    columns = static.capacity if static else total
    bias = np.zeros((1, 1, slots, columns), np.float32) if attention_bias else None  # only exact passes get None
    if exact_rows:
        position_ids = np.arange(past_len, past_len + slots, dtype=np.int64)[None]
        if past_mask is not None:
            if len(paths) > 1:
                raise InputError("a mask over the past applies to one lane: give exact rows a chain")
            bias[0, 0, :n, :past_len] = np.where(np.asarray(past_mask, dtype=bool), 0, -np.inf)
    else:
        node_positions = np.empty(rows, dtype=np.int64)
        node_positions[:n] = positions
        node_positions[n:] = node_positions[n - 1]
        position_ids = node_positions[path_nodes[:1]]
        bias[0, 0, :n, past_len : past_len + n] = np.where(tree_mask, 0, -np.inf)
        if past_mask is not None:
            bias[0, 0, :n, :past_len] = np.where(np.asarray(past_mask, dtype=bool), 0, -np.inf)
    if explicit_mask:
        bias[0, 0, :, total:] = -np.inf
        bias[0, 0, :, past_len:total][np.triu(np.ones((slots, slots), dtype=bool), 1)] = -np.inf
    wanted = np.asarray(logit_rows, dtype=np.int64)
    head_rows = np.concatenate([wanted, np.repeat(wanted[-1:], min_rows - len(wanted))]) if len(wanted) < min_rows \
        else wanted
    feed = dict(input_ids=ids, position_ids=position_ids, logit_rows=head_rows,
                seqlens_k=np.array([total - 1], np.int32), total_sequence_length=np.array(columns, np.int32))
    if attention_bias:
        feed[ATTENTION_BIAS] = bias
    if graph.head_gathers:
        node_slots = np.zeros(rows, dtype=np.int64)
        for b, path in enumerate(paths):
            node_slots[path] = b * slots + np.arange(len(path))  # a node on several lanes has the same bits on each
        feed["qkv_rows"], feed["out_rows"] = head_rows_of(path_nodes, node_slots, graph.heads)
    return PassLayout(feed=feed, rows=n, wanted=wanted, path_nodes=path_nodes)


def head_rows_of(path_nodes: np.ndarray, node_slots: np.ndarray, heads: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The graph's head gathers for lanes `path_nodes` [B, L] (exporters/llama.py): qkv_rows [L, B * (H + 2 kvH)]
    picks each lane's q, k and v heads of the token in each slot, in the op's packed order (every lane's
    q heads, then k, then v); out_rows [N, H] picks each token's output heads from its slot b * L + k."""
    q_heads, kv_heads = heads
    width = q_heads + 2 * kv_heads
    lanes, slots = path_nodes.shape
    base = path_nodes.T[:, :, None] * width  # [L, B, 1]: the token's first head row
    q = base + np.arange(q_heads)
    k = base + q_heads + np.arange(kv_heads)
    v = base + q_heads + kv_heads + np.arange(kv_heads)
    qkv_rows = np.concatenate([part.reshape(slots, -1) for part in (q, k, v)], axis=1)
    lane, slot = np.divmod(node_slots, slots)
    out_rows = ((slot * lanes + lane) * q_heads)[:, None] + np.arange(q_heads)
    return qkv_rows, out_rows


def _is_chain(mask: np.ndarray) -> bool:
    """Whether every row sees itself and all earlier rows (one path: no need to look for others)."""
    if mask.shape == (1, 1):  # a plain step's: answered without numpy's calls, slow after a run's cache misses (history.md §55)
        return bool(mask[0, 0])
    return bool(np.array_equal(mask, np.tri(len(mask), dtype=bool)))


def prefill(runner: ModelRunner, cache: KVCache, tokens, chunk: int, features: np.ndarray | None = None,
            on_rows=None) -> np.ndarray:
    """Appends `tokens` to the cache in causal chunks (with their input `features` for a graph that
    reads them); returns the last token's logits [V]. A static graph's chunks are at most its nodes.
    `on_rows(start, logits [n, V])`: every token's logits, chunk by chunk (a prompt's scoring)."""
    chunk = min(chunk, runner.pass_limit or chunk)
    logits = None
    for start in range(0, len(tokens), chunk):
        part = list(tokens[start : start + chunk])
        n = len(part)
        out = runner.forward(cache, part, range(cache.length, cache.length + n),
                             np.tril(np.ones((n, n), dtype=bool)), range(n) if on_rows else [n - 1],
                             features=None if features is None else features[start : start + n])
        if on_rows:
            on_rows(start, out.logits[:n])
        commit(cache, out, range(n))
        logits = out.logits[n - 1 if on_rows else 0]
    return logits
