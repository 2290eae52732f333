"""What an export will write, decided and checked before any model is loaded: its settings (`ExportConfig`)
and the plan made from them (`ExportPlan`: the tree, the lanes, the schemes, the profiles' shapes)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from edgespec.quant.schemes import QuantPolicy, QuantScheme
from edgespec.runtime.contract.drafting import DrafterKind, DynamicTreeConfig, LookupConfig, NgramConfig, SuffixConfig
from edgespec.runtime.contract.errors import ExportError, InputError
from edgespec.runtime.contract.manifest import MAX_PREFILL_CHUNK
from edgespec.runtime.contract.topology import Topology, parse_tree_spec
from edgespec.runtime.execution.budget import MAX_LANES, lanes_for
from edgespec.runtime.execution.paths import cache_dir as default_cache_dir
from edgespec.targets.profiles import DeviceProfile, get_profile

from .bundle_writer import TreeSettings
from .coreml import CoreMLOptions

@dataclass(frozen=True)
class ExportConfig:
    model: str
    draft: str  # a model spec, or a training-free drafter: "ngram", "recycling", "ngram+recycling"
    out: Path
    tree: str | None = None  # None: the drafter's default (`default_tree`)
    context: int = 2048
    profile: str = "cpu"
    # more device profiles the bundle serves (`--profile` repeated): they share the graphs where their shapes
    # agree with the first's, else get their own (static-shape graphs beside dynamic ones, or the reverse)
    also_profiles: tuple[str, ...] = ()
    prefill_chunk: int = 64
    quant: str = "fp32"
    draft_quant: str | None = None  # None: the same as the target's
    block: int = 32
    symmetric: bool = True
    integer_zero_points: bool = False  # asymmetric: MatMulNBits' own integer zero points, not exact float offsets
    accuracy_level: int = 4
    integer_matmul: bool = False  # int8: MatMulInteger over per-row activations (quant/integer.py), no padding row
    gguf_blocks: bool = False  # a GGUF target's quantized blocks kept as they are (exporters/gguf_weights.py)
    quant_policy: Path | None = None  # applies to the target
    force: bool = False
    stages: int = 0  # > 0: the target also as stages with this many groups of layers (streamed under a budget)
    lookup: int = 0  # > 0: a prompt-lookup chain of up to this many tokens beside the draft model's tree
    lookup_quote: int = 0  # > lookup: the chain may run this long where the context's last 4 tokens occurred before
    lanes: int | None = None  # root-to-leaf paths the target graph verifies at once; None: the tree's (`graph_lanes`)
    slots: int = 0  # > 0: the target also as a slots graph of this many conversations per pass (exporters/slots.py)
    suffix: bool = False  # suffix drafting beside the drafter, each step's tree chosen by the step controller
    cache_dir: Path = field(default_factory=default_cache_dir)  # EDGESPEC_CACHE when set, read when the config is made
    formats: tuple[str, ...] = ("onnx",)  # + "coreml": CoreML packages beside the ONNX graphs
    coreml_kv: tuple[str, ...] = ("state", "io")
    coreml_compress: str = "int8"


def default_tree(draft: str) -> str:
    """A draft model's tree is a short chain until `tune` measures better. An n-gram drafter's is the
    chain a quote runs to: it is cut at NgramConfig.partial_match_depth unless the context's suffix
    occurred before, and 12 nodes is the last count before fp32's pass cost steps up
    (benchmarks/history.md §25, §33)."""
    kind = DrafterKind.training_free(draft)
    if kind is DrafterKind.SUFFIX:
        return "chain:1"  # suffix drafting grows each step's chain; the manifest's tree only sizes the pass
    return "chain:11" if kind is not None and kind.looks_up_ngrams else "chain:4"


def graph_lanes(topology: Topology, dynamic: DynamicTreeConfig | None, grafted_lookup: bool) -> int:
    """The lanes of the target graph: the tree's root-to-leaf paths, with the lookup chain beside them when
    it is grafted onto the model's tree (a lookup that drafts only while quoting stands alone: WithLookup),
    up to MAX_LANES. Every lane's attention runs on every pass, so a tree of chains gets one."""
    paths = dynamic.budget - 1 if dynamic is not None else topology.leaves
    return lanes_for(paths + (1 if grafted_lookup else 0))


def tree_plan(spec: str) -> tuple[Topology, DynamicTreeConfig | None]:
    """The static tree to write, and the dynamic-tree settings if any. `dynamic:N`: a draft model grows
    each step's tree within N nodes (its static fallback is the chain of N nodes). (`auto` is the front
    door's: edgespec.tune.export_tuned exports a short chain and tunes it before the bundle lands.)"""
    if spec.startswith("dynamic:"):
        budget = spec.split(":", 1)[1]
        if not budget.isdigit():
            raise InputError(f"dynamic:N needs a node count (got {spec!r})")
        dynamic = DynamicTreeConfig(budget=int(budget))
        return parse_tree_spec(f"chain:{dynamic.budget - 1}"), dynamic
    return parse_tree_spec(spec), None


@dataclass(frozen=True)
class ExportPlan:
    """An export's settings, checked before any model is loaded."""

    tree: TreeSettings
    lanes: int
    target_scheme: QuantScheme
    draft_scheme: QuantScheme
    target_policy: QuantPolicy
    coreml: CoreMLOptions | None  # None: no CoreML packages
    profiles: tuple[DeviceProfile, ...]  # the first's graphs are the main ones
    # per profile, (target, draft): which roles' graphs it needs with static shapes (static_roles)
    shapes: tuple[tuple[bool, bool], ...]
    static_nodes: int | None = None  # static-shape graphs' nodes per pass (None: no profile needs them)

    @property
    def main_static(self) -> tuple[bool, bool]:
        return self.shapes[0]

    @property
    def other_form(self) -> tuple[bool, bool]:
        """Per role, whether another profile needs that role's graph in the other shapes (a second graph of it)."""
        return tuple(any(roles[i] != self.shapes[0][i] for roles in self.shapes[1:]) for i in range(2))


FORMATS = ("onnx", "coreml")


def plan_export(config: ExportConfig) -> ExportPlan:
    """Checks `config` as a whole; every problem is an ExportError naming the option."""
    try:
        topology, dynamic = tree_plan(config.tree or default_tree(config.draft))
    except ValueError as err:
        raise ExportError(str(err)) from err
    if config.lookup < 0:
        raise ExportError("--lookup must be 0 (off) or a number of drafted tokens")
    if config.lookup_quote < 0 or 0 < config.lookup_quote <= config.lookup:
        raise ExportError(f"--lookup-quote must be 0 (as --lookup) or more drafted tokens than --lookup "
                          f"({config.lookup}): it is the chain's length while the answer quotes its context")
    lookup_tokens = max(config.lookup, config.lookup_quote)
    if config.context < topology.size + lookup_tokens + 2:
        raise ExportError(f"--context {config.context} is too small for a tree of {topology.size} nodes"
                          + (f" and {lookup_tokens} lookup tokens" if lookup_tokens else ""))
    lanes = config.lanes if config.lanes is not None else graph_lanes(topology, dynamic, config.lookup > 0)
    if config.slots < 0:
        raise ExportError(f"--slots must be 0 (none) or more conversations per pass (got {config.slots})")
    if not 1 <= lanes <= MAX_LANES:
        raise ExportError(f"--lanes must be between 1 and {MAX_LANES} (got {lanes})")
    if not 2 <= config.prefill_chunk <= MAX_PREFILL_CHUNK:
        raise ExportError(f"the prefill chunk must be 2 to {MAX_PREFILL_CHUNK} tokens (got {config.prefill_chunk})")
    training_free = DrafterKind.training_free(config.draft)
    if dynamic is not None and training_free is not None:
        raise ExportError("a dynamic tree grows by a draft model's confidence: give --draft a model")
    if lookup_tokens and training_free is not None:
        raise ExportError(f"--lookup adds prompt lookup to a draft model; the {config.draft!r} drafter has none "
                          "(use --draft ngram or ngram+recycling for prompt lookup alone)")
    if config.integer_matmul and (config.quant != "int8" or not config.symmetric):
        raise ExportError("--integer-matmul is a scheme of --quant int8 (symmetric activations, a zero point per "
                          "weight channel): drop --asymmetric/--integer-zero-points, or use MatMulNBits' int4/int8")
    suffix = None
    if config.suffix or training_free is DrafterKind.SUFFIX:
        if lookup_tokens:
            raise ExportError("suffix drafting replaces prompt lookup (it matches the longest earlier suffix in the "
                              "conversation and earlier outputs): drop --lookup/--lookup-quote or --suffix")
        if training_free is DrafterKind.SUFFIX and config.tree is not None:
            raise ExportError("the suffix drafter grows each step's chain itself: drop --tree")
        suffix = SuffixConfig()
    ngram = None
    if training_free is not None and training_free.looks_up_ngrams:
        # quantized weights make every verified row cost (int8 compute): without a full match, one token,
        # which takes the padding row's place in the pass for free (history.md §40: 1.30x against 0.91x)
        ngram = NgramConfig(partial_match_depth=1 if config.quant in ("int4", "int8") else 5)
    lookup = LookupConfig(tokens=config.lookup, quote_tokens=config.lookup_quote) if lookup_tokens else None
    try:
        target_scheme = QuantScheme(config.quant, config.block, config.symmetric, config.accuracy_level,
                                    config.integer_zero_points, config.integer_matmul)
        draft_scheme = replace(target_scheme, name=config.draft_quant or config.quant)
        target_policy = QuantPolicy.load(config.quant_policy, target_scheme)
    except ValueError as err:
        raise ExportError(str(err)) from err
    coreml = _coreml_options(config, topology)
    names = (config.profile, *config.also_profiles)
    if len(set(names)) != len(names):
        raise ExportError(f"--profile names a profile twice ({', '.join(names)})")
    try:
        profiles = [get_profile(name) for name in names]
    except ValueError as err:
        raise ExportError(str(err)) from err
    shapes = tuple(static_roles(p, coreml) for p in profiles)
    static_nodes = None
    if any(any(roles) for roles in shapes):
        if config.slots and shapes[0][0]:
            raise ExportError(f"the {profiles[0].name} profile verifies on static-shape graphs, which are not written "
                              "with slots: drop --slots")
        if config.stages and shapes[0][0]:
            raise ExportError(f"the {profiles[0].name} profile verifies on static-shape graphs, which are not written "
                              "as stages: drop --stages")
        # the tree's nodes (a dynamic tree's budget) with the lookup chain's, padded to when fewer
        static_nodes = max(2, (dynamic.budget if dynamic is not None else topology.size) + lookup_tokens)
    if suffix is not None and any(any(roles) for roles in shapes):
        raise ExportError(f"suffix drafting verifies a tree of a new size every step, which static-shape graphs "
                          f"({', '.join(p.name for p, roles in zip(profiles, shapes) if any(roles))}) cannot: drop --suffix")
    return ExportPlan(TreeSettings(topology, dynamic, lookup, ngram, suffix), lanes, target_scheme, draft_scheme, target_policy,
                      coreml, tuple(profiles), shapes, static_nodes)


def static_roles(profile: DeviceProfile, coreml: CoreMLOptions | None) -> tuple[bool, bool]:
    """(target, draft): which roles' ONNX graphs get static shapes for `profile` (none where CoreML packages
    are its static graphs)."""
    return (profile.static_verify and coreml is None, profile.static_draft and coreml is None)


def _coreml_options(config: ExportConfig, topology: Topology) -> CoreMLOptions | None:
    """The CoreML packages' settings; they draft with the draft model alone (prompt lookup is the ONNX path's)."""
    unknown = [name for name in config.formats if name not in FORMATS]
    if unknown or len(set(config.formats)) != len(config.formats):
        raise ExportError(f"--format takes onnx or onnx,coreml (got {','.join(config.formats)!r})")
    if "onnx" not in config.formats:
        raise ExportError("a bundle always holds the ONNX graphs (they run everywhere, and on a Mac before macOS 14): "
                          "use --format onnx,coreml")
    if "coreml" not in config.formats:
        return None
    if topology.max_width > 1:
        raise ExportError(f"CoreML packages verify chains (their decode loop accepts a prefix); the tree "
                          f"{topology.spec()} branches: export with --tree chain:K")
    return CoreMLOptions(config.coreml_kv, config.coreml_compress)
