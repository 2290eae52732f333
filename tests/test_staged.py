"""The target as stages under a memory budget: same bits as the single graph, streamed through a window."""
import os
from pathlib import Path

import numpy as np
import pytest
from edgespec.runtime.contract.errors import BudgetError, BundleError
from edgespec.runtime.contract.graph import GraphSignature
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.exactness import check_exact_rows
from edgespec.runtime.execution import prepacked
from edgespec.runtime.execution.budget import MIN_CONTEXT, embedding_rows, plan_memory, window_bytes
from edgespec.runtime.execution.embedding import MappedEmbedding
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import pass_feed, run_bound
from edgespec.runtime.execution.stage_build import packed_graphs, resident_stage_bytes
from edgespec.runtime.execution.staged import LoadedStage, StageWindow

CONFIG = GenerationConfig(max_new_tokens=30)


@pytest.fixture(scope="module")
def staged_bundle(models, tmp_path_factory):
    """A six-layer target in six stages of one layer, plus embedding and head stages."""
    from edgespec.exporters.export import ExportConfig, export
    from tiny import make_model

    root = tmp_path_factory.mktemp("staged")
    make_model(root / "deep", "llama", seed=5, layers=6)
    return export(ExportConfig(model=str(root / "deep"), draft=str(models["draft"]), tree="topk:2x2",
                               out=root / "b", context=128, stages=6))


def _budget_for(folder, prepared=None):
    """The smallest budget: the minimum context and a window of two streaming stages, none pinned. With
    `prepared`, where packed copies can be mapped, stages count what their packed copies map (prepared
    here), as a pipeline's plan on this machine counts them; else their files."""
    manifest = open_bundle(folder)
    full = plan_memory(manifest, folder, None)
    table = manifest.target.stages[0].embedding_table  # mapped, not loaded: stage 0 is not in the window
    mapped = MappedEmbedding.resident_bound(table, embedding_rows(manifest)) if table else 0
    stages = [sum((folder / n).stat().st_size for n in (s.file, *s.weights)) for s in manifest.target.stages[1:]]
    if prepared is not None and prepacked.available():
        packed_graphs(manifest, folder, prepared)
        stages = resident_stage_bytes(manifest, prepared)
    per_token = full.target_kv_per_token + full.draft_kv_per_token
    return (full.runtime + full.draft_weights + full.scratch + MIN_CONTEXT * per_token + mapped
            + window_bytes(stages, ()))


def _single_graph(folder, prepack: bool, threads: int = 1):
    from edgespec.runtime.execution.model import ModelRunner
    from edgespec.runtime.execution.sessions import make_session

    manifest = open_bundle(folder)
    return ModelRunner(make_session(folder / manifest.target.graph.file, ("CPUExecutionProvider",), threads,
                                    prepack=prepack), manifest.target.facts)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Where float stages' packed weights are kept: per test module, never the user's cache."""
    return tmp_path_factory.mktemp("prepacked")


def _roomy_budget(folder, prepared=None):
    """Room for the first two layer stages to be pinned; the others stream."""
    manifest = open_bundle(folder)
    return _budget_for(folder, prepared) + sum((folder / n).stat().st_size
                                     for s in manifest.target.stages[1:3] for n in (s.file, *s.weights))


def _first_pass(runner):
    from edgespec.runtime.execution.kvcache import KVCache

    tokens = np.arange(5, 25)
    cache = KVCache(runner.facts, 64, lanes=runner.lanes)
    out = runner.forward(cache, tokens, range(20), np.tril(np.ones((20, 20), bool)), range(20))
    return out.logits, cache.data[:, :, 0, :, :20].copy()  # the logits, and the keys/values it wrote


def _assert_same_pass(expected, actual):
    np.testing.assert_array_equal(expected[0], actual[0])
    np.testing.assert_array_equal(expected[1], actual[1])


def _assert_speculation_exact(pipeline):
    for prompt in ("The quick brown fox", "def add(a, b):"):
        plain = pipeline.generate(prompt=prompt, config=CONFIG, speculate=False)
        assert pipeline.generate(prompt=prompt, config=CONFIG, speculate=True).token_ids == plain.token_ids


needs_prepacked = pytest.mark.skipif(not prepacked.available(), reason="releases mapped pages through /proc/self/maps")


@needs_prepacked
def test_float_stages_map_their_packed_weights_pinned_or_streamed(staged_bundle, prepared):
    from edgespec.runtime.pipeline import Pipeline

    manifest = open_bundle(staged_bundle)
    assert all(s.tensors for s in manifest.target.stages[1:])  # fp32: every weight can be mapped
    for budget in (_budget_for(staged_bundle, prepared), _roomy_budget(staged_bundle, prepared)):
        pipeline = Pipeline(staged_bundle, threads=1, memory_budget=budget, prepared_dir=prepared)
        assert all(isinstance(s, prepacked.PrepackedStage) for s in pipeline.target.window.stages)
    assert pipeline.memory.pinned_stages
    evicting = Pipeline(staged_bundle, threads=1, memory_budget=_roomy_budget(staged_bundle, prepared),
                        prepared_dir=prepared, evict_page_cache=True)
    window = evicting.target.window  # only streamed stages leave the page cache: pinned ones are never released
    assert [s.evict for s in window.stages] == [i not in window.pinned for i in range(window.count)]
    assert not all(s.evict for s in window.stages) and any(s.evict for s in window.stages)
    _assert_speculation_exact(evicting)


@needs_prepacked
def test_packed_stages_compute_the_packed_single_graphs_bits_at_every_budget(staged_bundle, prepared):
    """Streamed or pinned, the stages run the packed kernels the single graph runs: a tree pass is its,
    bit for bit, and greedy speculation under the budget reproduces plain decoding under it."""
    from edgespec.runtime.pipeline import Pipeline

    expected = _first_pass(_single_graph(staged_bundle, prepack=True))
    for budget in (_budget_for(staged_bundle, prepared), _roomy_budget(staged_bundle, prepared)):
        pipeline = Pipeline(staged_bundle, threads=1, memory_budget=budget, prepared_dir=prepared)
        _assert_same_pass(expected, _first_pass(pipeline.target))
    _assert_speculation_exact(pipeline)


@needs_prepacked
def test_with_two_threads_streamed_stages_keep_the_two_thread_single_graphs_bits(staged_bundle, prepared):
    """Every stage, streamed or pinned, runs on the target's threads: a pass of a two-thread pipeline under
    a budget is the two-thread single graph's, bit for bit."""
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(staged_bundle, threads=2, memory_budget=_roomy_budget(staged_bundle, prepared),
                        prepared_dir=prepared)
    window = pipeline.target.window
    assert window.pinned and len(window.pinned) < window.count
    assert [s.session.get_session_options().intra_op_num_threads for s in window.stages] == [2] * window.count
    _assert_same_pass(_first_pass(_single_graph(staged_bundle, prepack=True, threads=2)), _first_pass(pipeline.target))
    _assert_speculation_exact(pipeline)


@needs_prepacked
def test_stages_pinned_while_the_caches_are_short_are_given_back_as_they_grow(staged_bundle, prepared):
    """Under a budget the window pins what the caches' unused room holds (the plan's `pinned_while`); when
    that shrinks, the stages no longer pinned are released before the pass and stream again. Output is the
    same either way."""
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(staged_bundle, threads=1, memory_budget=_budget_for(staged_bundle, prepared),
                        prepared_dir=prepared)
    runner, window = pipeline.target, pipeline.target.window
    assert runner.pinning is not None and len(runner.pinning(0)) >= len(pipeline.memory.pinned_stages)
    runner.pinning = None
    expected = pipeline.generate(prompt="The quick brown fox", config=CONFIG, speculate=False).token_ids
    released, seen = [], []

    def recording(i, release):
        def wrapped():
            released.append(i)
            release()
        return wrapped

    for i, stage in enumerate(window.stages):
        stage.release = recording(i, stage.release)

    def pinning(target_kv: int) -> tuple[int, ...]:
        seen.append(target_kv)
        if len(seen) == 4:
            assert released == []  # while every stage was pinned, none was given back
        return tuple(range(window.count)) if len(seen) <= 3 else ()

    runner.pinning = pinning
    assert pipeline.generate(prompt="The quick brown fox", config=CONFIG, speculate=False).token_ids == expected
    assert len(seen) > 4 and seen == sorted(seen) and seen[0] > 0  # the caches' bytes, growing
    assert window.pinned == set() and len(window.sessions) <= window.slots and released
    _assert_speculation_exact(pipeline)


def test_without_packed_mapping_streamed_stages_read_unpacked_weights(staged_bundle, prepared, monkeypatch):
    """Where mapped pages cannot be released (no /proc/self/maps), streamed float stages read the bundle's
    weights in place, unpacked: the unpacked single graph's bits; pinned stages are loaded and packed."""
    from edgespec.runtime.execution.staged import MappedStage
    from edgespec.runtime.pipeline import Pipeline

    monkeypatch.setattr(prepacked, "available", lambda: False)
    streamed = Pipeline(staged_bundle, threads=1, memory_budget=_budget_for(staged_bundle), prepared_dir=prepared)
    assert all(isinstance(s, MappedStage) for s in streamed.target.window.stages)
    _assert_same_pass(_first_pass(_single_graph(staged_bundle, prepack=False)), _first_pass(streamed.target))
    # the export's verdict was the packed single graph's: these stages get one of their own, which holds for them
    assert streamed.exactness.reason.startswith("checked on first load")
    assert check_exact_rows(streamed.target)[1] == []
    _assert_speculation_exact(streamed)
    roomy = Pipeline(staged_bundle, threads=1, memory_budget=_roomy_budget(staged_bundle), prepared_dir=prepared)
    kinds = {i: type(s) for i, s in enumerate(roomy.target.window.stages)}
    assert roomy.memory.pinned_stages and all(kinds[i] is LoadedStage for i in roomy.memory.pinned_stages)
    assert any(k is MappedStage for k in kinds.values())


def test_loaded_stages_compute_the_single_graphs_bits(staged_bundle):
    """With every stage pinned (loaded, packed), a tree pass is the packed single graph's, bit for bit."""
    from edgespec.runtime.execution.sessions import make_session
    from edgespec.runtime.execution.runner import Cache, Runner
    from edgespec.runtime.execution.staged import StagedRunner

    manifest = open_bundle(staged_bundle)
    stages = manifest.target.stages
    window = StageWindow([LoadedStage(lambda s=s: make_session(staged_bundle / s.file, ("CPUExecutionProvider",), 1))
                          for s in stages], pinned=range(len(stages)))
    staged = StagedRunner(window, manifest.target.facts, manifest.target.lanes)
    assert isinstance(staged, Runner) and isinstance(staged.new_cache(32), Cache)  # what the decode loop calls
    _assert_same_pass(_first_pass(_single_graph(staged_bundle, prepack=True)), _first_pass(staged))
    # its stages take no attention bias (a target's): a pass that would need one is refused, not run unmasked
    cache = staged.new_cache(32)
    with pytest.raises(ValueError, match="exact passes"):
        staged.forward(cache, [1, 2], [0, 0], np.eye(2, dtype=bool), [0, 1], exact_rows=False)
    window.close()


def test_a_float_embedding_table_is_mapped_not_loaded(staged_bundle, prepared):
    from edgespec.runtime.pipeline import Pipeline

    assert open_bundle(staged_bundle).target.stages[0].embedding_table["dtype"] == "float32"
    streamed = Pipeline(staged_bundle, threads=1, memory_budget=_budget_for(staged_bundle, prepared),
                        prepared_dir=prepared)
    assert streamed.target.embedding is not None
    assert streamed.memory.mapped_embedding > 0
    streamed.generate(prompt="The quick brown fox", config=CONFIG)
    assert streamed.target.window.count == len(open_bundle(staged_bundle).target.stages) - 1


def test_window_loads_each_stage_once_when_all_fit_and_streams_otherwise():
    loaded = []

    def load(i):
        loaded.append(i)
        return f"session {i}"

    window = StageWindow([LoadedStage(lambda i=i: load(i)) for i in range(5)], pinned=range(5))
    for _ in range(3):
        assert [window.get(i) for i in range(5)] == [f"session {i}" for i in range(5)]
    assert sorted(loaded) == [0, 1, 2, 3, 4]
    window.close()

    loaded.clear()
    window = StageWindow([LoadedStage(lambda i=i: load(i)) for i in range(5)], pinned={0})
    for _ in range(3):
        for i in range(5):
            window.get(i)
            assert len(window.sessions) + len(window.pending) <= 3
    window.close()
    assert loaded.count(0) == 1  # pinned
    # streamed every pass; past the pinned stage, the next pass's first streamed stage is already on its way
    assert [loaded.count(i) for i in range(1, 5)] == [4, 3, 3, 3]

    # pinned stages between: the next streamed stage is fetched while they compute, not after them
    window = StageWindow([LoadedStage(lambda i=i: load(i)) for i in range(5)], pinned={1, 2})
    for i in range(5):
        window.get(i)
    window.get(0)
    assert 3 in window.pending or 3 in window.sessions
    assert 4 not in window.sessions  # the stage behind made the room
    window.close()

    loaded.clear()  # one slot: a streamed stage runs alone beside the pinned one, nothing fetched ahead of it
    window = StageWindow([LoadedStage(lambda i=i: load(i)) for i in range(5)], pinned={0}, slots=1)
    for _ in range(3):
        for i in range(5):
            assert window.get(i) == f"session {i}"
            assert len(window.sessions) + len(window.pending) <= 2
            if i:
                assert set(window.sessions) == {0, i} and not window.pending
    window.close()
    assert loaded.count(0) == 1 and all(loaded.count(i) == 3 for i in range(1, 5))


def test_plan_streams_below_the_weights_and_refuses_below_the_smallest_window(staged_bundle):
    manifest = open_bundle(staged_bundle)
    budget = _budget_for(staged_bundle)
    plan = plan_memory(manifest, staged_bundle, budget)
    assert plan.streams and plan.total <= budget
    assert "stages" in plan.describe() and plan.stream_slots == 2
    assert "KV room it does not use pins more stages" in plan.describe()
    assert "pins more stages" not in plan_memory(manifest, staged_bundle, None).describe()  # resident: none to pin
    # no room for two slots: one, each streamed stage fetched when its turn comes (what it frees may pin one)
    one = plan_memory(manifest, staged_bundle, budget - 1)
    assert one.streams and one.stream_slots == 1 and one.total <= budget - 1
    second_largest = sorted(plan.stage_bytes)[-2]
    plan_memory(manifest, staged_bundle, budget - second_largest)
    with pytest.raises(BudgetError, match="minimum"):
        plan_memory(manifest, staged_bundle, budget - second_largest - 1)


def test_a_bundle_without_stages_says_how_to_get_them(bundle_factory):
    folder = bundle_factory(draft="draft", context=256)
    full = plan_memory(open_bundle(folder), folder, None)
    with pytest.raises(BudgetError, match="--stages"):
        plan_memory(open_bundle(folder), folder, full.total - full.target_weights)


def test_mapped_embedding_rows_are_exact_across_page_drops(tmp_path):
    table = np.random.default_rng(0).normal(size=(50, 6)).astype(np.float16)
    (tmp_path / "w.bin").write_bytes(b"\0" * 4096 + table.tobytes())
    spec = {"file": "w.bin", "offset": 4096, "shape": [50, 6], "dtype": "float16"}
    embedding = MappedEmbedding(tmp_path, spec, reset_every=4)
    for ids in ([[1, 2, 3]], [[4, 5]], [[49, 0, 7]]):  # the second and third lookups drop the pages first
        np.testing.assert_array_equal(embedding.lookup(np.array(ids)), table[np.array(ids)].astype(np.float32))
    assert MappedEmbedding.resident_bound(spec, 4) <= table.nbytes


def test_the_largest_stages_are_pinned_first_and_the_window_fits():
    from edgespec.runtime.execution.budget import choose_pinned

    stages = [10, 40, 10, 10, 30]
    assert window_bytes(stages, ()) == 70  # two slots for the two largest
    assert choose_pinned(stages, 69) == ()
    assert choose_pinned(stages, 80) == (1,)  # 40 pinned, then slots for 30 + 10
    pinned = choose_pinned(stages, 100)
    assert 1 in pinned and 4 in pinned and window_bytes(stages, pinned) <= 100
    assert choose_pinned(stages, 1000) == (0, 1, 2, 3, 4)


def _mapped_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (Linux /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_mapped_stage_is_resident_after_fetch_and_gone_after_release(staged_bundle):
    from edgespec.runtime.execution.staged import MappedStage

    spec = open_bundle(staged_bundle).target.stages[2]
    stage = MappedStage(staged_bundle, spec, ("CPUExecutionProvider",), 1)
    weights = (staged_bundle / spec.weights[0]).resolve()
    stage.fetch()
    assert _mapped_rss_kib(weights) * 1024 >= 0.9 * weights.stat().st_size
    stage.release()
    assert _mapped_rss_kib(weights) == 0


def _prepared_stage(folder, prepared, index):
    manifest = open_bundle(folder)
    spec = manifest.target.stages[index]
    checksum = manifest.files[spec.weights[0]]
    return spec, prepacked.prepare([(folder / spec.file, checksum)], prepared)[0]


@needs_prepacked
def test_a_packed_stage_is_resident_after_fetch_and_gone_after_release(staged_bundle, prepared):
    spec, graph = _prepared_stage(staged_bundle, prepared, 2)
    stage = prepacked.PrepackedStage(graph, ("CPUExecutionProvider",), 1)
    weights = (graph.parent / prepacked.WEIGHTS).resolve()
    mapped = sum(r.high - r.low for r in stage.ranges)
    stage.fetch()
    assert _mapped_rss_kib(weights) * 1024 >= 0.9 * mapped > 0
    target = open_bundle(staged_bundle).target
    facts, cache = target.facts, KVCache(target.facts, 16, lanes=target.lanes)
    rng = np.random.default_rng(0)
    feed = dict(pass_feed(cache, GraphSignature.every_input(facts, target.lanes), [5, 6, 7], range(3), np.tril(np.ones((3, 3), bool)), [2]).feed,
                **{name: rng.standard_normal((1, 3, facts.hidden_size)).astype(np.float32) for name in ("hidden", "branch")})
    outputs = {o.name: (3, facts.hidden_size) for o in stage.session.get_outputs() if not o.name.startswith("present_")}
    before = run_bound(stage.session, cache, feed, outputs)
    stage.release()
    assert _mapped_rss_kib(weights) == 0
    with open(weights, "rb") as file:  # as if the OS had needed the memory: fetch reads the file again
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    again = run_bound(stage.fetch(), cache, feed, outputs)  # read back from the file, unchanged
    for name in outputs:
        np.testing.assert_array_equal(before[name], again[name])


@needs_prepacked
def test_packed_weights_are_prepared_once_per_stage_and_machine(staged_bundle, tmp_path):
    spec, graph = _prepared_stage(staged_bundle, tmp_path, 2)
    assert graph.parent.parent.name == prepacked.machine_key()
    written = graph.stat().st_mtime_ns
    checksum = open_bundle(staged_bundle).files[spec.weights[0]]
    assert prepacked.prepare([(staged_bundle / spec.file, checksum)], tmp_path) == [graph]
    assert graph.stat().st_mtime_ns == written
    assert prepacked.prepare([(staged_bundle / spec.file, "0" * 64)], tmp_path) != [graph]  # another bundle's stage


def test_a_failed_preparation_leaves_nothing_behind(tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a graph")
    with pytest.raises(BundleError, match="cannot pack the weights"):
        prepacked.prepare([(broken, "f" * 64)], tmp_path / "prepared")
    assert not [p for p in (tmp_path / "prepared").rglob("*") if p.is_file()]


def _cached_share(path, ranges) -> float:
    """Share of the pages of `path` behind `ranges` (file offsets) that the OS page cache holds (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    cached = total = 0
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as whole:
        base = np.frombuffer(whole, np.uint8).ctypes.data
        for r in ranges:
            start = r.offset // mmap.PAGESIZE * mmap.PAGESIZE
            pages = np.empty(-(-(r.offset + r.high - r.low - start) // mmap.PAGESIZE), np.uint8)
            assert libc.mincore(base + start, r.offset + r.high - r.low - start, pages.ctypes.data) == 0
            cached, total = cached + int((pages & 1).sum()), total + len(pages)
    return cached / total


@needs_prepacked
def test_an_evicting_stage_leaves_its_pages_out_of_the_page_cache(staged_bundle, prepared):
    spec, graph = _prepared_stage(staged_bundle, prepared, 3)
    weights = (graph.parent / prepacked.WEIGHTS).resolve()
    keeping = prepacked.PrepackedStage(graph, ("CPUExecutionProvider",), 1)
    keeping.fetch()
    keeping.release()
    if _cached_share(weights, keeping.ranges) < 0.9:
        pytest.skip("this file system does not keep file pages in a page cache of its own")
    assert _mapped_rss_kib(weights) == 0  # released, still cached: the next fetch is a page-table walk
    evicting = prepacked.PrepackedStage(graph, ("CPUExecutionProvider",), 1, evict=True)
    evicting.fetch()
    assert _cached_share(weights, evicting.ranges) > 0.9
    evicting.release()
    if _cached_share(weights, evicting.ranges) > 0.1:
        with open(weights, "rb") as file:  # can this file system drop them at all (tmpfs cannot)?
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if _cached_share(weights, evicting.ranges) > 0.1:
            pytest.skip("this file system keeps file pages whatever it is told")
        pytest.fail("release left the evicting stage's pages in the page cache")
    evicting.fetch()  # and they come back
    assert _cached_share(weights, evicting.ranges) > 0.9


@needs_prepacked
def test_plan_says_what_the_packed_copies_take_on_disk(staged_bundle, tmp_path, monkeypatch, capsys):
    import json

    from edgespec.runtime.pipeline import Pipeline

    from edgespec.cli import main

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    budget = str(_roomy_budget(staged_bundle))  # beside the files, room for what their packed copies add

    def packed():
        assert main(["plan", str(staged_bundle), "--memory-budget", budget, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["packed_copies"]

    before = packed()
    assert before["stages"] == len(open_bundle(staged_bundle).target.stages) - 1  # all but the mapped embedding
    assert before["missing"] == before["stages"] and before["written_bytes"] == 0
    Pipeline(staged_bundle, threads=1, memory_budget=budget)  # writes them, into the cache the plan reads
    after = packed()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "prepacked").rglob("*") if p.is_file())
    assert after["missing"] == 0 and after["written_bytes"] == on_disk > 0
    assert main(["plan", str(staged_bundle), "--memory-budget", budget]) == 0
    assert f"packed copies of {after['stages']} stages" in capsys.readouterr().out


@needs_prepacked
def test_where_the_kernel_refuses_to_populate_fetch_faults_the_pages_in(staged_bundle, prepared, monkeypatch):
    spec, graph = _prepared_stage(staged_bundle, prepared, 2)
    stage = prepacked.PrepackedStage(graph, ("CPUExecutionProvider",), 1)
    weights = (graph.parent / prepacked.WEIGHTS).resolve()
    monkeypatch.setattr(prepacked, "MADV_POPULATE_READ", 0x7FFF)  # advice no kernel knows: EINVAL, as before 5.14
    with open(weights, "rb") as file:
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    stage.fetch()
    assert _mapped_rss_kib(weights) * 1024 >= 0.9 * sum(r.high - r.low for r in stage.ranges) > 0
    stage.release()
    assert _mapped_rss_kib(weights) == 0


@needs_prepacked
def test_under_a_budget_the_stages_and_the_draft_take_activations_from_one_arena(staged_bundle, prepared):
    """An arena keeps the most its session ever held: one per stage held each stage's activations at once,
    where the plan counts one pass's (issue 54: a 248 MiB budget peaked at 287-316 MiB)."""
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(staged_bundle, threads=1, memory_budget=_budget_for(staged_bundle, prepared),
                        prepared_dir=prepared)
    assert pipeline.memory.streams
    sessions = [stage.session for stage in pipeline.target.window.stages] + [pipeline.draft.session]
    assert all(s.get_session_options().get_session_config_entry("session.use_env_allocators") == "1"
               for s in sessions)
    _assert_speculation_exact(pipeline)


def test_packed_copies_go_where_edgespec_packed_says(monkeypatch, tmp_path):
    from edgespec.runtime.pipeline import default_prepared_dir

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EDGESPEC_PACKED", raising=False)
    assert default_prepared_dir() == tmp_path / "cache" / "prepacked"
    monkeypatch.setenv("EDGESPEC_PACKED", str(tmp_path / "fast-disk"))
    assert default_prepared_dir() == tmp_path / "fast-disk"
