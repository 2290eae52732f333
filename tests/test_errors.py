"""Bad input gets a clear error and leaves nothing half-written."""
import json
import shutil

import pytest
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.errors import (
    BundleError,
    ContextOverflowError,
    ExportError,
    UnsupportedArchitectureError,
)
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.cli import main


def copy_bundle(bundle_factory, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(bundle_factory(), dst)
    return dst


def replace_signed(bundle, name: str, content: bytes) -> None:
    """Replaces one of the bundle's files and records its new checksum: damage the checksums cannot see."""
    from edgespec.runtime.contract.manifest import sha256_file

    (bundle / name).write_bytes(content)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"][name] = sha256_file(bundle / name)
    (bundle / "manifest.json").write_text(json.dumps(manifest))


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


@pytest.mark.parametrize("field,message", [({"attention_bias": True}, "biases .*o_proj.bias"),
                                           ({"mlp_bias": True}, "biases .*down_proj.bias"),
                                           ({"hidden_act": "gelu"}, "uses 'gelu'.*silu only")])
def test_a_config_the_graph_would_get_wrong_is_refused(field, message, tmp_path):
    """Exported as plain Llama, these would give other logits than the model's, without a word."""
    from tiny import make_model

    make_model(tmp_path / "m", **field)
    with pytest.raises(ExportError, match=message):
        export(ExportConfig(model=str(tmp_path / "m"), draft="ngram", out=tmp_path / "b", context=128,
                            cache_dir=tmp_path))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("chunk", [1, (1 << 16) + 1])
def test_a_prefill_chunk_the_reader_would_refuse_is_refused_at_export(chunk, models, tmp_path):
    with pytest.raises(ExportError, match="prefill chunk must be 2 to 65536"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", context=128,
                            cache_dir=tmp_path, prefill_chunk=chunk))
    assert not (tmp_path / "b").exists()


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


def test_unsupported_architecture_is_refused_before_the_weights_are_read(tmp_path):
    import transformers

    model_dir = tmp_path / "neox"
    transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2).save_pretrained(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"not a checkpoint")  # reading it would fail otherwise
    with pytest.raises(UnsupportedArchitectureError, match="architecture gpt_neox is not supported"):
        export(ExportConfig(model=str(model_dir), draft="ngram", out=tmp_path / "b", cache_dir=tmp_path / "cache"))


def test_weights_that_do_not_fit_their_config_name_the_model(tmp_path):
    import json

    from tiny import make_model

    make_model(tmp_path / "m", "llama")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    with pytest.raises(ExportError, match="cannot load Hugging Face folder .*m"):
        export(ExportConfig(model=str(tmp_path / "m"), draft="ngram", out=tmp_path / "b", cache_dir=tmp_path / "cache"))
    assert not (tmp_path / "b").exists()


def test_a_truncated_gguf_and_a_mistyped_config_name_the_input(tmp_path):
    import json

    from gguf_files import write_gguf
    from tiny import make_model

    model = make_model(tmp_path / "m", "llama")
    (tmp_path / "g").mkdir()
    whole = write_gguf(model, tmp_path / "m", tmp_path / "g" / "m.gguf").read_bytes()
    (tmp_path / "g" / "cut.gguf").write_bytes(whole[:4000])
    with pytest.raises(ExportError, match="cannot load GGUF file .*cut.gguf.*cut short or corrupt"):
        export(ExportConfig(model=str(tmp_path / "g" / "cut.gguf"), draft="ngram", out=tmp_path / "b"))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(config, num_hidden_layers="two")))
    with pytest.raises(ExportError, match="cannot load Hugging Face folder .*num_hidden_layers"):
        export(ExportConfig(model=str(tmp_path / "m"), draft="ngram", out=tmp_path / "b"))
    assert not (tmp_path / "b").exists()


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
    from tokenizers import Tokenizer
    from tokenizers import models as tmodels
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
    with pytest.raises(ContextOverflowError, match="context is full") as raised:
        pipeline.generate("fox " * 20, config=GenerationConfig(max_new_tokens=500, stop_at_eos=False))
    partial = raised.value.partial  # what was made before the context filled
    assert partial.stop_reason == "context_full" and partial.token_ids and partial.text


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
    from edgespec.runtime.decoding.engine import generate

    result = generate(pipeline.target, pipeline.codec, pipeline.new_session(False), ids,
                      GenerationConfig(max_new_tokens=1, stop_at_eos=False), 16)
    assert len(result.token_ids) == 1


def test_bad_prompts_files(bundle_factory, tmp_path, capsys):
    assert main(["bench", str(bundle_factory()), "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert main(["bench", str(bundle_factory()), "--prompts", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("cannot read the prompts file") == 2


def test_a_chat_template_that_refuses_is_a_clear_error(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    replace_signed(bundle, "chat_template.jinja", b"{{ raise_exception('System role not supported') }}")
    with pytest.raises(ValueError, match="chat template refused these messages: System role not supported"):
        Pipeline(bundle).generate(messages=[{"role": "system", "content": "x"}])


def test_context_beyond_the_trained_positions_is_refused(models, tmp_path):
    with pytest.raises(ExportError, match="longer than the 512 positions"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", context=4096,
                            cache_dir=tmp_path))
    assert not (tmp_path / "b").exists()


# --- hardening: what a hostile or unlucky user meets ---------------------------------------------------

def exported(models, out, **extra):
    return export(ExportConfig(model=str(models["target"]), draft="ngram", out=out, context=128,
                               cache_dir=out.parent / "cache", **extra))


@pytest.mark.parametrize("damage", ["extra file", "changed file"])
def test_force_replaces_only_a_bundle_as_it_was_written(models, tmp_path, damage):
    out = exported(models, tmp_path / "b")
    if damage == "extra file":
        (out / "notes.txt").write_text("mine")
    else:
        (out / "tokenizer.json").write_text("{}")
    with pytest.raises(ExportError, match="does not list|differ from the bundle's checksums"):
        exported(models, out, force=True)
    assert (out / ("notes.txt" if damage == "extra file" else "tokenizer.json")).read_text() == \
        ("mine" if damage == "extra file" else "{}")
    assert (out / "manifest.json").exists() and not list(tmp_path.glob(".b.*"))


def test_a_replacement_that_fails_at_the_last_step_keeps_the_old_bundle(models, tmp_path, monkeypatch):
    import pathlib

    out = exported(models, tmp_path / "b")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rename = pathlib.Path.rename

    def failing(path, target):
        if path.name.startswith(".b.") and not path.name.endswith(".replaced"):  # the new bundle moving in
            raise OSError("no space left on device")
        return rename(path, target)

    monkeypatch.setattr(pathlib.Path, "rename", failing)
    with pytest.raises(ExportError, match=f"export to {out} stopped.*no space"):
        exported(models, out, force=True)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".b")) == []


def test_sigterm_during_an_export_leaves_nothing_behind(models, tmp_path):
    import os
    import signal

    from edgespec.exporters import bundle_writer

    with pytest.raises(KeyboardInterrupt), bundle_writer.staged_bundle(tmp_path / "b", False) as folder:
        (folder / "target.onnx").write_bytes(b"half a graph")
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill` would, while graphs are being written
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the export's handler is gone again


def test_what_a_killed_export_left_is_cleaned_up_by_the_next(models, tmp_path):
    import os
    import subprocess
    import sys

    from edgespec.exporters.bundle_writer import EXPORT_OWNER

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned, running = tmp_path / ".b.dead1", tmp_path / ".b.live1"
    for folder, pid in ((abandoned, gone.stdout.strip()), (running, str(os.getpid()))):
        folder.mkdir()
        (folder / EXPORT_OWNER).write_text(pid)
        (folder / "target.weights").write_bytes(b"\0" * 1000)
    exported(models, tmp_path / "b")
    assert not abandoned.exists() and running.exists()


def test_bundles_are_written_with_the_users_umask(models, tmp_path):
    import os
    import stat

    previous = os.umask(0o022)
    try:
        out = exported(models, tmp_path / "b")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert not (out / ".export-pid").exists()


@pytest.mark.parametrize("threads", [0, -1, 100000])
def test_thread_counts_out_of_range_are_refused(bundle_factory, threads, capsys):
    with pytest.raises(ValueError, match="threads must be between 1"):
        Pipeline(bundle_factory(), threads=threads)
    assert main(["generate", str(bundle_factory()), "--prompt", "x", "--threads", str(threads)]) == 2
    assert "threads must be between 1" in capsys.readouterr().err
    # refused before --placement auto would calibrate (seconds) with another thread count
    assert main(["generate", str(bundle_factory(draft="draft")), "--prompt", "x", "--threads", str(threads),
                 "--placement", "auto"]) == 2
    err = capsys.readouterr().err
    assert "threads must be between 1" in err and "calibrating" not in err


def test_text_that_is_not_utf8_is_a_clear_error(bundle_factory):
    pipeline = Pipeline(bundle_factory())
    broken = b"hello \xff".decode("utf-8", "surrogateescape")  # how Python reads such bytes from a pipe
    with pytest.raises(ValueError, match="not valid UTF-8"):
        pipeline.generate(broken, config=GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="not valid UTF-8"):
        pipeline.generate(messages=[{"role": "user", "content": broken}], config=GenerationConfig(max_new_tokens=4))


def test_chat_on_bytes_that_are_not_utf8_answers_with_an_error_not_a_traceback(bundle_factory):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "edgespec.cli", "chat", str(bundle_factory()), "--max-new-tokens", "4"],
                         input=b"hello \xff\nfine\n\n", capture_output=True, timeout=120)
    assert b"Traceback" not in run.stderr
    assert b"UTF-8" in run.stderr or b"utf-8" in run.stderr


def test_settings_errors_name_the_flags_before_the_bundle_loads(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "no-such-bundle"), "--prompt", "x", "--top-p", "2"]) == 2
    err = capsys.readouterr().err
    assert "--top-p" in err and "no bundle" not in err
    assert main(["generate", str(tmp_path / "no-such-bundle"), "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err


def test_a_json_generation_that_fills_the_context_still_prints_what_it_made(bundle_factory, capsys):
    bundle = bundle_factory(context=64)
    prompt = " ".join(["fox"] * 80)
    while len(Pipeline(bundle).encode(prompt)) > 60:  # a few tokens short of the context: it fills before any eos
        prompt = prompt[4:]
    code = main(["generate", str(bundle), "--prompt", prompt, "--max-new-tokens", "500", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and "context is full" in err
    reply = json.loads(out)
    assert reply["stop_reason"] == "context_full" and reply["token_ids"] and "context is full" in reply["error"]


def test_a_graph_onnxruntime_refuses_is_a_bundle_error(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    replace_signed(bundle, "target.onnx", b"not a graph at all")  # its checksum matches
    with pytest.raises(BundleError, match="cannot load target.onnx"):
        Pipeline(bundle)


def test_debug_shows_the_traceback(tmp_path, capsys):
    assert main(["--debug", "inspect", str(tmp_path / "none")]) == 2
    assert "Traceback" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "none")]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_hub_id_without_a_network_is_refused_in_seconds(monkeypatch, tmp_path):
    import socket
    import time

    from edgespec.exporters import sources

    def unreachable(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    started = time.time()
    with pytest.raises(ExportError, match="needs the network"):
        sources.resolve_source("someone/some-model-not-cached", tmp_path).load()
    assert time.time() - started < 5


def test_a_tokenizer_the_library_cannot_parse_is_a_bundle_error(bundle_factory, tmp_path):
    bundle = copy_bundle(bundle_factory, tmp_path)
    replace_signed(bundle, "tokenizer.json", b'{"model": "nonsense"}')
    with pytest.raises(BundleError, match="tokenizer"):
        Pipeline(bundle)


def test_a_broken_config_json_is_an_export_error(models, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(models["target"], folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ExportError, match="cannot load"):
        export(ExportConfig(model=str(folder), draft="ngram", out=tmp_path / "b", cache_dir=tmp_path / "c"))
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("limit, quant, file", [(8 * 1024, "fp32", "tokenizer.json"), (256 * 1024, "fp32", "target.weights"),
                                                (40 * 1024, "int4", "target.weights")])  # the last: at the file's close
def test_a_file_size_limit_during_export_is_one_line_and_leaves_nothing(models, tmp_path, limit, quant, file):
    """The system refusing a write (here RLIMIT_FSIZE: EFBIG, which Python gets instead of SIGXFSZ) ends the
    export with one line naming the output, the file it was writing and the cause, and no half-written
    bundle: the tokenizer (written by the tokenizers library, which raises a bare Exception) or the weights."""
    import os
    import re
    import resource
    import signal
    import subprocess
    import sys

    out = tmp_path / "b"

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as Python itself sets it: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run([sys.executable, "-m", "edgespec.cli", "export", str(models["target"]), "--draft", "ngram",
                           "--out", str(out), "--context", "128", "--quant", quant], capture_output=True,
                          text=True, preexec_fn=limited, timeout=600, env={**os.environ, "EDGESPEC_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    # the error starts a line of its own (a progress bar cleared before it), and ends the output
    errors = [line for line in re.split(r"[\r\n]", done.stderr) if "edgespec: error:" in line]
    assert done.stderr.rstrip().endswith("File too large") and all(line.startswith("edgespec: error:") for line in errors)
    assert len(errors) == 1 and re.search(
        rf"the export to {re.escape(str(out))} stopped (at|while writing) {re.escape(str(out / file))}, "
        "nothing of it left behind: File too large$", errors[0]), done.stderr[-2000:]
    assert not out.exists() and not list(tmp_path.glob(".b.*"))
