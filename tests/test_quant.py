"""Quantized bundles: schemes recorded per graph, a quality report, and still bit-exact speculation."""
import json

import pytest
from edgespec.exporters.export import ExportConfig, export
from edgespec.quant.schemes import QuantPolicy, QuantScheme
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.exactness import fewest_exact_rows
from edgespec.runtime.pipeline import Pipeline
from rows import assert_rows_shape_invariant, assert_tree_rows_match_plain_decoding

from edgespec.cli import main

CONFIG = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
PROMPTS = ["def add(a, b):", "The quick brown fox", "a b c d e f a b c d e f a b"]


@pytest.fixture(scope="module")
def quantized(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    made = {}

    def make(quant, draft="draft", tree="topk:2x2", accuracy_level=4, **extra):
        key = (quant, draft, tree, accuracy_level, tuple(sorted(extra.items())))
        if key not in made:
            out = root / f"q{len(made)}"
            export(ExportConfig(model=str(models["target"]), draft=draft if draft == "ngram" else str(models[draft]),
                                out=out, tree=tree, context=256, quant=quant, accuracy_level=accuracy_level,
                                cache_dir=root / "cache", **extra))
            made[key] = out
        return made[key]

    return make


@pytest.mark.parametrize("quant,accuracy_level,symmetric,integer", [
    ("int4", 4, True, False), ("int4", 1, True, False), ("int8", 4, True, False), ("fp16", 4, True, False),
    ("int4", 4, False, False), ("int8", 1, False, False), ("int8", 4, True, True)])
def test_speculation_is_exact_on_quantized_bundles(quant, accuracy_level, symmetric, integer, quantized):
    for draft, tree in [("target", "chain:4"), ("draft", "topk:2x2"), ("ngram", "chain:6")]:
        pipeline = Pipeline(quantized(quant, draft=draft, tree=tree, accuracy_level=accuracy_level,
                                      symmetric=symmetric, integer_matmul=integer))
        assert pipeline.target.graph_min_rows == (1 if integer else 2)
        for prompt in PROMPTS:
            plain = pipeline.generate(prompt, config=CONFIG, speculate=False)
            spec = pipeline.generate(prompt, config=CONFIG, speculate=True)
            assert spec.token_ids == plain.token_ids, (quant, accuracy_level, draft, tree, prompt)
            assert pipeline.target.min_rows == pipeline.exactness.min_rows  # what this device's check chose
            if draft == "target":  # a quantized self-draft is still the same graph: all accepted
                assert spec.stats.accepted_drafts == 4 * spec.stats.target_passes


@pytest.mark.parametrize("accuracy_level,symmetric", [(1, True), (4, True), (4, False)])
def test_int4_rows_do_not_depend_on_the_pass_shape(accuracy_level, symmetric, quantized):
    """MatMulNBits rounds a single row differently from several on some CPUs (AVX2 without VNNI, and
    accuracy level 1 here); with >= 2 rows per pass a token's logits are the same bits alone, in a prefill
    chunk or in a tree, and so they are at the rows this device's check chooses."""
    pipeline = Pipeline(quantized("int4", draft="ngram", accuracy_level=accuracy_level, symmetric=symmetric))
    assert pipeline.target.graph_min_rows == 2
    pipeline.target.min_rows = 2  # the graph's own guarantee, before this device's verdict may lower it
    assert_rows_shape_invariant(pipeline.target, seed=3, prefix=20, chunk=7)
    assert_tree_rows_match_plain_decoding(pipeline.target, seed=4, prefix=21)
    min_rows, _, differ = fewest_exact_rows(pipeline.target)
    assert differ == [] and pipeline.target.min_rows == min_rows
    assert_rows_shape_invariant(pipeline.target, seed=5, prefix=20, chunk=7)


def test_integer_int8_rows_are_exact_from_one_row(quantized):
    """Integer matmuls need no padding row: one-token steps run one row and keep the bits of chunks and trees."""
    pipeline = Pipeline(quantized("int8", draft="ngram", integer_matmul=True))
    assert pipeline.target.min_rows == pipeline.target.graph_min_rows == 1
    assert_rows_shape_invariant(pipeline.target, seed=5, prefix=20, chunk=7)
    assert_tree_rows_match_plain_decoding(pipeline.target, seed=6, prefix=21)
    assert pipeline.check_exact()[1] == []


def test_integer_int8_is_its_own_quantization_kind(quantized):
    manifest = json.loads((quantized("int8", draft="draft", integer_matmul=True) / "manifest.json").read_text())
    assert manifest["target"]["graph"]["quantization"]["kernel"] == "integer"
    assert manifest["draft"]["graph"]["quantization"]["kernel"] == "integer"


def test_manifest_records_every_graphs_scheme_and_quality(quantized):
    bundle = quantized("int4", draft="draft", draft_quant="int8", block=64)
    manifest = json.loads((bundle / "manifest.json").read_text())
    target_q, draft_q = manifest["target"]["graph"]["quantization"], manifest["draft"]["graph"]["quantization"]
    assert target_q["scheme"] == "int4" and target_q["block_size"] == 64 and target_q["symmetric"] is True
    assert set(target_q["tensors"].values()) == {"int4"}
    assert draft_q["scheme"] == "int8"
    quality = json.loads((bundle / "quality.json").read_text())
    assert "quality.json" in manifest["files"]
    assert quality["perplexity"]["fp32"] > 1 and quality["perplexity"]["quantized"] > 1
    assert 0 <= quality["greedy_agreement"]["top1_agreement"] <= 1
    assert set(quality["draft_agreement"]) == {"fp32", "quantized"}
    # by rank: the first is draft_agreement's, and the ranks are disjoint events (one token is the target's)
    by_rank = quality["draft_agreement_by_rank"]["quantized"]
    assert len(by_rank) == 4 and by_rank[0] == pytest.approx(quality["draft_agreement"]["quantized"], abs=1e-4)
    assert all(r >= 0 for r in by_rank) and sum(by_rank) <= 1 + 1e-6


def test_quantized_ngram_bundles_draft_one_token_unless_quoting(quantized, bundle_factory):
    """A quantized row costs a row of int8 compute: one n-gram token takes the padding row's place for free."""
    for bundle, cut in ((quantized("int4", draft="ngram", tree="chain:6"), 1), (bundle_factory(draft="ngram"), 5)):
        assert json.loads((bundle / "manifest.json").read_text())["tree"]["ngram"]["partial_match_depth"] == cut


def test_int4_is_smaller_than_int8_smaller_than_fp32(quantized, bundle_factory):
    sizes = {q: (quantized(q, draft="ngram") / "target.weights").stat().st_size for q in ("int4", "int8", "fp16")}
    fp32 = (bundle_factory() / "target.weights").stat().st_size
    assert sizes["int4"] < sizes["int8"] < fp32 and sizes["fp16"] < fp32


def test_policy_keeps_named_tensors_at_higher_precision(quantized, tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"tensors": {"lm_head": "int8", "layers.0.*": "fp32", "embed_tokens": "fp32"}}))
    bundle = quantized("int4", draft="ngram", quant_policy=policy)
    tensors = json.loads((bundle / "manifest.json").read_text())["target"]["graph"]["quantization"]["tensors"]
    assert tensors["lm_head"] == "int8" and tensors["embed_tokens"] == "fp32"
    assert tensors["layers.0.qkv"] == "fp32" and tensors["layers.1.qkv"] == "int4"
    pipeline = Pipeline(bundle)
    plain = pipeline.generate(PROMPTS[0], config=CONFIG, speculate=False)
    assert pipeline.generate(PROMPTS[0], config=CONFIG).token_ids == plain.token_ids


@pytest.mark.parametrize("content,message", [
    ("{", "cannot read the quantization policy"),
    ('{"tensors": {"layer.0.*": "int8"}}', "names no weight of this model: layer.0"),
    ('{"tensors": {"lm_head": "int3"}}', "asks for 'int3'"),
    ('{"layers": {}}', "a policy holds"),
    ('{"tensors": {"embed_tokens": "int8"}}', "4-bit tables only"),  # was stored fp32 without a word
])
def test_bad_policy_files(content, message, models, tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(content)
    with pytest.raises(ExportError, match=message):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", quant="int4",
                            quant_policy=policy, context=256, cache_dir=tmp_path))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("flags,message", [(["--quant", "int3"], "unknown quantization"),
                                           (["--quant", "int4", "--block", "48"], "block size 48"),
                                           (["--quant", "int4", "--integer-matmul"], "--integer-matmul is a scheme"),
                                           (["--quant", "int8", "--asymmetric", "--integer-matmul"],
                                            "--integer-matmul is a scheme")])
def test_bad_quant_flags(flags, message, models, tmp_path, capsys):
    assert main(["export", str(models["target"]), "--draft", "ngram", "--out", str(tmp_path / "b"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_policy_scheme_lookup_is_ordered_globs():
    policy = QuantPolicy(QuantScheme("int4"), (("layers.0.*", "fp32"), ("layers.*", "int8")))
    assert policy.scheme_for("layers.0.qkv").name == "fp32"
    assert policy.scheme_for("layers.12.down").name == "int8"
    assert policy.scheme_for("lm_head").name == "int4"


def test_inspect_prints_the_quality_report(quantized, capsys):
    assert main(["inspect", str(quantized("int4", draft="draft"))]) == 0
    out = capsys.readouterr().out
    assert "quality" in out and "perplexity" in out and "int4" in out


def test_a_short_context_still_gets_a_quality_report(models, tmp_path):
    out = tmp_path / "short"
    export(ExportConfig(model=str(models["target"]), draft="ngram", out=out, context=64, quant="int8", cache_dir=tmp_path))
    assert json.loads((out / "quality.json").read_text())["greedy_agreement"]["tokens"] > 0


@pytest.mark.parametrize("model,quant,policy,head", [
    ("untied", "fp16", {}, "fp16"),                      # an untied head is stored in half precision too
    ("target", "fp16", {"lm_head": "fp32"}, "fp32"),     # a tied head kept at fp32 gets its own copy
    ("target", "int4", {"lm_head": "fp16"}, "fp16"),
    ("target", "int4", {}, "int4"),
])
def test_the_head_gets_the_scheme_the_manifest_says(model, quant, policy, head, models, tmp_path):
    import onnx

    file = tmp_path / "policy.json"
    file.write_text(json.dumps({"tensors": policy}))
    out = tmp_path / "b"
    export(ExportConfig(model=str(models[model]), draft="ngram", out=out, context=64, quant=quant,
                        quant_policy=file if policy else None, cache_dir=tmp_path))
    assert json.loads((out / "manifest.json").read_text())["target"]["graph"]["quantization"]["tensors"]["lm_head"] == head
    graph = onnx.load(out / "target.onnx", load_external_data=False).graph
    head_inputs = {name for node in graph.node if node.op_type in ("MatMul", "Gemm", "MatMulNBits") for name in node.input}
    stored = {t.name: t.data_type for t in graph.initializer}
    if head == "fp16":
        assert stored.get("lm_head.fp16") == onnx.TensorProto.FLOAT16 and "lm_head" in head_inputs  # via its Cast
    elif head == "fp32":
        assert stored.get("lm_head") == onnx.TensorProto.FLOAT and "lm_head" in head_inputs
    else:
        assert "lm_head_Q4" in head_inputs
    pipeline = Pipeline(out)
    assert pipeline.generate(PROMPTS[0], config=CONFIG).token_ids == pipeline.generate(
        PROMPTS[0], config=CONFIG, speculate=False).token_ids


def test_manifest_keeps_block_settings_when_only_some_tensors_are_int(quantized, tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"tensors": {"layers.*": "int4"}}))
    bundle = quantized("fp32", draft="ngram", quant_policy=policy)
    q = json.loads((bundle / "manifest.json").read_text())["target"]["graph"]["quantization"]
    assert q["scheme"] == "fp32" and q["block_size"] == 32 and q["tensors"]["layers.0.qkv"] == "int4"
