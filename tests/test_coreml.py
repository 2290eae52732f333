"""CoreML packages: what can be checked without a Mac. The saved packages are read back (their functions,
inputs, outputs, states and compression against the manifest), their MIL programs run in numpy
(exporters/mil_reference.py) against the fp32 model, and the Pipeline decodes on that reference through the
CoreML runner (runtime/execution/coreml.py) and the one decode loop: speculative output must equal plain
decoding through the same verify function. The ONNX path's stop-string and chat tests run on this backend too
(tests/conftest.py `backend`)."""
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from edgespec.exporters.export import ExportConfig, export
from edgespec.exporters.mil_reference import (
    load_program,
    reference_logits,
    reference_predictor,
)
from edgespec.runtime.contract.errors import BundleError, ExportError, InputError
from edgespec.runtime.contract.manifest import open_bundle, read_manifest, verify_files
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.execution.coreml import CoreMLRunner
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.execution.runner import Cache, Runner
from edgespec.runtime.pipeline import Pipeline

PROMPT = [5, 17, 33, 2, 90, 41, 7, 12, 100, 3, 64, 9, 150, 21]


@pytest.fixture(scope="module")
def coreml_bundles(models, tmp_path_factory):
    """(a) target + an unrelated draft, both KV forms, int8 (drafts get rejected);
    (b) target drafting for itself, KV as states, fp16, the apple profile (every draft accepted; semantics
    checked in fp32); (c) a draft that reads the target's features, with a trimmed head, both KV forms."""
    from test_features import write_feature_draft

    root = tmp_path_factory.mktemp("coreml")
    made = {}
    for key, draft, kv, compress, profile in (("int8", models["draft"], ("state", "io"), "int8", "cpu"),
                                              ("self", models["target"], ("state",), "fp16", "apple"),
                                              ("features", write_feature_draft(root / "eagle"), ("state", "io"),
                                               "fp16", "cpu")):
        made[key] = export(ExportConfig(model=str(models["target"]), draft=str(draft), out=root / key, tree="chain:3",
                                        context=96, prefill_chunk=8, formats=("onnx", "coreml"), coreml_kv=kv,
                                        coreml_compress=compress, profile=profile, cache_dir=root / "cache"))
    return made


def _hf_logits(model_folder, ids, round_to_fp16=False) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32).eval()
    if round_to_fp16:  # what the package stores: fp16 weights and rotary tables
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.half().float())
        rotary = model.model.rotary_emb.forward
        model.model.rotary_emb.forward = lambda *a, **k: tuple(t.half().float() for t in rotary(*a, **k))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _reference_logits(folder, manifest, kv, ids, activations=np.float16) -> np.ndarray:
    """Logits of every token of `ids`: a prefill chunk, then the verify function on the rest."""
    packages = [p for p in manifest.coreml if p.role == "target" and p.kv == kv]
    return reference_logits(folder, packages, manifest.target.facts, ids, activations)


def test_packages_hold_what_the_manifest_says(coreml_bundles):
    folder = coreml_bundles["int8"]
    manifest = open_bundle(folder)
    assert {(p.role, p.kv) for p in manifest.coreml} == {("target", "state"), ("target", "io"), ("draft", "state"),
                                                         ("draft", "io")}
    for package in manifest.coreml:
        program, spec = load_program(folder / package.file)
        model_facts = manifest.target.facts if package.role == "target" else manifest.draft.facts
        cache_shape = (model_facts.num_layers, model_facts.num_kv_heads, package.capacity, model_facts.head_dim)
        assert set(package.functions) <= set(program.functions) or (package.kv == "io" and set(program.functions) == {"main"})
        described = spec.description.functions if package.kv == "state" else [spec.description]
        assert len(described) == len(package.functions)
        for name, nodes in package.functions.items():
            function = program.functions[name if package.kv == "state" else "main"]
            shapes = {v.name: tuple(v.shape) for v in function.inputs.values()}
            assert shapes["input_ids"] == (1, nodes) and shapes["position_ids"] == (nodes,)
            assert shapes["key_cache"] == shapes["value_cache"] == cache_shape
            outputs = {v.name: tuple(v.shape) for v in function.outputs}
            assert outputs["logits"] == (1, nodes, model_facts.vocab_size)
            if package.kv == "io":
                assert outputs["new_keys"] == (cache_shape[0], cache_shape[1], nodes, cache_shape[3])
            ops = {op.op_type for op in function.operations}
            # int8 weights, expanded on the device: iOS 18's op for stateful packages, iOS 16's for the fallback
            assert ("constexpr_blockwise_shift_scale" if package.kv == "state" else "constexpr_affine_dequantize") in ops
            assert ("read_state" in ops) == (package.kv == "state")
        states = [s.name for f in described for s in f.state] if package.kv == "state" else []
        assert set(states) == ({"key_cache", "value_cache"} if package.kv == "state" else set())
    assert manifest.coreml[0].parents == {"verify": (-1, 0, 1, 2)}
    assert {p.compute_units for p in manifest.coreml} == {"CPU_ONLY"}  # the cpu profile runs both on the CPU
    apple = open_bundle(coreml_bundles["self"])  # the apple profile: the draft on the Neural Engine
    assert {(p.role, p.compute_units) for p in apple.coreml} == {("target", "CPU_ONLY"), ("draft", "CPU_AND_NE")}


def test_program_semantics_match_the_model(coreml_bundles, models):
    """In fp32 activations the program computes what the model computes with fp16 weights: the prefill
    rows to float precision; verify rows read the fp16 KV cache, so they differ by its rounding only."""
    folder = coreml_bundles["self"]
    manifest = open_bundle(folder)
    expected = _hf_logits(models["target"], PROMPT, round_to_fp16=True)
    got = _reference_logits(folder, manifest, "state", PROMPT, activations=np.float32)
    scale = np.abs(expected).max()
    assert np.abs(got[:8] - expected[:8]).max() < 1e-5 * scale
    assert np.abs(got - expected).max() < 2e-3 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("kv", ["state", "io"])
def test_fp16_int8_packages_against_the_fp32_model(coreml_bundles, models, kv):
    folder = coreml_bundles["int8"]
    manifest = open_bundle(folder)
    expected = _hf_logits(models["target"], PROMPT)
    got = _reference_logits(folder, manifest, kv, PROMPT)
    # a random model's weights (std 0.3) make int8 per channel a rough fit: measured mean error 0.048 of the
    # logits' spread, argmax agreement 0.86; a wrong weight layout or mask scores near 1 and 0.0x
    assert np.abs(got - expected).mean() < 0.1 * expected.std()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.8


def _coreml(folder, kv="state") -> Pipeline:
    return Pipeline(folder, backend="coreml", predictor=reference_predictor, coreml_kv=kv)


@pytest.mark.parametrize("key,kv", [("int8", "state"), ("int8", "io"), ("self", "state"), ("features", "state"),
                                    ("features", "io")])
def test_speculative_equals_plain_through_the_pipeline(coreml_bundles, key, kv):
    pipeline = _coreml(coreml_bundles[key], kv)
    assert isinstance(pipeline.target, CoreMLRunner) and isinstance(pipeline.draft, CoreMLRunner)
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    plain = pipeline.generate(ids=PROMPT, config=config, speculate=False)
    spec = pipeline.generate(ids=PROMPT, config=config)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 20
    assert plain.stats.target_passes == 19  # the first token comes from prefill, then one verify call per token
    if key == "self":  # the draft is the target: every drafted token of the chain of 3 is accepted
        assert spec.stats.target_passes == 5 and spec.stats.mean_accepted_per_pass == 4
    else:
        assert spec.stats.target_passes <= plain.stats.target_passes


def test_every_runner_and_cache_is_what_the_loop_calls(coreml_bundles):
    onnx, coreml = Pipeline(coreml_bundles["int8"], backend="onnx"), _coreml(coreml_bundles["int8"])
    assert isinstance(onnx.target, ModelRunner) and isinstance(coreml.target, CoreMLRunner)
    for pipeline in (onnx, coreml):
        assert isinstance(pipeline.target, Runner) and isinstance(pipeline.draft, Runner)
        assert isinstance(pipeline.new_session().cache, Cache) and isinstance(pipeline.new_draft_cache(), Cache)
    assert coreml.context == onnx.context == 96 and coreml.tree.parents == (-1, 0, 1, 2)
    assert coreml.target.tree_limit == 4 and coreml.target.pass_limit == 8  # verify's nodes, prefill's chunk


def test_the_backend_follows_the_bundle_and_the_device(coreml_bundles):
    """auto: CoreML for the apple profile's bundle where a predictor runs its packages, else the ONNX graphs."""
    assert Pipeline(coreml_bundles["self"], predictor=reference_predictor).backend == "coreml"
    assert Pipeline(coreml_bundles["self"]).backend == "onnx"  # no predictor here: not a Mac
    assert Pipeline(coreml_bundles["int8"], predictor=reference_predictor).backend == "onnx"  # the cpu profile
    with pytest.raises(InputError, match="needs a predictor"):
        Pipeline(coreml_bundles["int8"], backend="coreml")
    with pytest.raises(InputError, match="memory budget and a placement plan the ONNX graphs"):
        Pipeline(coreml_bundles["int8"], memory_budget="1GB", backend="coreml", predictor=reference_predictor)
    with pytest.raises(InputError, match="unknown backend 'tpu'"):
        Pipeline(coreml_bundles["int8"], backend="tpu")
    with pytest.raises(InputError, match="exactness check compares the ONNX graphs"):
        _coreml(coreml_bundles["int8"]).check_exact()


def test_sampling_runs_on_the_packages_and_its_seed_repeats_it(coreml_bundles):
    pipeline = _coreml(coreml_bundles["int8"])
    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False, sampling=SamplingConfig(temperature=0.8, seed=3))
    first, again = pipeline.generate(ids=PROMPT, config=config), pipeline.generate(ids=PROMPT, config=config)
    greedy = pipeline.generate(ids=PROMPT, config=GenerationConfig(max_new_tokens=12, stop_at_eos=False))
    assert first.token_ids == again.token_ids and len(first.token_ids) == 12
    assert first.token_ids != greedy.token_ids


def test_constrained_output_takes_forced_chains_through_the_verify_function(coreml_bundles):
    """The grammar's forced tokens and the draft's chain after them are cut to the verify function's nodes."""
    import re

    from edgespec.runtime.decoding.constraints import ConstraintSpec

    pipeline = _coreml(coreml_bundles["self"])
    pattern = "[a-z]{3} (alpha|beta|gamma)[0-9]{2}"
    config = GenerationConfig(max_new_tokens=24, constraint=ConstraintSpec.regex(pattern))
    plain, spec = pipeline.generate("hello", config=config, speculate=False), pipeline.generate("hello", config=config)
    assert spec.token_ids == plain.token_ids and re.fullmatch(pattern, spec.text)
    assert spec.stats.grammar_tokens > 0 and spec.stats.target_passes < plain.stats.target_passes


def test_a_sliding_cache_moves_io_rows_and_refuses_states(coreml_bundles):
    """The context holds 96 tokens; 120 new ones slide it. CoreML keeps a state's rows out of reach."""
    config = GenerationConfig(max_new_tokens=120, stop_at_eos=False, kv_policy="sliding")
    slid = _coreml(coreml_bundles["int8"], "io").generate(ids=PROMPT, config=config)
    assert len(slid.token_ids) == 120 and slid.stop_reason == "max_new_tokens"
    with pytest.raises(InputError, match="CoreML keeps inside its states"):
        _coreml(coreml_bundles["int8"], "state").generate(ids=PROMPT, config=config)


def test_package_files_are_checksummed(coreml_bundles, tmp_path):
    import shutil

    folder = tmp_path / "b"
    shutil.copytree(coreml_bundles["int8"], folder)
    manifest = read_manifest(folder)
    assert all(name in manifest.files for name in (f"{p.file}/Manifest.json" for p in manifest.coreml))
    stray = folder / manifest.coreml[0].file / "Data" / "extra.bin"
    stray.write_bytes(b"x")
    with pytest.raises(BundleError, match="no checksum"):
        verify_files(folder, manifest)
    stray.unlink()
    weights = next((folder / manifest.coreml[0].file).rglob("weight.bin"))
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(BundleError, match="checksum mismatch"):
        verify_files(folder, manifest)


def test_packages_are_written_with_the_umask(coreml_bundles):
    for path in (coreml_bundles["int8"] / "coreml").rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        umask = os.umask(0)
        os.umask(umask)
        assert mode == (0o777 if path.is_dir() else 0o666) & ~umask, path


def test_inspect_lists_the_packages(coreml_bundles):
    out = subprocess.run([sys.executable, "-m", "edgespec.cli", "inspect", str(coreml_bundles["int8"])],
                         capture_output=True, text=True, check=True).stdout
    assert "coreml/target.mlpackage: target, KV as state, prefill 8 tokens, verify 4 tokens; int8 weights" in out
    assert "coreml/draft-step-io.mlpackage: draft, KV as io, step 1 tokens" in out


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the CoreML backend runs")
def test_coreml_backend_is_refused_off_macos(coreml_bundles):
    run = subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", str(coreml_bundles["int8"]),
                          "--prompt", "hi", "--backend", "coreml"], capture_output=True, text=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "CoreML packages run only on macOS" in run.stderr and "onnxruntime" in run.stderr
    # an apple bundle decodes on its ONNX graphs here unless CoreML is asked for
    run = subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", str(coreml_bundles["self"]),
                          "--prompt", "hi", "--max-new-tokens", "4"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("settings,message", [
    (dict(formats=("coreml",)), "always holds the ONNX graphs"),
    (dict(formats=("onnx", "tflite")), "--format takes"),
    (dict(tree="topk:2x2"), "verify chains"),
    (dict(coreml_compress="int3"), "--coreml-compress takes"),
    (dict(coreml_compress="int4"), "'io' fallback"),
    (dict(coreml_kv=("disk",)), "--coreml-kv takes"),
])
def test_bad_coreml_settings_fail_before_work(models, tmp_path, settings, message):
    config = dict(model=str(models["target"]), draft=str(models["draft"]), out=tmp_path / "b", context=96,
                  formats=("onnx", "coreml"), cache_dir=tmp_path / "cache")
    with pytest.raises(ExportError, match=message):
        export(ExportConfig(**{**config, **settings}))
    assert not (tmp_path / "b").exists()


def test_manifest_round_trip_keeps_the_packages(coreml_bundles):
    from edgespec.runtime.contract.manifest import Manifest

    data = json.loads((coreml_bundles["int8"] / "manifest.json").read_text())
    assert Manifest.from_dict(data).to_dict() == data
    data["coreml"]["packages"][0]["kv"] = "disk"
    with pytest.raises(BundleError, match="malformed"):
        Manifest.from_dict(data)


@pytest.mark.reference
def test_reference_model_with_its_shipped_draft_converts_and_decodes(tmp_path):
    """SmolLM2 and the shipped draft (which reads the target's features) as CoreML packages: they hold what
    the manifest says, and the Pipeline on them, run on the saved programs, gives plain decoding's tokens."""
    from edgespec.defaults import _default_draft_folder

    folder = export(ExportConfig(model="default", draft=str(_default_draft_folder()), out=tmp_path / "b", tree="chain:1",
                                 context=256, formats=("onnx", "coreml"), coreml_kv=("state",), coreml_compress="int8"))
    manifest = open_bundle(folder)
    assert [(p.role, p.functions) for p in manifest.coreml] == [("target", {"prefill": 64, "verify": 2}),
                                                               ("draft", {"prefill": 64, "step": 1})]
    _, spec = load_program(folder / manifest.coreml[1].file)
    inputs = {i.name for f in spec.description.functions for i in f.input}
    assert "features" in inputs  # the eagle draft reads the target's features

    pipeline = _coreml(folder)
    ask = dict(messages=[{"role": "user", "content": "Name three colors."}],
               config=GenerationConfig(max_new_tokens=12, stop_at_eos=False))
    plain, spec = pipeline.generate(**ask, speculate=False), pipeline.generate(**ask)
    assert spec.token_ids == plain.token_ids and spec.stats.target_passes < plain.stats.target_passes
