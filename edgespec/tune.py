"""`edgespec tune`: measure acceptance and pass cost on this device, choose the tree, write it into the bundle.

1. acceptance by depth and sibling rank: speculative decoding of calibration prompts with a probe
   tree, counting, at every accepted node, which rank of candidate (if any) the target continued with;
2. cost: the target pass's time for every node count at a typical context length, and the draft's
   time per level of depth;
3. the tree maximizing expected tokens per second (runtime/decoding/treeopt.py), and the best chain;
4. both measured end to end on the same prompts, so the prediction can be checked.

Beside a draft model, prompt lookup (`export --lookup K --lookup-quote Q`) is chosen too: calibration
leaves it out, and for each candidate (none; K in LOOKUP_CHOICES with Q = QUOTE_TOKENS; the bundle's
own) the tree is chosen with a tree of n nodes costed at n + K, then measured end to end against plain
decoding in the same run; the candidate with the best speedup is written with its tree. The longer
chain while quoting is not costed: it is drafted only where the context quotes itself. The prediction
counts the draft model's tokens only, so with a lookup it is a floor: the lookup's accepted tokens come
on top.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from edgespec.bench import load_prompts, prompt_kwargs, run_bench
from edgespec.runtime.contract.drafting import DrafterKind, LookupConfig
from edgespec.runtime.contract.errors import ContextOverflowError, InputError
from edgespec.runtime.contract.manifest import read_manifest, write_manifest
from edgespec.runtime.contract.topology import Topology
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.treeopt import choose_tree
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import ModelRunner, prefill
from edgespec.runtime.pipeline import Pipeline

PROBE_WIDTH, PROBE_DEPTH = 4, 6
# Lookup lengths measured beside a draft model (and the bundle's own): what a lookup token costs depends
# on the device and the weights (nearly nothing on fp32 here, a lot on int4: history.md §30). While the
# context quotes itself the chain runs to QUOTE_TOKENS; with K = 0 that is the only lookup, which int4
# weights favour (§32).
LOOKUP_CHOICES = (0, 2, 4)
QUOTE_TOKENS = 10
MIN_OPPORTUNITIES = 20  # a depth reached fewer times than this is too thin to give its own rates


def probe_topology(width: int = PROBE_WIDTH, depth: int = PROBE_DEPTH) -> Topology:
    """A spine of top candidates `depth` deep, each spine node with `width` candidates: the target's
    choice is seen by rank at every depth the drafter's best guesses reach (4 x 6 + 1 = 25 nodes)."""
    parents, spine = [-1], 0
    for _ in range(depth):
        first = len(parents)
        parents += [spine] * width
        spine = first
    return Topology(tuple(parents))


class AcceptanceCounter:
    """Wraps a drafter; after every step counts, per depth and sibling rank, the times a node at that
    depth was reached with candidates below it (opportunities) and which rank the target continued with."""

    def __init__(self, inner, ranks: int = PROBE_WIDTH, depths: int = PROBE_DEPTH):
        self.inner, self.tree = inner, None
        self.opportunities = np.zeros(depths)
        self.hits = np.zeros((depths, ranks))
        self.draft_seconds, self.draft_levels = 0.0, 0

    def propose(self, committed, max_nodes, sampler, target_features=None):
        start = time.perf_counter()
        self.tree = self.inner.propose(committed, max_nodes, sampler, target_features)
        self.draft_seconds += time.perf_counter() - start
        self.draft_levels += self.tree.topology.max_depth
        return self.tree

    def observe(self, accepted, tokens=None, logits=None):
        self.inner.observe(accepted, tokens, logits)
        if tokens is None or self.tree is None:
            return
        topo, node = self.tree.topology, 0
        for token in accepted[:-1] + [None]:  # the accepted drafts, then the bonus (never a tree node)
            kids = topo.children[node]
            depth = int(topo.depths[node])
            if not kids or depth >= len(self.opportunities):
                break
            self.opportunities[depth] += 1
            rank = next((r for r, c in enumerate(kids) if token is not None and int(self.tree.tokens[c]) == token), None)
            if rank is None or rank >= self.hits.shape[1]:
                break
            self.hits[depth, rank] += 1
            node = kids[rank]

    def rewind(self, length):
        self.inner.rewind(length)

    @property
    def acceptance(self) -> np.ndarray:
        """[depth, rank] rates, for the depths reached at least MIN_OPPORTUNITIES times (depth 1 always)."""
        rows = max(1, int(np.sum(np.cumprod(self.opportunities >= MIN_OPPORTUNITIES))))
        opportunities = self.opportunities[:rows, None]
        return np.divide(self.hits[:rows], opportunities, out=np.zeros_like(self.hits[:rows]), where=opportunities > 0)


def pass_seconds(runner: ModelRunner, prefill_chunk: int, sizes, past: int, repeats: int,
                 star: bool = False) -> dict[int, float]:
    """Median time of one pass of `runner` (target or draft) with n nodes after `past` cached tokens,
    logits for every node: a chain of n, or with `star` the root and n - 1 children (n - 1 leaves).
    A draft that reads the target's features gets zeros: a pass costs the same whatever they hold."""
    facts = runner.facts
    cache = KVCache(facts, max(past + max(sizes) + 1, 8), lanes=runner.lanes)
    rng = np.random.default_rng(0)

    def features(rows: int) -> np.ndarray | None:
        return np.zeros((rows, facts.hidden_size), np.float32) if runner.reads_features else None

    prefill(runner, cache, list(rng.integers(3, facts.vocab_size, past)), prefill_chunk, features(past))
    out = {}
    for n in sizes:
        tokens, times = rng.integers(3, facts.vocab_size, n), []
        for _ in range(repeats):
            start = time.perf_counter()
            topology = Topology((-1,) + (0,) * (n - 1) if star else tuple(range(-1, n - 1)))
            runner.forward(cache, tokens, past + topology.depths, topology.ancestor_mask, range(n),
                           features=features(n))
            times.append(time.perf_counter() - start)
        out[n] = statistics.median(times)
    return out


def tune(folder: Path, prompts_file: Path | None, max_nodes: int, max_new_tokens: int, threads: int | None,
         write: bool = True) -> dict:
    pipeline = Pipeline(folder, threads)
    if pipeline.manifest.dynamic is not None:
        raise InputError(f"{folder} grows a dynamic tree each step (dynamic:{pipeline.manifest.dynamic.budget}); tune "
                         "chooses a static one: export the bundle with --tree auto or a static tree to tune it")
    if pipeline.manifest.drafter is DrafterKind.TEXT:
        raise InputError(f"{folder} drafts a chain through text (a draft of another tokenizer), whose length is "
                         "set at export: export it again with --tree chain:N to change it")
    if pipeline.manifest.drafter is DrafterKind.SUFFIX:
        raise InputError(f"{folder} drafts by suffix alone, whose tree the step controller chooses each step from "
                         "this device's measured pass costs: there is no static tree to tune")
    prompts = load_prompts(prompts_file)
    lookup = pipeline.lookup
    counter = _measure_acceptance(pipeline, prompts, max_new_tokens)
    choices = lookup_choices(pipeline, lookup)
    most = max(config.tokens if config else 0 for config in choices)
    verify, leaf = _measure_costs(pipeline, max_nodes + most)
    draft_per_level = counter.draft_seconds / max(counter.draft_levels, 1)
    # 3. for each lookup candidate, choose the tree (a step costs the target pass plus one draft call per
    # level) and 4. measure it end to end, as a fresh pipeline would run it (a recycling table kept from
    # calibration would already hold the target's answers to these prompts); keep the fastest
    runs = {}
    for config in choices:
        k = config.tokens if config else 0
        tree, chain = choose_tree(counter.acceptance, {n: verify[n + k] for n in range(1, max_nodes + 1)},
                                  draft_per_level, {n: leaf.get(n + k, 0.0) for n in range(1, max_nodes + 1)},
                                  extra_leaves=int(k > 0), max_paths=pipeline.target.lanes)
        runs[config] = (tree, chain, run_bench(pipeline.with_drafting(tree.topology, config), prompts, max_new_tokens))
    best = max(runs, key=lambda c: runs[c][2]["speedup"])  # against plain decoding in the same run: drift cancels
    tree, chain, _ = runs[best]
    # the winner of several noisy runs is measured again: its own selection run is biased upwards
    # (the best of k draws), and the chain it is compared with gets one unselected run too
    measured = run_bench(pipeline.with_drafting(tree.topology, best), prompts, max_new_tokens)
    chain_measured = run_bench(pipeline.with_drafting(chain.topology, best), prompts, max_new_tokens)
    if write:
        write_tree(folder, tree.topology, best)
    return {
        "tree": tree.topology.to_dict(),
        "predicted_tokens_per_s": round(tree.tokens_per_s, 2),
        "measured_tokens_per_s": measured["speculative"]["tokens_per_s"],
        "measured_tokens_per_pass": measured["speculative"]["mean_accepted_per_pass"],
        "predicted_tokens_per_pass": round(tree.expected_tokens, 3),
        "best_chain": chain.topology.to_dict(),
        "best_chain_predicted_tokens_per_s": round(chain.tokens_per_s, 2),
        "best_chain_tokens_per_s": chain_measured["speculative"]["tokens_per_s"],
        "plain_tokens_per_s": measured["plain"]["tokens_per_s"],
        # each against plain decoding in its own run: the fair way to compare the two across runs
        "measured_speedup": measured["speedup"],
        "best_chain_speedup": chain_measured["speedup"],
        "lookup": lookup_label(best),
        "lookup_tokens": best.tokens if best else 0,
        "lookup_quote_tokens": best.quote_tokens if best else 0,
        "speedup_by_lookup": {lookup_label(c): run[2]["speedup"] for c, run in runs.items()},
        "acceptance_by_depth_and_rank": [[round(float(a), 4) for a in row] for row in counter.acceptance],
        "opportunities_by_depth": [int(n) for n in counter.opportunities],
        "pass_ms": {n: round(s * 1000, 2) for n, s in verify.items()},
        "leaf_ms": {n: round(s * 1000, 2) for n, s in leaf.items()},
        "draft_ms_per_level": round(draft_per_level * 1000, 3),
        "written": write,
    }


def _measure_acceptance(pipeline: Pipeline, prompts: list[dict], max_new_tokens: int) -> "AcceptanceCounter":
    """1. Acceptance by depth and rank, with the probe tree, of the draft alone: lookup tokens grafted on
    would blur which rank the target chose."""
    probing = pipeline.with_drafting(probe_topology(), None)
    counter = AcceptanceCounter(probing.make_drafter(True, controlled=False))
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    for item in prompts:
        probing.generate(**prompt_kwargs(item), config=config, session=probing.new_session(drafter=counter))
    return counter


def _measure_costs(pipeline: Pipeline, most_nodes: int) -> tuple[dict[int, float], dict[int, float]]:
    """2. What a step costs by node count, 1..most_nodes (a step with k lookup tokens carries up to k more
    nodes): seconds of a chain's pass, and what each root-to-leaf path beyond the first adds (it attends
    in a lane of its own: measured on stars, whose n nodes need n - 1 lanes)."""
    past = min(256, pipeline.context // 2)
    chunk = pipeline.manifest.prefill_chunk
    verify = pass_seconds(pipeline.target, chunk, range(1, most_nodes + 1), past, repeats=15)
    stars = range(3, min(most_nodes, pipeline.target.lanes + 1) + 1)
    star = pass_seconds(pipeline.target, chunk, stars, past, repeats=15, star=True) if len(stars) else {}
    leaf = {n: max(0.0, (star[n] - verify[n]) / (n - 2)) for n in star}
    for n in range(max(star, default=2) + 1, most_nodes + 1):  # more paths than lanes: the tree is cut
        leaf[n] = leaf.get(n - 1, 0.0)
    return verify, leaf


def lookup_choices(pipeline: Pipeline, lookup: LookupConfig | None) -> list[LookupConfig | None]:
    """Lookups worth measuring, with the bundle's n-gram settings: none, the standard lengths (longer
    while quoting) and the bundle's own. Prompt lookup goes beside a draft model only."""
    if pipeline.manifest.drafter is not DrafterKind.MODEL or pipeline.manifest.suffix is not None:
        return [None]  # suffix drafting replaces prompt lookup
    base = lookup or LookupConfig()
    found = [None] + [replace(base, tokens=k, quote_tokens=QUOTE_TOKENS) for k in LOOKUP_CHOICES] + [lookup]
    return list(dict.fromkeys(found))  # distinct, in order


def lookup_label(lookup: LookupConfig | None) -> str:
    """'none', 'K' or 'K/Q' (K tokens, Q while quoting), as `tune --json` names the candidates."""
    if lookup is None:
        return "none"
    return f"{lookup.tokens}/{lookup.quote_tokens}" if lookup.quote_tokens > lookup.tokens else str(lookup.tokens)


def write_tree(folder: Path, topology: Topology, lookup: LookupConfig | None) -> None:
    """Rewrites the manifest's tree (graphs take any node count on dynamic profiles) and its prompt
    lookup (None: none), atomically."""
    manifest = read_manifest(folder)
    graphs = [e.graph for e in (manifest.target, manifest.draft) if e is not None]
    graphs += [g for other in manifest.other_profiles for g in (other.target, other.draft) if g is not None]
    if any(graph.static for graph in graphs):
        raise InputError("this bundle has static-shape graphs: their node count, and so its tree, is fixed at export")
    manifest = replace(manifest, tree=topology, lookup=lookup)  # keeps the dynamic settings
    write_manifest(folder, manifest)


AUTO_TREE_START = "chain:4"  # what `--tree auto` exports before tune replaces it
AUTO_NEW_TOKENS = 64  # the answers it measures


def export_tuned(config) -> Path:
    """`edgespec export --tree auto`: exports a short chain, then measures this device and writes the
    tree `tune` chooses; the bundle is moved into place only with its tree."""
    from edgespec.exporters.bundle_writer import staged_bundle  # the export extra is optional for the runtime
    from edgespec.exporters.export import ExportError, plan_export, progress, write_export

    start = replace(config, tree=AUTO_TREE_START)
    if plan_export(start).static_nodes is not None:  # refused before the export's work, not after it
        raise ExportError("--tree auto rewrites the tree after measuring it, but static-shape graphs (NPU profiles) "
                          "fix their node count at export: give --tree")
    say = progress()
    with staged_bundle(config.out, config.force) as folder:
        write_export(folder, start, say)
        say("choosing the tree for this device (edgespec tune)")
        try:
            result = tune(folder, None, max_nodes=12, max_new_tokens=AUTO_NEW_TOKENS, threads=None, write=True)
        except ContextOverflowError as err:
            raise ExportError(f"--tree auto measures {AUTO_NEW_TOKENS}-token answers to the built-in prompts, "
                              f"which do not fit --context {config.context}: export with a larger --context "
                              "or give --tree") from err
        say(f"tree: parents {result['tree']['parents']}, predicted {result['predicted_tokens_per_s']} tokens/s, "
            f"measured {result['measured_tokens_per_s']}")
    say(f"bundle written to {config.out}")
    return Path(config.out)
