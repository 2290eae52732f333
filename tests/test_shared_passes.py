"""Conversations sharing target passes (runtime/execution/shared_passes.py over a slots graph): interleaved
generations of different lengths, plain and speculative, one sampled with a seed and one cancelled midway,
each exactly what it gets alone; and their passes were in fact shared."""
import threading

import numpy as np
import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.execution.shared_passes import open_shared
from edgespec.runtime.pipeline import Pipeline
from edgespec.serve_turns import generate_sharing

LONG = GenerationConfig(max_new_tokens=120, stop_at_eos=False)
SAMPLED = GenerationConfig(max_new_tokens=60, stop_at_eos=False,
                           sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=11))


@pytest.fixture(scope="module")
def pipeline(models, tmp_path_factory):
    from edgespec.exporters.export import ExportConfig, export

    root = tmp_path_factory.mktemp("slots_bundle")
    out = root / "bundle"
    export(ExportConfig(model=str(models["target"]), draft=str(models["draft"]), out=out, tree="chain:3",
                        context=256, slots=3, cache_dir=root / "cache"))
    return Pipeline(out, threads=1)


def generate_shared(pipeline, shared, ids, config, speculate=True, should_stop=None):
    """As serve does (edgespec/serve_turns.py), greedy trees priced against the whole shared pass (serve's
    --shared-speculation batch): the choices move more, the answers must not."""
    return generate_sharing(pipeline, shared, batch_priced=True, ids=ids, config=config, speculate=speculate,
                            should_stop=should_stop)


def test_the_bundle_records_its_slots_graph(pipeline):
    assert pipeline.manifest.target.slots is not None
    assert pipeline.manifest.target.slots.file in pipeline.manifest.files
    assert open_shared(pipeline.folder, pipeline.manifest.target, pipeline.target, 1).slots.slots == 3


def test_interleaved_conversations_get_exactly_their_answers_alone(pipeline):
    shared = open_shared(pipeline.folder, pipeline.manifest.target, pipeline.target, 1, patience_s=0.05)
    cancel_after = iter(range(12, -1, -1))  # the cancelled one stops before its 13th pass
    requests = {"greedy long, speculative": ("a b c d e f a b", LONG, True, None),
                "greedy short, plain": ("the quick brown fox", GenerationConfig(max_new_tokens=20), False, None),
                "sampled, speculative": ("one two three", SAMPLED, True, None),
                "cancelled": ("x y z x y z", LONG, True, lambda: next(cancel_after) == 0),
                "greedy long, plain": ("def add(a, b):", LONG, False, None)}
    results, errors = {}, []

    def run(name):
        prompt, config, speculate, stop = requests[name]
        try:
            results[name] = generate_shared(pipeline, shared, pipeline.encode(prompt), config, speculate, stop)
        except Exception as err:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(name,)) for name in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for name, (prompt, config, speculate, _) in requests.items():
        alone = pipeline.generate(prompt, config=config, speculate=speculate)
        got = results[name]
        if name == "cancelled":
            assert got.stop_reason == "cancelled" and 0 < len(got.token_ids) < len(alone.token_ids)
            assert got.token_ids == alone.token_ids[: len(got.token_ids)]
        else:
            assert got.token_ids == alone.token_ids, name
    assert shared.members() == 0
    assert shared.parts > 1.5 * shared.passes  # most passes held several conversations


def test_serve_shares_passes_and_answers_as_alone(pipeline):
    """`edgespec serve` on a bundle with slots: requests in flight share passes, a short one is answered
    while a long one generates, and each answer (with a client's kept conversation or none) is its own."""
    from edgespec.serve import Generations, ServeConfig

    generations = Generations(pipeline, ServeConfig(model="tiny", interleave=3))
    assert generations.shared is not None
    long_ids, short_ids = pipeline.encode("a b c d e f"), pipeline.encode("the quick brown fox")
    started, results = threading.Event(), {}
    long = threading.Thread(target=lambda: results.setdefault("long", generations._generate(
        long_ids, LONG, "ann", lambda text: started.set(), threading.Event())))
    long.start()
    assert started.wait(60)
    short = generations._generate(short_ids, GenerationConfig(max_new_tokens=4), "bob", None, threading.Event())
    assert long.is_alive()  # the short one did not wait for the long one's end
    long.join(timeout=300)
    assert short.token_ids == pipeline.generate(ids=short_ids, config=GenerationConfig(max_new_tokens=4)).token_ids
    assert results["long"].token_ids == pipeline.generate(ids=long_ids, config=LONG).token_ids
    assert generations.shared.parts > generations.shared.passes  # the short one's passes rode with the long one's
    assert generations.mean_s > 0 and set(generations.conversations.kept) == {"ann", "bob"}


def test_shared_passes_are_refused_where_the_slots_graph_would_change_bits(pipeline, monkeypatch):
    from edgespec.runtime.execution import shared_passes
    from edgespec.runtime.execution.slots import SlotRunner

    shared = open_shared(pipeline.folder, pipeline.manifest.target, pipeline.target, 1)
    assert shared_passes.keeps_bits(pipeline.target, shared.slots)
    run = SlotRunner.run

    def nudged(self, parts):  # a slots graph whose second conversation's logits move by one unit in the last place
        outs = run(self, parts)
        if len(outs) > 1:
            outs[1].logits[0, 0] = np.nextafter(outs[1].logits[0, 0], np.inf)
        return outs

    monkeypatch.setattr(SlotRunner, "run", nudged)
    assert not shared_passes.keeps_bits(pipeline.target, shared.slots)
    assert open_shared(pipeline.folder, pipeline.manifest.target, pipeline.target, 1) is None


def test_prefill_apart_runs_a_prompt_back_to_back_and_answers_as_alone(pipeline):
    """With `prefill_apart`, a joining prompt's chunks run at once, alone, while another conversation
    generates; both answers are their answers alone, and the steps after the prompts still share passes."""
    shared = open_shared(pipeline.folder, pipeline.manifest.target, pipeline.target, 1, patience_s=0.05,
                         prefill_apart=True)
    chunk = pipeline.manifest.prefill_chunk
    long_ids = pipeline.encode("a b c d e f a b")
    joining = pipeline.encode(" ".join(f"w{i}" for i in range(chunk)))[: chunk + 5]  # two chunks
    assert len(joining) == chunk + 5
    configs = {"long": LONG, "joining": GenerationConfig(max_new_tokens=24, stop_at_eos=False)}
    results, started = {}, threading.Event()

    def run(name, ids):
        results[name] = generate_sharing(pipeline, shared, ids=ids, config=configs[name], speculate=True,
                                         on_text=lambda text: started.set())

    first = threading.Thread(target=run, args=("long", long_ids))
    first.start()
    assert started.wait(60)
    run("joining", joining)
    assert first.is_alive()  # the prompt joined while the long one generated
    first.join(timeout=300)
    for name, ids in (("long", long_ids), ("joining", joining)):
        assert results[name].token_ids == pipeline.generate(ids=ids, config=configs[name]).token_ids, name
    chunks = -(-len(long_ids) // chunk) + 2
    assert shared.apart == chunks
    assert shared.parts > shared.passes  # the steps rode together


def test_steps_priced_by_the_timed_slots_passes_answer_as_alone(models, tmp_path):
    """A bundle whose steps the controller chooses (suffix drafting beside the draft): with batch pricing,
    the slots passes are timed into its shared costs (§70), the choices move on them, the answers do not."""
    from edgespec.exporters.export import ExportConfig, export

    export(ExportConfig(model=str(models["target"]), draft=str(models["draft"]), out=tmp_path / "b", suffix=True,
                        context=256, slots=3, cache_dir=tmp_path / "cache"))
    suffixed = Pipeline(tmp_path / "b", threads=1)
    shared = open_shared(suffixed.folder, suffixed.manifest.target, suffixed.target, 1, patience_s=0.05)
    prompts = ["a b c d e f a b", "the quick brown fox", "def add(a, b):"]
    config = GenerationConfig(max_new_tokens=48, stop_at_eos=False)
    results = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, generate_shared(
        suffixed, shared, suffixed.encode(p), config))) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    timed = suffixed.step_measurements.shared_costs
    assert timed and min(timed) >= 2 and any(costs.seconds_by_rows for costs in timed.values())
    for p in prompts:
        assert results[p].token_ids == suffixed.generate(p, config=config, remember=False).token_ids, p
