"""Static-shape graphs (NPU profiles), tested on the CPU provider: every dimension fixed, every pass padded
to the graph's nodes, the KV buffer whole from the start; the same greedy tokens as the dynamic graphs,
and speculation on them as lossless as anywhere."""
import json
import warnings

import onnx
import pytest

from edgespec.exporters.export import ExportConfig, ExportError, export
from edgespec.runtime.engine import GenerationConfig
from edgespec.runtime.errors import InputError
from edgespec.runtime.pipeline import Pipeline

PROMPTS = ["def add(a, b):", "The quick brown fox", "Speculative decoding drafts tokens", "{\"name\": \"edge"]
CONFIG = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
STATIC = "ai-pc-intel"  # the draft on the NPU: static shapes


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    made = {}

    def make(draft: str, tree: str, profile: str):
        key = (draft, tree, profile)
        if key not in made:
            source = models[draft] if draft in models else draft
            made[key] = export(ExportConfig(model=str(models["target"]), draft=str(source), out=root / str(len(made)),
                                            tree=tree, context=128, profile=profile))
        return made[key]

    return make


def pipeline(folder, **kwargs) -> Pipeline:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the profile's NPU is not here: the CPU runs the draft
        return Pipeline(folder, threads=1, **kwargs)


@pytest.mark.parametrize("draft,tree", [("target", "topk:2x2"), ("draft", "chain:3"), ("ngram", "chain:4"),
                                        ("target", "dynamic:6")])
def test_static_graphs_give_the_dynamic_graphs_tokens(draft, tree, exported):
    dynamic, static = pipeline(exported(draft, tree, "cpu")), pipeline(exported(draft, tree, STATIC))
    assert dynamic.target.static is None and static.target.static is not None
    for prompt in PROMPTS:
        expected = dynamic.generate(prompt, config=CONFIG, speculate=False).token_ids
        assert static.generate(prompt, config=CONFIG, speculate=False).token_ids == expected
        speculative = static.generate(prompt, config=CONFIG)
        assert speculative.token_ids == expected
    if draft == "target":
        assert speculative.stats.accepted_drafts > 0


def test_a_static_bundle_fixes_every_dimension_and_prefills_in_passes_of_its_nodes(exported):
    folder = exported("target", "topk:2x2", STATIC)
    manifest = json.loads((folder / "manifest.json").read_text())
    nodes = 7  # topk:2x2: the root, two children, four grandchildren
    assert manifest["steps"]["prefill_chunk"] == nodes
    for role in ("target", "draft"):
        graph = onnx.load(str(folder / f"{role}.onnx"), load_external_data=False).graph
        for value in list(graph.input) + list(graph.output):
            dims = value.type.tensor_type.shape.dim
            assert all(not d.dim_param for d in dims), (role, value.name)
        shapes = manifest[role]["graph"]["inputs"]
        assert shapes["input_ids"]["shape"] == [1, nodes]
        assert shapes["past_key_0"]["shape"][2] == 128 + nodes
    loaded = pipeline(folder)
    assert loaded.exactness.exact
    session = loaded.new_session()
    assert session.cache.data.shape[4] == 128 + nodes  # the whole buffer the graph declares, from the start
    result = loaded.generate("x " * 60, config=GenerationConfig(max_new_tokens=5), session=session)
    assert result.stats.prompt_tokens > nodes  # prefilled in several passes


def test_what_a_static_bundle_cannot_do_is_refused(models, exported, tmp_path):
    with pytest.raises(ExportError, match="stages"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", context=128,
                            profile=STATIC, stages=1))
    folder = export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "long", context=512,
                                 profile=STATIC))
    full = pipeline(folder).memory
    assert full.context == 512
    # room for everything but a quarter of the context
    short = full.runtime + full.target_weights + full.scratch + full.target_kv_per_token * 384
    with pytest.raises(InputError, match="fixed at export"):
        pipeline(folder, memory_budget=short)


def test_one_bundle_for_several_profiles(models, tmp_path):
    """`export --profile cpu --profile ai-pc-intel --profile openvino-cpu`: the dynamic graphs serve cpu and
    openvino-cpu, static graphs of their own serve ai-pc-intel, each listed with its checksums, and each
    profile decodes the same tokens."""
    from edgespec.cli import main
    from edgespec.runtime.bundle import open_bundle

    folder = tmp_path / "multi"
    assert main(["export", str(models["target"]), "--draft", str(models["target"]), "--out", str(folder),
                 "--tree", "topk:2x2", "--context", "128", "--profile", "cpu", "--profile", STATIC,
                 "--profile", "openvino-cpu"]) == 0
    manifest = open_bundle(folder)
    assert manifest.profile_names == ("cpu", STATIC, "openvino-cpu")
    static = manifest.for_profile(STATIC)
    assert static.target.graph.file == "target.static.onnx" and static.draft.graph.file == "draft.static.onnx"
    assert static.target.graph.static and not manifest.target.graph.static and static.prefill_chunk == 7
    assert manifest.for_profile("openvino-cpu").target.graph.file == "target.onnx"
    for name in ("target.static.onnx", "target.static.weights", "draft.static.onnx", "draft.static.weights"):
        assert name in manifest.files
    expected = pipeline(folder).generate(PROMPTS[0], config=CONFIG, speculate=False).token_ids
    for profile in (STATIC, "openvino-cpu"):
        chosen = pipeline(folder, profile=profile)
        assert chosen.manifest.profile.name == profile and chosen.exactness.exact
        assert (chosen.target.static is not None) == (profile == STATIC)
        assert chosen.generate(PROMPTS[0], config=CONFIG).token_ids == expected
    assert main(["generate", str(folder), "--prompt", PROMPTS[0], "--max-new-tokens", "6", "--profile", STATIC,
                 "--json"]) == 0
    with pytest.raises(InputError, match="export it with --profile android"):
        pipeline(folder, profile="android")  # static shapes this bundle does not have
    with pytest.raises(InputError, match="unknown device profile"):
        pipeline(folder, profile="nope")
    assert pipeline(folder, profile="cpu-x86").manifest.profile.name == "cpu-x86"  # dynamic: the main graphs
    with pytest.raises(ExportError, match="twice"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "twice", context=128,
                            profile="cpu", also_profiles=("cpu",)))
