"""Whether this device keeps a token's bits whatever pass computes it: the check behind "lossless".

Greedy speculative output is plain decoding's output only if a token's logits and keys/values are the
same bits in a one-token step (padded to the graph's exact_min_rows), in a prefill chunk, and as a node of a verified
tree (runtime/execution/model.py says how the graph arranges that). What it rests on is how onnxruntime's CPU
kernels round, and those differ by instruction set (AVX2, AVX-512, NEON, SME) and by release. The tests
prove it where they run; `check_exact_rows` proves it for one bundle's target on the device at hand
(`edgespec inspect BUNDLE --check-exact`), and returns every row that differs rather than stopping at one.

How many rows a one-token step needs is measured here too (`fewest_exact_rows`). Where the device's
one-row kernels round as its multi-row ones (history.md §49: MatMulNBits at accuracy level 4 with
AVX-512 VNNI), a step runs one row, as onnxruntime-genai's does; where they do not (§40: the same op on
AVX2 without VNNI), a padding row keeps every matmul on its multi-row kernel. Plain and speculative
decoding on one device always run the same count, so they compare the same bits.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..execution.device import describe, features_known, machine_key
from ..execution.kvcache import KVCache
from ..execution.model import ModelRunner, Pass, commit, prefill
from .tree import Tree

# Siblings sit between a node and its ancestors in a tree pass: node 5's path 0-2-5 has nodes 1, 3 and 4
# in between. The tree is wider than MLAS's 6-row blocks; its five paths run in lanes of their own, cut
# to the graph's lanes as the runtime cuts trees.
TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 2, 3, 5, 5, 8)


@dataclass(frozen=True)
class RowMismatch:
    # "prefill": a token's cached keys/values from prefill chunks against one-token steps; "chunk": a
    # token in a pass of several against a one-token step; "tree": a tree's node against plain decoding
    check: str
    row: int  # the token's position in the context, or the tree node
    max_abs_diff: float  # over its logits (where compared) and its keys/values


def _mismatch(check: str, row: int, pairs) -> RowMismatch | None:
    if all(np.array_equal(a, b) for a, b in pairs):
        return None
    return RowMismatch(check, row, float(max(np.max(np.abs(a - b)) for a, b in pairs)))


def _random_tokens(runner: ModelRunner, rng: np.random.Generator, count: int) -> list[int]:
    return [int(t) for t in rng.integers(3, runner.facts.vocab_size, count)]


def _step(runner: ModelRunner, cache: KVCache, token: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain decoding's one-token pass; appends the token to the cache. Returns its logits [V] and its
    keys/values [layers, 2, kv_heads, head_dim]."""
    out = runner.forward(cache, [token], [cache.length], np.ones((1, 1), bool), [0])
    kv = new_rows(cache, out, [0])[:, :, :, 0]
    commit(cache, out, [0])
    return out.logits[0], kv


def new_rows(cache: KVCache, out: Pass, nodes) -> np.ndarray:
    """The keys/values pass `out` wrote for tree rows `nodes` [layers, 2, kv_heads, len(nodes), head_dim],
    read where it wrote them (before a commit moves the cache on)."""
    where = [np.argwhere(out.path_nodes == node)[0] for node in nodes]
    return np.stack([cache.data[:, :, lane, :, cache.length + slot] for lane, slot in where], axis=3)


def chunk_mismatches(runner: ModelRunner, seed: int, prefix: int, chunk: int, tail: int = 10) -> list[RowMismatch]:
    """The last `tail` of prefix + tail random tokens, decoded one at a time, against the same tokens in one
    pass after a prefill in chunks of `chunk`: logits and keys/values of every token."""
    ids = _random_tokens(runner, np.random.default_rng(seed), prefix + tail)
    capacity = prefix + tail
    alone = runner.new_cache(capacity)
    singles = [_step(runner, alone, token) for token in ids]
    together = runner.new_cache(capacity)
    prefill(runner, together, ids[:prefix], chunk)
    out = runner.forward(together, ids[prefix:], range(prefix, prefix + tail), np.tril(np.ones((tail, tail), bool)),
                         range(tail))
    kv = new_rows(together, out, range(tail))
    found = [_mismatch("prefill", i, [(together.rows(i, i + 1), alone.rows(i, i + 1))]) for i in range(prefix)]
    found += [_mismatch("chunk", prefix + i, [(out.logits[i], singles[prefix + i][0]),
                                             (kv[:, :, :, i], singles[prefix + i][1])])
              for i in range(tail)]
    return [m for m in found if m is not None]


def tree_mismatches(runner: ModelRunner, seed: int, prefix: int,
                    parents: tuple[int, ...] = TREE_PARENTS) -> list[RowMismatch]:
    """Every node of a tree of random tokens verified in one pass, against plain decoding of its path (one
    token at a time after the same context): logits and keys/values."""
    rng = np.random.default_rng(seed)
    context = _random_tokens(runner, rng, prefix)
    # a graph attends in a fixed number of lanes; the runtime cuts trees with more paths, and so does this
    tree = checked_tree(runner, Tree.from_parents(tuple(parents), _random_tokens(runner, rng, len(parents))))
    chunk = min(8, runner.pass_limit or 8)
    topology, tokens = tree.topology, [int(t) for t in tree.tokens]
    capacity = prefix + topology.size
    cache = runner.new_cache(capacity)
    prefill(runner, cache, context, chunk)
    tree = runner.forward(cache, tokens, cache.length + topology.depths, topology.ancestor_mask, range(topology.size))
    kv = new_rows(cache, tree, range(topology.size))
    found = []
    for node in range(topology.size):
        plain = runner.new_cache(capacity)
        prefill(runner, plain, context, chunk)
        for step in topology.path_to(node):
            alone = _step(runner, plain, tokens[step])
        found.append(_mismatch("tree", node, [(tree.logits[node], alone[0]), (kv[:, :, :, node], alone[1])]))
    return [m for m in found if m is not None]


def checked_tree(runner, tree: Tree) -> Tree:
    """The tree as the runtime would verify it with this graph: cut to its lanes and to a static graph's nodes."""
    tree = tree.within_paths(runner.lanes)
    limit = runner.pass_limit
    if limit is not None and tree.size > limit:
        tree = Tree(tree.topology.prefix(limit), tree.tokens[:limit])
    return tree


# (seed, prefix) of each check: contexts that end at different offsets within MLAS's blocks
CHUNK_CHECK = (5, 30)
TREE_CHECKS = ((6, 29), (7, 13))
CHUNK, TAIL = 16, 10


@dataclass(frozen=True)
class Verdict:
    """Whether speculation keeps plain decoding's bits on this device, and why it is believed."""

    exact: bool
    reason: str
    min_rows: int  # the rows a one-token step runs here: 1 where one row keeps the bits, else the graph's

    def to_dict(self) -> dict:
        return {"exact": self.exact, "reason": self.reason, "min_rows": self.min_rows}


def verdict_here(recorded: dict | None, target_checksum: str, runner, cache_root: Path) -> Verdict:
    """The bundle's verdict for this device: the one recorded at export if it was this device (onnxruntime
    release and CPU), else one cached by an earlier load here, else the check runs now (seconds) and its
    verdict is cached for the next load."""
    here = machine_key()
    # the export checked the single graph on packed weights; stages read unpacked round otherwise (runtime/execution/staged.py)
    packed = runner.kernels == "packed"
    # a device whose CPU features cannot be read cannot tell itself from another of its kind: check it
    if packed and recorded and features_known() and recorded.get("machine") == here \
            and isinstance(recorded.get("exact"), bool) and _valid_rows(recorded.get("min_rows")):
        return Verdict(recorded["exact"], f"checked at export, {describe()}", recorded["min_rows"])
    # "rows": verdicts from before the one-row trial (they name no min_rows) are checked again
    kernels = "" if packed else f"-{runner.kernels}"
    place = Path(cache_root) / "exactness" / f"{target_checksum[:32]}-{here}{kernels}-rows.json"
    cached = _cached_verdict(place)
    if cached is not None:
        return cached
    min_rows, compared, differ = fewest_exact_rows(runner)
    verdict = Verdict(not differ, f"checked on first load, {describe()}: "
                      + (f"{compared} of {compared} rows keep their bits" if not differ else
                         f"{len(differ)} of {compared} rows differ from plain decoding")
                      + f"; one-token steps run {min_rows} row{'s' if min_rows > 1 else ''}", min_rows)
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next load a check, nothing more
        place.parent.mkdir(parents=True, exist_ok=True)
        partial = place.with_name(f"{place.name}.{os.getpid()}.partial")  # loads in parallel never share it
        partial.write_text(json.dumps(verdict.to_dict()), encoding="utf-8")
        partial.replace(place)
    return verdict


def _cached_verdict(place: Path) -> Verdict | None:
    """An earlier load's verdict; None when there is none or it cannot be read (then the check runs)."""
    try:
        cached = json.loads(place.read_text(encoding="utf-8"))
        if not _valid_rows(cached["min_rows"]):
            return None
        return Verdict(bool(cached["exact"]), str(cached["reason"]), cached["min_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _valid_rows(value) -> bool:
    return type(value) is int and value in (1, 2)


def fewest_exact_rows(runner, check=None) -> tuple[int, int, list[RowMismatch]]:
    """Sets `runner.min_rows` to the fewest rows a one-token step needs on this device for every row to
    keep its bits: one where the check passes at one row, else the graph's own minimum (a padding row).
    Returns (min_rows, rows compared, the rows that differ at that count). `check`: check_exact_rows."""
    check = check or check_exact_rows
    graph_rows = runner.graph_min_rows
    if graph_rows > 1 and runner.static is None:  # a static graph always runs all its rows
        runner.min_rows = 1
        try:
            compared, differ = check(runner)
        finally:  # one row stays only if proven: a check that fails midway leaves the graph's own minimum
            runner.min_rows = graph_rows
        if not differ:
            runner.min_rows = 1
            return 1, compared, differ
    compared, differ = check(runner)
    return graph_rows, compared, differ


def check_exact_rows(runner: ModelRunner) -> tuple[int, list[RowMismatch]]:
    """Both checks on a verifying target, with fixed seeds: (rows compared, the rows that differ)."""
    seed, prefix = CHUNK_CHECK
    limit = runner.pass_limit or CHUNK
    tail = min(TAIL, limit)
    found = chunk_mismatches(runner, seed, prefix, min(CHUNK, limit), tail)
    for seed, tree_prefix in TREE_CHECKS:
        found += tree_mismatches(runner, seed, tree_prefix)
    compared = sum(checked_tree(runner, Tree.from_parents(TREE_PARENTS, [0] * len(TREE_PARENTS))).size
                   for _ in TREE_CHECKS)
    return prefix + tail + compared, found
