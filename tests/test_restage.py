"""`edgespec stage BUNDLE --stages N`: an exported bundle's target cut into stages in place, as an export with
--stages would have written them, each weight stored once, the bundle replaced whole or not at all."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from edgespec.runtime.contract.errors import BundleError, ExportError
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.decoding.engine import GenerationConfig

CONFIG = GenerationConfig(max_new_tokens=24)
SAY = lambda message: None  # noqa: E731


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    """A six-layer int4 target exported whole, and the same exported with --stages 3."""
    from edgespec.exporters.export import ExportConfig, export
    from tiny import make_model

    root = tmp_path_factory.mktemp("restage")
    make_model(root / "deep", "llama", seed=5, layers=6)
    made = {}
    for stages in (0, 3):
        made[stages] = export(ExportConfig(model=str(root / "deep"), draft=str(models["draft"]), tree="topk:2x2",
                                           out=root / f"b{stages}", context=128, stages=stages, quant="int4"))
    return made


@pytest.fixture
def whole(exported, tmp_path):
    """A copy of the unstaged bundle a test may change."""
    return Path(shutil.copytree(exported[0], tmp_path / "bundle"))


def _stored_once(folder: Path) -> None:
    """Every graph of the target reads each weight from one place, and no file holds bytes nothing reads."""
    manifest = open_bundle(folder)
    read = set()
    for spec in (manifest.target.graph, *manifest.target.stages):
        model = onnx.load(str(folder / spec.file), load_external_data=False)
        read |= {tuple(e.value for e in t.external_data if e.key == "location") for t in model.graph.initializer
                 if t.data_location == onnx.TensorProto.EXTERNAL}
    files = {name for spec in (manifest.target.graph, *manifest.target.stages) for name in spec.weights}
    assert {r[0] for r in read} == files
    assert not (folder / "target.weights").exists() or "target.weights" in manifest.target.graph.weights


def _decode(folder: Path, **load):
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(folder, threads=1, **load)
    return [pipeline.generate(prompt=p, config=CONFIG, speculate=s).token_ids
            for p in ("The quick brown fox", "def add(a, b):") for s in (False, True)]


def test_restaged_bundle_has_the_exported_stages_and_decodes_the_same(exported, whole, tmp_path):
    from edgespec.exporters.restage import restage

    expected = _decode(exported[0])
    manifest = restage(whole, 3, SAY)
    staged = open_bundle(exported[3])
    assert [(s.file, s.layers, s.inputs, s.outputs) for s in manifest.target.stages] == \
        [(s.file, s.layers, s.inputs, s.outputs) for s in staged.target.stages]
    assert manifest.target.stages[0].embedding_table is not None
    _stored_once(whole)
    # the stage files hold what the exporter's do (the same weights, the same alignment)
    for spec in manifest.target.stages:
        assert (whole / spec.weights[0]).stat().st_size == (exported[3] / spec.weights[0]).stat().st_size
    decoded = _decode(whole)
    assert decoded == expected
    assert decoded[0::2] == decoded[1::2]  # speculative equals plain
    # streamed under a budget too small for the whole target: the stages' bits are the single graph's
    from test_staged import _budget_for

    packed = tmp_path / "packed"
    assert _decode(whole, memory_budget=_budget_for(whole, packed), prepared_dir=packed) == expected


def test_restaging_changes_the_count_and_zero_removes_the_stages(exported, tmp_path):
    from edgespec.exporters.restage import restage

    folder = Path(shutil.copytree(exported[3], tmp_path / "bundle"))
    expected = _decode(exported[0])
    assert len(restage(folder, 2, SAY).target.stages) == 4  # the embedding, 2 groups, the head
    _stored_once(folder)
    assert _decode(folder) == expected
    manifest = restage(folder, 0, SAY)
    assert manifest.target.stages == () and manifest.target.graph.weights == ("target.weights",)
    assert sorted(p.name for p in folder.glob("target.stage*")) == []
    assert _decode(folder) == expected
    # what export writes without stages, byte for byte in its weights
    assert (folder / "target.weights").read_bytes() == (exported[0] / "target.weights").read_bytes()


def test_a_failed_restage_leaves_the_bundle_as_it_was(whole, monkeypatch):
    from edgespec.exporters import restage as module

    before = {p.name: p.read_bytes() for p in whole.iterdir()}
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return cut(*args, **kwargs)

    cut = module.cut_stage
    monkeypatch.setattr(module, "cut_stage", failing)
    with pytest.raises(ExportError, match="nothing of it left behind"):
        module.restage(whole, 2, SAY)
    assert {p.name: p.read_bytes() for p in whole.iterdir()} == before
    assert [p.name for p in whole.parent.iterdir() if p.name.startswith(".")] == []


def test_bad_requests_are_refused_in_one_line_before_anything_is_written(whole, exported):
    from edgespec.exporters.restage import restage

    with pytest.raises(ExportError, match="between 1 and the model's 6 layers"):
        restage(whole, 7, SAY)
    # a graph from before layer boundaries were recorded
    model = onnx.load(str(whole / "target.onnx"), load_external_data=False)
    del model.metadata_props[:]
    onnx.save_model(model, whole / "target.onnx")
    with pytest.raises(BundleError, match="checksum mismatch for target.onnx"):
        restage(whole, 2, SAY)
    manifest = json.loads((whole / "manifest.json").read_text())
    from edgespec.runtime.contract.manifest import sha256_file

    manifest["files"]["target.onnx"] = sha256_file(whole / "target.onnx")
    (whole / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="does not record where its layers begin"):
        restage(whole, 2, SAY)


def test_the_command_line_restages(whole):
    done = subprocess.run([sys.executable, "-m", "edgespec.cli", "stage", str(whole), "--stages", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "4 stages" in done.stdout
    assert len(open_bundle(whole).target.stages) == 4
    bad = subprocess.run([sys.executable, "-m", "edgespec.cli", "stage", str(whole.parent / "missing"),
                          "--stages", "2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no bundle at" in bad.stderr


def test_the_export_checks_streamed_in_stages_give_the_whole_graphs_verdicts(exported):
    """An export's checks of a target too large to hold run it in stages cut from its graph: the same
    passes, so the same exactness verdict and the same rows, and nothing left beside the graph."""
    from edgespec.exporters.check_target import CheckMemory, checked_target
    from edgespec.runtime.decoding.exactness import fewest_exact_rows
    from edgespec.runtime.execution.staged import StagedRunner
    from test_staged import _first_pass

    folder = exported[0]
    facts = open_bundle(folder).target.facts
    before = sorted(p.name for p in folder.iterdir())
    with checked_target(folder / "target.onnx", facts) as resident, \
            checked_target(folder / "target.onnx", facts, CheckMemory(0, 1, 1)) as streamed:
        assert isinstance(streamed, StagedRunner) and not isinstance(resident, StagedRunner)
        assert len(streamed.window.pinned) < streamed.window.count
        expected, actual = _first_pass(resident), _first_pass(streamed)
        assert np.array_equal(expected[0], actual[0]) and np.array_equal(expected[1], actual[1])
        assert fewest_exact_rows(streamed)[:2] == fewest_exact_rows(resident)[:2]
    # the exactness check of a streamed target: its embedding, first layers and head, all resident
    with checked_target(folder / "target.onnx", facts, CheckMemory(0, 1, 1), prefix=2) as prefix:
        assert prefix.window.count == 3 and len(prefix.window.pinned) == 3 and prefix.facts.num_layers == 2
        min_rows, compared, differ = fewest_exact_rows(prefix)
        assert (min_rows, compared) == fewest_exact_rows(resident)[:2] and not differ
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_prefix_holds_a_layer_of_every_kind():
    from edgespec.exporters.check_target import layers_of_every_kind

    assert layers_of_every_kind([(None, "")] * 32) == 1
    gemma = [(512, "local")] * 5 + [(None, "global")]
    assert layers_of_every_kind(gemma * 4) == 6
    assert layers_of_every_kind([(None, "a"), (4, "b"), (None, "a")]) == 2


def test_an_export_whose_checks_stream_records_the_same_verdict(models, exported, tmp_path, monkeypatch):
    """With the target above the checks' streaming size, the export still checks it (in stages, a shorter
    sample) and records the same exactness verdict as checking it whole; nothing of the stages is left."""
    from edgespec.exporters import check_target
    from edgespec.exporters.export import ExportConfig, export

    monkeypatch.setattr(check_target, "CHECKS", check_target.CheckMemory(0, 1, 1))
    folder = export(ExportConfig(model=str(exported[0].parent / "deep"), draft=str(models["draft"]),
                                 tree="topk:2x2", out=tmp_path / "b", context=128, quant="int4"))
    streamed, whole = (json.loads((f / "manifest.json").read_text()) for f in (folder, exported[0]))
    assert streamed["exactness"]["exact"] == whole["exactness"]["exact"]
    assert streamed["exactness"]["min_rows"] == whole["exactness"]["min_rows"]
    quality = json.loads((folder / "quality.json").read_text())
    from edgespec.exporters.quality import PROMPTS, STREAMED_NEW_TOKENS

    assert quality["greedy_agreement"]["tokens"] == PROMPTS * STREAMED_NEW_TOKENS
    assert not list(folder.glob(".*")) and (folder / "target.weights").read_bytes() == \
        (exported[0] / "target.weights").read_bytes()


def test_a_target_returning_earlier_layers_features_is_not_staged(tmp_path):
    """An EAGLE-3 head's target returns features of three of its layers from its head: no cut holds them."""
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.exporters.restage import restage
    from heads import write_eagle3_head
    from tiny import make_model

    make_model(tmp_path / "target", "llama", seed=3, layers=4)
    head = write_eagle3_head(tmp_path / "head", tmp_path / "target", aux_ids=[0, 1, 2])
    folder = export(ExportConfig(model=str(tmp_path / "target"), draft=str(head), tree="chain:3",
                                 out=tmp_path / "b", context=128))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ExportError, match="cannot be re-staged"):
        restage(folder, 2, SAY)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_target_no_stage_can_be_cut_from_is_checked_whole(tmp_path, monkeypatch):
    """Above the streaming size, a graph the checks cannot cut (an EAGLE-3 head's target) is checked whole:
    the export succeeds, its speculative output equal to plain."""
    from edgespec.exporters import check_target
    from edgespec.exporters.export import ExportConfig, export
    from heads import write_eagle3_head
    from tiny import make_model

    monkeypatch.setattr(check_target, "CHECKS", check_target.CheckMemory(0, 1, 1))
    make_model(tmp_path / "target", "llama", seed=3, layers=4)
    head = write_eagle3_head(tmp_path / "head", tmp_path / "target", aux_ids=[0, 1, 2])
    folder = export(ExportConfig(model=str(tmp_path / "target"), draft=str(head), tree="chain:3",
                                 out=tmp_path / "b", context=128, quant="int4"))
    assert not list(folder.glob(".*"))  # nothing of a cut left beside the graph
    decoded = _decode(folder)
    assert decoded[0::2] == decoded[1::2]
