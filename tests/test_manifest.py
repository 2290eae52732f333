"""The manifest has one owner: what the exporter and `tune` write is exactly `Manifest.to_dict`, and
reading it back gives the same typed manifest."""
import json

import pytest
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.drafting import LookupConfig
from edgespec.runtime.contract.errors import BundleError
from edgespec.runtime.contract.manifest import MANIFEST, Manifest, read_manifest, write_manifest
from edgespec.runtime.contract.topology import Topology


@pytest.fixture(scope="module")
def various(models, tmp_path_factory):
    """Bundles that use every optional section: stages with mapped tensors, a trimmed-head draft is not
    among the tiny models, so a draft model, lookup, a dynamic tree, n-gram settings, quantization."""
    root = tmp_path_factory.mktemp("manifests")
    specs = {
        "ngram-staged": dict(draft="ngram", tree="chain:3", stages=2),
        "draft-lookup": dict(draft=str(models["draft"]), tree="topk:2x2", lookup=2, lookup_quote=4),
        "dynamic": dict(draft=str(models["draft"]), tree="dynamic:5"),
        "int4-draft": dict(draft=str(models["draft"]), tree="chain:2", quant="int4", symmetric=False),
        "profiles": dict(draft=str(models["draft"]), tree="chain:2", also_profiles=("ai-pc-intel", "cpu-x86")),
    }
    for name, spec in specs.items():
        export(ExportConfig(model=str(models["target"]), out=root / name, context=128, cache_dir=root / "cache", **spec))
    return {name: root / name for name in specs}


@pytest.mark.parametrize("name", ["ngram-staged", "draft-lookup", "dynamic", "int4-draft", "profiles"])
def test_written_manifests_are_exactly_the_typed_manifest(name, various):
    data = json.loads((various[name] / MANIFEST).read_text())
    manifest = Manifest.from_dict(data)
    assert manifest.to_dict() == data
    assert Manifest.from_dict(manifest.to_dict()) == manifest


def test_a_rewritten_manifest_changes_only_what_was_replaced(various, tmp_path):
    import shutil
    from dataclasses import replace

    bundle = tmp_path / "b"
    shutil.copytree(various["draft-lookup"], bundle)
    before = read_manifest(bundle)
    write_manifest(bundle, replace(before, tree=Topology((-1, 0, 0)), lookup=LookupConfig(tokens=3)))
    after = json.loads((bundle / MANIFEST).read_text())
    assert after["tree"]["parents"] == [-1, 0, 0] and after["tree"]["lookup"]["tokens"] == 3
    expected = before.to_dict()
    for section in ("tree",):
        expected.pop(section), after.pop(section)
    assert after == expected
    assert not list(bundle.glob("*.partial"))


def test_an_older_schema_is_refused_with_what_to_do(various, tmp_path):
    data = json.loads((various["ngram-staged"] / MANIFEST).read_text())
    data["schema_version"] = 2
    with pytest.raises(BundleError, match="export it again"):
        Manifest.from_dict(data)


@pytest.mark.parametrize("path,value,message", [
    (("target", "facts", "num_layers"), 10**9, "num_layers"),
    (("target", "facts", "num_kv_heads"), 0, "num_kv_heads"),
    (("target", "facts", "vocab_size"), -1, "vocab_size"),
    (("target", "facts", "max_context"), "2048", "max_context"),
    (("target", "facts", "num_heads"), True, "num_heads"),
    (("target", "facts", "rms_norm_eps"), float("nan"), "rms_norm_eps"),
    (("target", "facts", "head_dim"), 32, "rope_frequencies"),
    (("target", "facts", "num_layers"), 3, "layers"),
    (("target", "facts", "vocab_size"), 500, "vocabulary"),
    (("target", "graph"), "target.onnx", "graph"),
    (("target", "graph", "inputs"), [], "graph"),
    (("tree", "parents"), "0,1", "parents|Topology|malformed"),
    (("tree", "parents"), [0, 0], "root"),
    (("steps", "prefill_chunk"), "many", "prefill_chunk|malformed"),
    (("steps", "prefill_chunk"), 0, "prefill_chunk"),
    (("steps", "prefill_chunk"), float("inf"), "prefill_chunk"),
    (("target", "graph", "outputs", "logits", "shape"), [], "logits"),
    (("tokenizer", "file"), 7, "tokenizer"),
    (("files", "tokenizer.json"), None, "sha256"),
    (("files", "tokenizer.json"), "g" * 64, "hex digits"),
    (("steps", "prefill_chunk"), (1 << 16) + 1, "from 2 to 65536"),
    (("draft",), {"kind": "oracle"}, "unknown drafter"),
    (("tokenizer",), [], "malformed"),
    (("profile",), {"name": "cpu"}, "malformed"),
    (("other_profiles",), {"cpu": {}}, "other_profiles must be a list"),
    (("other_profiles",), [{"profile": {"name": "x"}}], "malformed"),
])
def test_a_hostile_manifest_is_refused_before_anything_is_sized(various, path, value, message):
    """Every value a manifest holds is checked, as a whole, before a cache is sized or a session made."""
    data = json.loads((various["ngram-staged"] / MANIFEST).read_text())
    where = data
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    with pytest.raises(BundleError, match=message):
        Manifest.from_dict(data)


@pytest.mark.parametrize("text, cause", [
    ("[" * 100_000 + "]" * 100_000, "recursion"),  # deeper than the decoder's stack
    ('{"schema_version": ' + "9" * 5000 + "}", "digits"),  # past Python's limit on an integer's digits
])
def test_a_manifest_the_decoder_refuses_is_a_bundle_error_naming_the_file(tmp_path, text, cause):
    (tmp_path / MANIFEST).write_text(text)
    with pytest.raises(BundleError, match=rf"cannot read {tmp_path / MANIFEST}: .*{cause}") as caught:
        read_manifest(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300 + len(str(tmp_path))
    assert caught.value.__suppress_context__  # the decoder's own traceback is not chained onto the message


def test_the_cli_reports_a_deep_manifest_on_one_line(tmp_path, capsys):
    from edgespec.cli import main

    (tmp_path / MANIFEST).write_text("[" * 100_000)
    assert main(["generate", str(tmp_path), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"edgespec: error: cannot read {tmp_path / MANIFEST}")
