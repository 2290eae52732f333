"""The front of the runtime: open a bundle, make sessions per role, generate text."""
from __future__ import annotations

import copy
import json
import os
import warnings
from functools import lru_cache, partial
from pathlib import Path

import numpy as np

from .contract.drafting import DrafterKind, LookupConfig
from .contract.errors import BudgetError, BundleError, InputError
from .contract.manifest import Manifest, open_bundle
from .contract.topology import Topology
from .decoding.constraints import Grammars, Guide
from .decoding.controller import Controller, Measurements
from .decoding.drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter, RecyclingDrafter, new_recycling_table
from .decoding.dynamic_tree import DynamicDrafter
from .decoding.engine import GenerationConfig, Result, Session, generate, speculative_step
from .decoding.exactness import RowMismatch, Verdict, fewest_exact_rows, verdict_here
from .decoding.logprobs import Scores
from .decoding.lookup import WithLookup
from .decoding.medusa import MedusaDrafter
from .decoding.overlap import Overlap
from .decoding.sampling import conversation_defaults
from .decoding.streamed_tree import tree_under_budget
from .decoding.suffix import SuffixDrafter, SuffixStore
from .decoding.text import TextCodec
from .decoding.text_draft import TextDrafter
from .execution import prepacked
from .execution.budget import parse_size
from .execution.coreml import Predictor, open_coreml
from .execution.device import describe
from .execution.draft_open import open_draft
from .execution.heap import heap_trimmer
from .execution.model import ModelRunner
from .execution.paths import cache_dir, packed_dir
from .execution.placement import Placement
from .execution.runner import Cache
from .execution.sessions import check_spin, make_session, spins
from .execution.stage_build import build_measured, plan_on_this_device, window_specs
from .execution.staged import StagedRunner

BACKENDS = ("auto", "onnx", "coreml")
MAX_THREADS = 256  # far beyond any device this runs on; more only makes onnxruntime's pools thrash


def default_prepared_dir() -> Path:
    return packed_dir()


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def packed_copies(manifest: Manifest, root: Path | None = None) -> list[tuple[str, int | None]]:
    """Per stage of the window (each mapped from a packed copy on this machine): its checksum and the disk
    its copy takes, None where it has not been written yet."""
    root = Path(root) if root else default_prepared_dir()
    checksums = [prepacked.stage_checksum(manifest.files, spec) for spec in window_specs(manifest)]
    return [(c, prepacked.prepared_bytes(c, root)) for c in checksums]


class Pipeline:
    """A loaded bundle. `generate` is the whole job; `new_session` keeps a conversation's caches."""

    def __init__(self, folder, threads: int | None = None, memory_budget: int | str | None = None,
                 prepared_dir: Path | None = None, evict_page_cache: bool = False, strict: bool = False,
                 placement: Placement | None = None, profile: str | None = None, context: int | None = None,
                 backend: str = "auto", predictor: Predictor | None = None, coreml_kv: str | None = None,
                 spin: str = "auto"):
        """`memory_budget` (bytes, or a size like "300MB"): weights, both KV caches and scratch must fit in
        it; the caches hold the context that fits (`memory.context`), refused below the minimum.
        `prepared_dir`: where stages' packed weights are kept for this machine (default: the
        edgespec cache); written on first use. `evict_page_cache`: a streamed stage's release also drops
        its pages from the OS page cache, so the budget bounds the cache too (a container or device whose
        memory limit counts the cache); otherwise the OS keeps them cached while memory is free.
        `strict`: a provider the bundle's profile names but this onnxruntime lacks is an error, not a
        fallback with a warning. `placement`: the draft's provider, each role's threads and whether drafting
        overlaps verification (edgespec/calibrate.py measures them); default: the profile's first provider
        for each role, `threads` for both, one after the other. `profile`: which of the bundle's device profiles
        to run (its providers and its graphs; default: the first it was exported for). `context`: the fewest
        tokens the caches must hold under a budget (default: runtime/execution/budget.py DEFAULT_CONTEXT, or what
        the budget holds): the budget goes to speed beyond this floor, the context gets the rest; a request
        that needs more, which another split of the budget holds, gets that split (`hold`). `backend`: "onnx"
        runs the ONNX graphs, "coreml" the bundle's CoreML packages through `predictor`
        (runtime/execution/coreml.py's contract: edgespec/coreml_backend.py on macOS), with KV as `coreml_kv`
        (default: the packages' first form); "auto" takes CoreML for a bundle of the apple profile with CoreML
        packages when a predictor is given. `spin`:
        whether the sessions' threads spin between a run's operators: "on", "off" (a CPU other processes keep
        busy), "auto" (default: the target's and the draft's do, the draft's not beside a streamed target); a
        streamed target's stages never spin (docs/profiles.md)."""
        check_spin(spin)
        self.spin = spin
        self.evict_page_cache = evict_page_cache
        self.trim_heap = heap_trimmer()  # after each request: what it freed goes back to the system
        self.folder = Path(folder)
        self.prepared_dir = Path(prepared_dir) if prepared_dir else default_prepared_dir()
        self.manifest: Manifest = open_bundle(self.folder, profile)
        check_threads(threads)
        self.threads = threads or self.manifest.profile.threads or default_threads()
        profile = self.manifest.profile  # what the bundle was exported for: the providers per role
        self.placement = placement
        self.target_threads = placement.target_threads if placement else self.threads
        self.memory = plan_on_this_device(self.manifest, self.folder,
                                          None if memory_budget is None else parse_size(memory_budget), context,
                                          self.prepared_dir, cache_dir(), evict_page_cache, self.target_threads)
        self.strict = strict
        m = self.manifest
        self.codec = TextCodec(self.folder, m.tokenizer)
        self.stream_costs = None  # a staged target's stage costs on this device (runtime/execution/stream_costs.py)
        self.backend = _backend(backend, m, predictor)
        coreml_draft = None
        if self.backend == "coreml":
            if memory_budget is not None or placement is not None:
                raise InputError("a memory budget and a placement plan the ONNX graphs; the CoreML packages hold "
                                 "their context whole on the compute units chosen at export: leave them out, or run "
                                 "the ONNX backend")
            self.target, coreml_draft, coreml_tree = open_coreml(self.folder, m, coreml_kv or m.coreml[0].kv, predictor)
        elif self.memory.stage_bytes:  # the single graph does not fit: stages, through a window
            self.target, self.memory, self.stream_costs = build_measured(
                m, self.folder, self.memory, profile.verify, self.target_threads, self.prepared_dir, cache_dir(),
                evict_page_cache)
        else:
            self.target = ModelRunner(make_session(self.folder / m.target.graph.file, profile.verify,
                                                   self.target_threads, spin=spins(spin), role="the target",
                                                   strict=strict, shared_arena=self.memory.budget is not None),
                                      m.target.facts)
        # the tree drafters fill: the manifest's, or one sized to a streamed pass where stages stream; a caller
        # (tune) may try another
        self.tree = tree_under_budget(m, self.memory, self.stream_costs, profile.max_tree_nodes)
        self.lookup = m.lookup  # prompt lookup beside the draft model; tune leaves it out to measure the model
        if self.backend == "coreml":  # the verify function's chain: a grafted lookup chain would branch it
            self.tree, self.lookup = coreml_tree, None
        self.draft = None
        self.draft_codec = None  # a text draft's own tokenizer (runtime/decoding/text_draft.py): read on first use
        self.recycling_table = None  # Token Recycling's successor table: one per target, shared by its drafters
        # earlier outputs that suffix drafting continues from: one store per pipeline, for all its requests
        self.suffix_store = SuffixStore(m.suffix.store_tokens) if m.suffix is not None else None
        self.step_measurements: Measurements | None = None  # the step controllers', shared: made on first use
        self._grammars: Grammars | None = None  # the tokenizer as the grammar engine reads it: made on first use
        if m.drafter is DrafterKind.MODEL and self.backend == "coreml":
            if coreml_draft is None:
                raise BundleError("the manifest names a draft model but the bundle has no CoreML draft package: "
                                  "export it again with --format onnx,coreml, or run the ONNX backend")
            self.draft = coreml_draft
        else:
            self.draft = open_draft(m, self.folder,
                                    ((placement.draft_provider(),), placement.draft_threads) if placement
                                    else (profile.draft, self.threads), (profile.draft, self.threads),
                                    spins(spin, beside_loader=self.memory.streams), strict,
                                    shared_arena=self.memory.budget is not None)
        for runner in (self.target, self.draft):
            static = runner.static if runner is not None else None
            if static is not None and static.context != self.memory.context:
                raise InputError(f"this static-shape bundle holds a context of {static.context} tokens, fixed at export; "
                                 f"the memory budget leaves room for {self.memory.context}: raise the budget")
        self._resolve_exactness()
        self.trim_heap()  # what loading freed (the tokenizer's parse, sessions' reads) goes back before a request

    @property
    def context(self) -> int:
        return self.memory.context

    @property
    def sampling_defaults(self) -> dict:
        """What a conversation samples with where it leaves a setting unset: the model's generation_config
        (the bundle's generation_config.json, where the exporter found one) over llama.cpp's defaults."""
        path = self.folder / "generation_config.json"
        try:
            generation_config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, ValueError) as err:
            raise BundleError(f"{path}: cannot be read as JSON ({err}); export the bundle again") from err
        if generation_config is not None and not isinstance(generation_config, dict):
            raise BundleError(f"{path}: not a JSON object; export the bundle again")
        return conversation_defaults(generation_config)

    def new_session(self, speculate: bool = True, *, drafter: Drafter | None = None,
                    suffix_store: SuffixStore | None = None, recycling_table: np.ndarray | None = None) -> Session:
        """A conversation's state, kept by the caller between turns: the target's cache (a lane per
        root-to-leaf path the graph verifies) and the drafter with its own cache. `drafter`: the caller's own
        (held to what `make_drafter` decides: none unless `speculate`, none where speculation is not exact
        here). `suffix_store` and `recycling_table`: what the drafter learns from across requests, the caller's
        own (`new_suffix_store`, `new_recycling_table`); default: the pipeline's, shared by every request."""
        target = self.manifest.target
        drafter = self.make_drafter(speculate, suffix_store=suffix_store, recycling_table=recycling_table) \
            if drafter is None else self._checked(drafter, speculate)
        return Session(cache=self.target.new_cache(self.context, target.feature_size), drafter=drafter,
                       suffix_store=self.suffix_store if suffix_store is None else suffix_store)

    def with_drafting(self, tree: Topology, lookup: LookupConfig | None) -> "Pipeline":
        """The same loaded models drafting on `tree`, with `lookup` beside a draft model, and a recycling table
        of its own (tune measures each choice as a fresh pipeline would run it)."""
        other = copy.copy(self)
        other.tree, other.lookup, other.recycling_table = tree, lookup, None
        return other

    def new_draft_cache(self) -> Cache:
        """A cache for the draft model: its own KV rows, and its output features when it reads the target's."""
        draft = self.manifest.draft
        return self.draft.new_cache(self.context, draft.feature_size)

    @property
    def exactness(self) -> Verdict:
        """Whether speculation keeps plain decoding's bits here, and at how many rows a one-token step does:
        recorded at export for the device that exported it; elsewhere checked when the pipeline is made and
        cached per device (runtime/decoding/exactness.py). The target runs that many rows, plain or not."""
        return self._exactness

    def _resolve_exactness(self) -> None:
        m = self.manifest
        if self.backend == "coreml":  # not checked: the same function computes a step and a chain (coreml.py)
            self._exactness = Verdict(True, "CoreML: one-token steps and drafted chains run the same verify function",
                                      1)
            return
        self._exactness = verdict_here(m.exactness, m.files.get(m.target.graph.file, ""), self.target, cache_dir())
        self.target.min_rows = self._exactness.min_rows

    def new_suffix_store(self) -> SuffixStore | None:
        """An empty store of earlier outputs, for a caller that keeps its own apart from the pipeline's (a
        server: one per client, so that what one client's outputs teach the drafter never speeds up, and so
        never reveals itself in another's timing); None where the bundle has no suffix drafting."""
        m = self.manifest
        return SuffixStore(m.suffix.store_tokens) if m.suffix is not None else None

    def new_recycling_table(self) -> np.ndarray | None:
        """An empty Token Recycling table, for a caller that keeps its own (as `new_suffix_store`); None
        where the bundle's drafter does not recycle."""
        m = self.manifest
        return new_recycling_table(m.target.facts.vocab_size) if m.drafter.recycles else None

    def make_drafter(self, speculate: bool, controlled: bool = True, suffix_store: SuffixStore | None = None,
                     recycling_table: np.ndarray | None = None) -> Drafter:
        """The bundle's drafter; with suffix drafting, under the step controller (runtime/decoding/controller.py) unless
        not `controlled` (then the drafter alone, on the pipeline's tree: what tune measures). `suffix_store`
        and `recycling_table`: what it learns from across requests, the caller's own (`new_suffix_store`,
        `new_recycling_table`); default: the pipeline's, shared by every request it serves."""
        m = self.manifest
        if not speculate or not self._exact_here():
            return NoDrafter()
        if m.suffix is None or not controlled:
            return NoDrafter() if m.drafter is DrafterKind.SUFFIX else self._main_drafter(recycling_table)
        main = None if m.drafter is DrafterKind.SUFFIX else self._main_drafter(recycling_table)
        if self.step_measurements is None:
            self.step_measurements = Measurements.fresh(m.dynamic.budget if m.dynamic is not None else self.tree.size)
        store = self.suffix_store if suffix_store is None else suffix_store
        return Controller(SuffixDrafter(m.suffix, store, self.target.lanes), main, self.target.lanes,
                          self.step_measurements)

    def _main_drafter(self, recycling_table: np.ndarray | None) -> Drafter:
        m = self.manifest
        ngram = NgramDrafter.from_config(self.tree, m.ngram) if m.ngram is not None else None
        if m.drafter is DrafterKind.NGRAM:
            return ngram
        if m.drafter.recycles:
            if recycling_table is None and self.recycling_table is None:
                self.recycling_table = new_recycling_table(m.target.facts.vocab_size)
            return RecyclingDrafter(self.tree, self.recycling_table if recycling_table is None else recycling_table,
                                    ngram=ngram)
        if m.drafter is DrafterKind.MEDUSA:
            return MedusaDrafter(self.draft, self.tree)
        cache = self.new_draft_cache()
        if m.drafter is DrafterKind.TEXT:
            if self.draft_codec is None:  # read once: every conversation's drafter shares it
                self.draft_codec = TextCodec(self.folder, m.draft.tokenizer)
            return TextDrafter(self.draft, cache, self.tree.max_depth, m.prefill_chunk, self.codec.tokenizer,
                               self.draft_codec.tokenizer, m.draft.tokenizer.eos_token_ids)
        if m.dynamic is not None:
            drafter = DynamicDrafter(self.draft, cache, m.dynamic, m.prefill_chunk)
        else:
            drafter = ModelDrafter(self.draft, cache, self.tree, m.prefill_chunk)
        return drafter if self.lookup is None else WithLookup(drafter, self.lookup)

    def _checked(self, drafter: Drafter, speculate: bool) -> Drafter:
        """A caller's own drafter, held to what make_drafter decides: speculation off is asked with no drafter,
        and a device that is not exact decodes plainly."""
        if isinstance(drafter, NoDrafter):
            return drafter
        if not speculate:
            raise InputError("a drafter was given with speculate=False: give one or the other")
        return drafter if self._exact_here() else NoDrafter()

    def _checked_session(self, session: Session, speculate: bool) -> Session:
        if not speculate and not isinstance(session.drafter, NoDrafter):
            raise InputError("speculate=False with a speculative session: make it with new_session(False)")
        return session

    def _exact_here(self) -> bool:
        """Whether speculation is exact on this device; warns where it is not (decoding plainly instead)."""
        if not self.exactness.exact:
            warnings.warn(f"speculation is off for this bundle here: {self.exactness.reason}; decoding plainly, "
                          "which gives the same output", RuntimeWarning, stacklevel=4)
        return self.exactness.exact

    def check_exact(self) -> tuple[int, list[RowMismatch]]:
        """Whether this device gives every token of the target plain decoding's bits in any pass, which
        greedy speculation's exactness rests on: (tokens compared, those that differ), at the fewest rows
        per one-token step that keep them (then `target.min_rows`). Takes seconds."""
        if self.backend == "coreml":
            raise InputError("the exactness check compares the ONNX graphs' passes: open the bundle with "
                             "backend='onnx' to run it")
        min_rows, compared, differ = fewest_exact_rows(self.target)
        self._exactness = Verdict(not differ, f"checked now, {describe()}", min_rows)
        return compared, differ

    @property
    def grammars(self) -> Grammars:
        """Compiles constraints for this bundle's vocabulary (reading the tokenizer once, on first use)."""
        if self._grammars is None:
            self._grammars = Grammars(self.codec.tokenizer.to_str(), self.manifest.target.facts.vocab_size,
                                      self.manifest.tokenizer.eos_token_ids)
        return self._grammars

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               tools: list[dict] | None = None) -> list[int]:
        """`tools`: OpenAI's tool objects, for a chat template that renders them (`codec.takes_tools`)."""
        if (prompt is None) == (messages is None):
            raise InputError("give either a prompt or chat messages")
        return self.codec.encode_chat(messages, tools) if messages is not None else self.codec.encode(prompt)

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 ids: list[int] | None = None, config: GenerationConfig = GenerationConfig(),
                 speculate: bool = True, session: Session | None = None, on_text=None, should_stop=None,
                 remember: bool = True, scores: Scores | None = None) -> Result:
        """Generates after a prompt, chat messages, or `ids` (the conversation already encoded, as `encode`
        gives it: a caller that had to count its tokens does not encode it twice). `session`: a conversation
        kept between turns (`new_session`), its caches and drafter reused; default: one for this request,
        speculative unless not `speculate`. `remember`: the output joins the earlier outputs suffix drafting
        continues from (the session's store, where the bundle has it); a benchmark's reference runs pass
        False, so that no measured run copies its own answer. `scores`: where the log-probabilities go
        (runtime/decoding/logprobs.py; None: not computed)."""
        if ids is not None and (prompt is not None or messages is not None):
            raise InputError("give a prompt, chat messages or token ids, one of them")
        ids = self.encode(prompt, messages) if ids is None else _checked_ids(ids, self.manifest.target.facts.vocab_size)
        owned = session is None  # the request's own caches: freed when it ends
        if owned:
            self.hold(len(ids) + config.max_new_tokens)
        session = self.new_session(speculate) if owned else self._checked_session(session, speculate)
        drafter = session.drafter
        guide = None if config.constraint is None else self._guide(config, drafter)
        overlap = Overlap() if self.overlaps(drafter) and guide is None else None
        counted = drafter.counts.copy() if isinstance(drafter, Controller) else None
        try:
            result = generate(self.target, self.codec, session, ids, config, self.manifest.prefill_chunk,
                              on_text, should_stop, step=overlap.step if overlap else speculative_step, guide=guide,
                              scores=scores)
            if overlap:
                result.stats.drafted_ahead, result.stats.kept_ahead = overlap.drafted_ahead, overlap.kept
            if isinstance(drafter, Controller):
                result.stats.steps_by_choice = drafter.counts.since(counted)
            if session.suffix_store is not None and remember:
                session.suffix_store.add(result.token_ids)
            return result
        finally:
            if overlap:
                overlap.settle(session)
            if owned:
                del session, drafter
            self.trim_heap()

    def hold(self, tokens: int) -> None:
        """Under a budget, makes the caches of new sessions hold `tokens` (a request's prompt and new tokens)
        where the plan's context is less and another split of the same budget holds them: fewer stages pinned,
        or the target streamed where it was resident, the caches taking what that frees. Where none does,
        nothing changes (the engine then says the context is full)."""
        plan, m = self.memory, self.manifest
        tokens = min(tokens, m.target.facts.max_context)
        if plan.budget is None or tokens <= plan.context or not m.target.stages or self.backend != "onnx":
            return
        try:
            wider = plan_on_this_device(m, self.folder, plan.budget, tokens, self.prepared_dir, cache_dir(),
                                        self.evict_page_cache, self.target_threads)
        except BudgetError:
            return
        if isinstance(self.target, StagedRunner):
            self.target.window.repin(wider.pinned_stages, wider.stream_slots)
            self.target.pinning = lru_cache(maxsize=16)(partial(wider.pinned_while, costs=self.stream_costs))
        else:  # the resident target's weights go before the stages' are mapped: the budget holds one
            self.target = None
            self.target, wider, self.stream_costs = build_measured(
                m, self.folder, wider, m.profile.verify, self.target_threads, self.prepared_dir, cache_dir(),
                self.evict_page_cache)
            self._resolve_exactness()
        self.memory = wider
        tree = tree_under_budget(m, wider, self.stream_costs, m.profile.max_tree_nodes)
        if tree != self.tree:  # the step controller's measurements were of the other tree
            self.tree, self.step_measurements = tree, None

    def _guide(self, config: GenerationConfig, drafter: Drafter) -> Guide:
        """The constraint's parser state; closing within the budget refuses a budget no output fits."""
        if config.close_within_budget:
            self.grammars.within(config.constraint, config.max_new_tokens)
        return self.grammars.start(config.constraint, forced_chains=not isinstance(drafter, NoDrafter),
                                   budget=config.max_new_tokens if config.close_within_budget else None)

    def forget_outputs(self) -> None:
        """Empties the store of earlier outputs (a benchmark's round starts without them)."""
        if self.suffix_store is not None:
            self.suffix_store.clear()

    def overlaps(self, drafter: Drafter) -> bool:
        """Whether `drafter` drafts while the target verifies: the placement says so and a draft model proposes
        (a training-free drafter costs too little to hide; the step controller times each pass alone; a text draft
        is not drafted ahead: its guess of the committed text would be re-encoded on every miss)."""
        return bool(self.placement and self.placement.overlap and self.draft is not None
                    and not isinstance(drafter, (NoDrafter, Controller, TextDrafter)))


def _backend(asked: str, manifest: Manifest, predictor: Predictor | None) -> str:
    """Which backend runs the bundle: the one asked for, or for "auto" CoreML where the bundle was exported for
    the apple profile with CoreML packages and a predictor runs them here."""
    if asked not in BACKENDS:
        raise InputError(f"unknown backend {asked!r}; choose one of {', '.join(BACKENDS)}")
    if asked == "auto":
        return "coreml" if manifest.profile.name == "apple" and manifest.coreml and predictor is not None else "onnx"
    if asked == "coreml" and predictor is None:
        raise InputError("the CoreML backend needs a predictor that runs the packages (edgespec.coreml_backend's "
                         "on macOS)")
    if asked == "coreml" and not manifest.coreml:
        raise InputError("the bundle has no CoreML packages: export it with --format onnx,coreml, or run the ONNX "
                         "backend")
    return asked


def _checked_ids(ids, vocab_size: int) -> list[int]:
    """Token ids a caller encoded itself, as the graph can take them."""
    ids = list(ids)
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise InputError(f"token ids must be integers in 0..{vocab_size - 1}")
    return [int(t) for t in ids]


def check_threads(threads) -> None:
    """A thread count a session can take (None: the profile's or the machine's)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= MAX_THREADS):
        raise InputError(f"threads must be between 1 and {MAX_THREADS} (got {threads!r})")


def load(folder, threads: int | None = None, memory_budget: int | str | None = None, spin: str = "auto") -> Pipeline:
    return Pipeline(folder, threads, memory_budget, spin=spin)
