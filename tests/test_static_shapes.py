"""Static-shape graphs (NPU profiles), tested on the CPU provider: every dimension fixed, every pass padded
to the graph's nodes, the KV buffer whole from the start; the same greedy tokens as the dynamic graphs,
and speculation on them as lossless as anywhere. Shipped NPU profiles draft on the NPU and verify on the
CPU (a static draft beside a dynamic target); a profile that verifies on its NPU too gets a static target."""
import json
import warnings

import onnx
import pytest
from edgespec.exporters.export import ExportConfig, ExportError, export
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline
from edgespec.targets import profiles as registry
from edgespec.targets.profiles import DeviceProfile

PROMPTS = ["def add(a, b):", "The quick brown fox", "Speculative decoding drafts tokens", "{\"name\": \"edge"]
CONFIG = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
NPU_DRAFT = "ai-pc-intel"  # the draft on the NPU (static), the target verifies on the CPU (dynamic)
NPU_BOTH = "npu-both"  # a profile author's device that verifies on its NPU too: both roles static


@pytest.fixture(scope="module", autouse=True)
def npu_both_profile():
    """Adds NPU_BOTH to the shipped profiles for this module (profiles are looked up by name at every use)."""
    shipped = registry.profiles()
    both = DeviceProfile.from_dict({**shipped[NPU_DRAFT].to_dict(), "name": NPU_BOTH, "description": "both on an NPU",
                                    "static_shapes": True})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "profiles", lambda: {**shipped, NPU_BOTH: both})
        yield


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory, npu_both_profile):
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
    dynamic, static = pipeline(exported(draft, tree, "cpu")), pipeline(exported(draft, tree, NPU_BOTH))
    assert dynamic.target.static is None and static.target.static is not None
    assert static.draft is None or static.draft.static is not None
    for prompt in PROMPTS:
        expected = dynamic.generate(prompt, config=CONFIG, speculate=False).token_ids
        assert static.generate(prompt, config=CONFIG, speculate=False).token_ids == expected
        speculative = static.generate(prompt, config=CONFIG)
        assert speculative.token_ids == expected
    if draft == "target":
        assert speculative.stats.accepted_drafts > 0


@pytest.mark.parametrize("draft,tree", [("target", "topk:2x2"), ("target", "dynamic:6")])
def test_a_static_draft_drafts_for_a_dynamic_target(draft, tree, exported):
    """The shipped NPU profiles: the draft's graph is static, the target's dynamic; prompts longer than the
    draft's nodes reach it in passes of its nodes."""
    dynamic, npu = pipeline(exported(draft, tree, "cpu")), pipeline(exported(draft, tree, NPU_DRAFT))
    assert npu.target.static is None and npu.draft.static is not None
    assert npu.manifest.prefill_chunk == 64 > npu.draft.static.nodes
    for prompt in PROMPTS + [" ".join(PROMPTS)]:
        expected = dynamic.generate(prompt, config=CONFIG, speculate=False).token_ids
        speculative = npu.generate(prompt, config=CONFIG)
        assert speculative.token_ids == expected
        assert speculative.stats.accepted_drafts > 0  # the draft is the target: its tokens get accepted


def test_a_static_bundle_fixes_every_dimension(exported):
    folder = exported("target", "topk:2x2", NPU_BOTH)
    manifest = json.loads((folder / "manifest.json").read_text())
    nodes = 7  # topk:2x2: the root, two children, four grandchildren
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


@pytest.mark.parametrize("profile", [NPU_DRAFT, NPU_BOTH])
def test_a_quantized_static_bundle_measures_its_quality_in_its_own_shapes(profile, models, tmp_path):
    """The fp32 reference of a static graph is built static too, and both run in passes of the graph's nodes."""
    out = export(ExportConfig(model=str(models["target"]), draft=str(models["draft"]), out=tmp_path / "b",
                              tree="chain:3", context=128, profile=profile, quant="int4"))
    quality = json.loads((out / "quality.json").read_text())
    assert quality["heldout_tokens"] > 100 and 0 <= quality["draft_agreement"]["quantized"] <= 1
    static = pipeline(out)
    assert static.draft.static is not None and (static.target.static is not None) == (profile == NPU_BOTH)
    assert static.generate(PROMPTS[0], config=CONFIG).token_ids == static.generate(
        PROMPTS[0], config=CONFIG, speculate=False).token_ids


def test_what_a_static_bundle_cannot_do_is_refused(models, tmp_path):
    with pytest.raises(ExportError, match="stages"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", context=128,
                            profile=NPU_BOTH, stages=1))
    folder = export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "long", context=512,
                                 profile=NPU_BOTH))
    full = pipeline(folder).memory
    assert full.context == 512
    # room for everything but a quarter of the context
    short = full.runtime + full.target_weights + full.scratch + full.target_kv_per_token * 384
    with pytest.raises(InputError, match="fixed at export"):
        pipeline(folder, memory_budget=short)


def test_one_bundle_for_several_profiles(models, tmp_path):
    """`export --profile cpu --profile ai-pc-intel --profile npu-both --profile openvino-cpu`: the dynamic
    graphs serve cpu and openvino-cpu, a static draft graph serves the two NPU profiles, a static target graph
    npu-both alone; each is listed with its checksums, and each profile decodes the same tokens."""
    from edgespec.runtime.contract.manifest import open_bundle

    from edgespec.cli import main

    folder = tmp_path / "multi"
    profiles = ("cpu", NPU_DRAFT, NPU_BOTH, "openvino-cpu")
    assert main(["export", str(models["target"]), "--draft", str(models["target"]), "--out", str(folder),
                 "--tree", "topk:2x2", "--context", "128", *[a for p in profiles for a in ("--profile", p)]]) == 0
    manifest = open_bundle(folder)
    assert manifest.profile_names == profiles
    files = {name: (manifest.for_profile(name).target.graph.file, manifest.for_profile(name).draft.graph.file)
             for name in profiles}
    assert files == {"cpu": ("target.onnx", "draft.onnx"), NPU_DRAFT: ("target.onnx", "draft.static.onnx"),
                     NPU_BOTH: ("target.static.onnx", "draft.static.onnx"), "openvino-cpu": ("target.onnx", "draft.onnx")}
    for name in ("target.static.onnx", "target.static.weights", "draft.static.onnx", "draft.static.weights"):
        assert name in manifest.files
    expected = pipeline(folder).generate(PROMPTS[0], config=CONFIG, speculate=False).token_ids
    for profile in profiles[1:]:
        chosen = pipeline(folder, profile=profile)
        assert chosen.manifest.profile.name == profile and chosen.exactness.exact
        assert (chosen.target.static is not None) == (profile == NPU_BOTH)
        assert chosen.generate(PROMPTS[0], config=CONFIG).token_ids == expected
    assert main(["generate", str(folder), "--prompt", PROMPTS[0], "--max-new-tokens", "6", "--profile", NPU_BOTH,
                 "--json"]) == 0
    with pytest.raises(InputError, match="export it with --profile android"):
        pipeline(folder, profile="android")  # not exported for it: the main draft graph is dynamic
    with pytest.raises(InputError, match="unknown device profile"):
        pipeline(folder, profile="nope")
    assert pipeline(folder, profile="cpu-x86").manifest.profile.name == "cpu-x86"  # dynamic: the main graphs
    with pytest.raises(ExportError, match="twice"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "twice", context=128,
                            profile="cpu", also_profiles=("cpu",)))


def test_profiles_say_static_shapes_per_role():
    shipped = registry.profiles()
    assert shipped[NPU_DRAFT].static_draft and not shipped[NPU_DRAFT].static_verify
    assert not shipped["cpu"].static_shapes
    old = DeviceProfile.from_dict({**shipped["cpu"].to_dict(), "static_shapes": True})  # before it was per role
    assert old.static_draft and old.static_verify
    with pytest.raises(ValueError, match="static_shapes"):
        DeviceProfile.from_dict({**shipped["cpu"].to_dict(), "static_shapes": {"draft": True}})


def test_a_constraints_forced_chain_fits_a_static_pass(exported):
    static = pipeline(exported("ngram", "chain:4", NPU_BOTH))
    sentence = "The quick brown fox jumps over the lazy dog."
    config = GenerationConfig(max_new_tokens=60, constraint=ConstraintSpec.choice([sentence]))
    result = static.generate("x", config=config)
    assert result.text == sentence and result.stats.grammar_tokens > 0
    assert static.generate("x", config=config, speculate=False).token_ids == result.token_ids
