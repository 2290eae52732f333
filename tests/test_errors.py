"""Bad input gets a clear error and leaves nothing half-written."""
import json
import shutil

import pytest

from edgespec.cli import main
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.bundle import open_bundle
from edgespec.runtime.engine import GenerationConfig
from edgespec.runtime.errors import BundleError, ContextOverflowError, ExportError, UnsupportedArchitectureError
from edgespec.runtime.pipeline import Pipeline


def copy_bundle(bundle_factory, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(bundle_factory(), dst)
    return dst


def test_missing_bundle(tmp_path):
    with pytest.raises(BundleError, match="no bundle"):
        open_bundle(tmp_path / "nowhere")
    with pytest.raises(BundleError, match="no manifest.json"):
        open_bundle(tmp_path)


def test_unreadable_manifest(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    (bundle / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="cannot read"):
        open_bundle(bundle)


def test_corrupted_file_fails_its_checksum(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    weights = bundle / "target.weights"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="checksum mismatch for target.weights"):
        Pipeline(bundle)


def test_missing_file(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    (bundle / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="tokenizer.json is missing"):
        open_bundle(bundle)


def test_unknown_schema_version_is_named(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="schema version 99"):
        open_bundle(bundle)


def test_unsupported_architecture_writes_nothing(tmp_path):
    import transformers

    model_dir = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(model_dir)
    from tiny import make_tokenizer

    make_tokenizer(model_dir)
    out = tmp_path / "out" / "bundle"
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel is not supported"):
        export(ExportConfig(model=str(model_dir), draft="ngram", out=out, cache_dir=tmp_path / "cache"))
    assert not out.exists()
    assert list((tmp_path / "out").iterdir()) == []  # no temporary folder left behind


def test_bad_model_paths(tmp_path):
    (tmp_path / "notgguf.bin").write_bytes(b"hello")
    for spec, message in [(str(tmp_path / "notgguf.bin"), "neither a GGUF"), (str(tmp_path), "no config.json"),
                          ("./missing/folder", "no model at")]:
        with pytest.raises(ExportError, match=message):
            export(ExportConfig(model=spec, draft="ngram", out=tmp_path / "b", cache_dir=tmp_path / "cache"))


def test_existing_output_is_refused_unless_forced(models, tmp_path):
    out = tmp_path / "bundle"
    config = dict(model=str(models["target"]), draft="ngram", out=out, context=128, cache_dir=tmp_path / "cache")
    export(ExportConfig(**config))
    first = (out / "manifest.json").read_text()
    with pytest.raises(ExportError, match="already exists"):
        export(ExportConfig(**config))
    assert (out / "manifest.json").read_text() == first
    export(ExportConfig(**config, force=True, tree="chain:2"))
    assert (out / "manifest.json").read_text() != first
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]  # nothing left aside


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_force_never_replaces_what_is_not_a_bundle(models, tmp_path, kind):
    out = tmp_path / "precious"
    if kind == "folder":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    else:
        out.write_text("mine")
    with pytest.raises(ExportError, match="not a bundle"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=out, force=True, cache_dir=tmp_path))
    assert (out / "keep.txt" if kind == "folder" else out).read_text() == "mine"


def test_files_without_a_checksum_are_refused(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["files"]["target.weights"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="no checksum for target.weights"):
        open_bundle(bundle)


def test_cli_reports_errors_with_exit_code_2(models, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    assert main(["export", str(models["target"]), "--draft", "ngram", "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert main(["export", str(models["target"]), "--draft", "ngram", "--out", str(tmp_path / "x"),
                 "--tree", "ring:2"]) == 2
    assert "unknown tree spec" in capsys.readouterr().err


def test_draft_with_another_vocabulary_is_refused(models, tmp_path):
    import transformers

    other = tmp_path / "other"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).save_pretrained(other)
    from tokenizers import Tokenizer, models as tmodels
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel({"a": 0, "b": 1}, unk_token="a"))).save_pretrained(other)
    with pytest.raises(ExportError, match="tokenizer differs"):
        export(ExportConfig(model=str(models["target"]), draft=str(other), out=tmp_path / "b", context=256,
                            cache_dir=tmp_path))
    assert not (tmp_path / "b").exists()


def test_prompt_longer_than_the_context(bundle_factory):
    pipeline = Pipeline(bundle_factory(context=64))
    with pytest.raises(ContextOverflowError, match="context holds 64"):
        pipeline.generate("fox " * 200, config=GenerationConfig(max_new_tokens=4))


def test_generation_stops_cleanly_when_the_context_fills(bundle_factory):
    pipeline = Pipeline(bundle_factory(context=64))
    with pytest.raises(ContextOverflowError, match="context is full"):
        pipeline.generate("fox " * 20, config=GenerationConfig(max_new_tokens=500, stop_at_eos=False))


def test_bad_generation_settings():
    with pytest.raises(ValueError, match="at least 1"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="cannot be empty"):
        GenerationConfig(stop_strings=("",))


def test_empty_prompt(bundle_factory):
    with pytest.raises(ValueError, match="the prompt is empty"):
        Pipeline(bundle_factory()).generate("", config=GenerationConfig(max_new_tokens=4))


def test_a_prompt_that_exactly_fills_the_context_still_answers(bundle_factory):
    pipeline = Pipeline(bundle_factory(context=64))
    ids = pipeline.encode("fox " * 100)[:64]
    from edgespec.runtime.engine import generate

    result = generate(pipeline.target, pipeline.codec, pipeline.make_drafter(False), pipeline.new_session(), ids,
                      GenerationConfig(max_new_tokens=1, stop_at_eos=False), 16)
    assert len(result.token_ids) == 1


def test_bad_prompts_files(bundle_factory, tmp_path, capsys):
    assert main(["bench", str(bundle_factory()), "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert main(["bench", str(bundle_factory()), "--prompts", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("cannot read the prompts file") == 2


def test_a_chat_template_that_refuses_is_a_clear_error(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    (bundle / "chat_template.jinja").write_text("{{ raise_exception('System role not supported') }}")
    manifest = json.loads((bundle / "manifest.json").read_text())
    from edgespec.runtime.bundle import sha256_file

    manifest["files"]["chat_template.jinja"] = sha256_file(bundle / "chat_template.jinja")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="chat template refused these messages: System role not supported"):
        Pipeline(bundle).generate(messages=[{"role": "system", "content": "x"}])


def test_context_beyond_the_trained_positions_is_refused(models, tmp_path):
    with pytest.raises(ExportError, match="longer than the 512 positions"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", context=4096,
                            cache_dir=tmp_path))
    assert not (tmp_path / "b").exists()
