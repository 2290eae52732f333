"""distill's onnx data engine (distill/engine.py) on tiny random targets: in fp32 it answers, teacher-forces and
gives features as transformers does; in int4 it computes what the bundle's int4 target graph computes."""
import numpy as np
import pytest
from edgespec.distill.data import TorchTarget
from edgespec.distill.engine import OnnxTarget, data_policy, engine_graph, top_k_logp
from edgespec.exporters.sources import resolve_source
from edgespec.quant.schemes import HEAD_INT8_POLICY
from edgespec.runtime.contract.errors import ExportError

TOP_K = 4


def _engine(models, name, quant, tmp_path, slots):
    model, _ = resolve_source(str(models[name]), tmp_path).load()
    graph, facts = engine_graph(model, tmp_path / f"engine-{name}-{quant}", quant, context=256)
    return model, OnnxTarget(graph, facts, slots, threads=1)


def _in_order(stream) -> list:
    made = dict(stream)
    assert sorted(made) == list(range(len(made)))
    return [made[i] for i in range(len(made))]


def _prompts(model, count, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, model.config.vocab_size, int(rng.integers(3, 12)))] for _ in range(count)]


@pytest.mark.parametrize("name", ["target", "qwen2"])
def test_fp32_engine_answers_as_transformers_does_with_slots_refilled(models, tmp_path, name):
    """Five prompts through two slots: every slot is refilled mid-run, and one answer ends early on a token
    declared an end of turn; tokens, their order and the top-k match transformers' greedy generation."""
    model, engine = _engine(models, name, "fp32", tmp_path, slots=2)
    prompts = _prompts(model, 5)
    reference = _in_order(TorchTarget(model, batch=8).answers(prompts, 10, TOP_K, set()))
    end_of_turn = {int(reference[1][0][reference[1][1] + 3])}  # prompt 1's fourth generated token
    reference = _in_order(TorchTarget(model, batch=1).answers(prompts, 10, TOP_K, end_of_turn))
    made = _in_order(engine.answers(prompts, 10, TOP_K, end_of_turn))
    assert len(made[1][2]) <= 4  # prompt 1's answer ended at its end of turn, and its slot took the next prompt
    for (tokens, first, ids, logp), (ref_tokens, ref_first, ref_ids, ref_logp) in zip(made, reference):
        assert first == ref_first and np.array_equal(tokens, ref_tokens)
        assert np.array_equal(ids, ref_ids)
        np.testing.assert_allclose(logp, ref_logp, atol=1e-4)


def test_a_prompt_starts_only_while_admitted_and_what_started_finishes(models, tmp_path):
    model, engine = _engine(models, "target", "fp32", tmp_path, slots=2)
    prompts = _prompts(model, 6, seed=3)
    made = dict(engine.answers(prompts, 6, TOP_K, set(), admit=lambda index: index < 3))
    assert sorted(made) == [0, 1, 2] and all(len(made[i][2]) == 6 for i in made)


def test_fp32_engine_teacher_forcing_and_features_match_transformers(models, tmp_path):
    model, engine = _engine(models, "target", "fp32", tmp_path, slots=3)
    rows = [np.array(p) for p in _prompts(model, 3, seed=1)]
    torch_target = TorchTarget(model)
    for (tokens, first, ids, logp), (_, _, ref_ids, ref_logp) in zip(
            engine.teacher_forced([r for r in rows if len(r) == len(rows[0])], TOP_K),
            torch_target.teacher_forced([r for r in rows if len(r) == len(rows[0])], TOP_K)):
        assert first == 1 and np.array_equal(ids, ref_ids)
        np.testing.assert_allclose(logp, ref_logp, atol=1e-4)
    for hidden, reference in zip(engine.features(rows), torch_target.features(rows)):
        np.testing.assert_allclose(hidden, reference, atol=1e-4)


def test_int4_engine_computes_what_the_int4_bundle_target_computes(models, tmp_path):
    """The data is the deployed target's: the engine's int4 graph (the default bundle's scheme) gives the
    log-probabilities an int4 bundle's target graph gives over the same tokens."""
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.runtime.execution.kvcache import KVCache
    from edgespec.runtime.pipeline import Pipeline

    bundle = export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", quant="int4",
                                 symmetric=False, quant_policy=HEAD_INT8_POLICY, context=256))
    runner = Pipeline(bundle, threads=1).target
    model, engine = _engine(models, "target", "int4", tmp_path, slots=1)
    row = np.array(_prompts(model, 1, seed=2)[0] * 3)
    cache = KVCache(runner.facts, len(row), lanes=runner.lanes)
    logits = runner.forward(cache, row, range(len(row)), np.tril(np.ones((len(row), len(row)), bool)),
                            range(len(row) - 1)).logits
    ref_ids, ref_logp = top_k_logp(logits, TOP_K)
    (_, _, ids, logp), = engine.teacher_forced([row], TOP_K)
    assert np.array_equal(ids, ref_ids)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)


def test_top_k_puts_the_greedy_token_first_with_full_vocabulary_log_probabilities():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, -2.0], [5.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    ids, logp = top_k_logp(logits, 3)
    assert list(ids[0]) == [1, 3, 2] and list(ids[1][:1]) == [0]
    expected = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(expected, ids, axis=1), rtol=1e-6)


def test_engine_refuses_an_unknown_quantization_and_a_sequence_past_its_buffers(models, tmp_path):
    with pytest.raises(ExportError, match="--data-quant"):
        data_policy("int3")
    model, engine = _engine(models, "target", "fp32", tmp_path, slots=1)
    buffers = engine._engine(16)
    with pytest.raises(ExportError, match="does not fit"):
        buffers.run(np.zeros((1, 17), np.int64), np.zeros(1, np.int64), [16], slot=0)
