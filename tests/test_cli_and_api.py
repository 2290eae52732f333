import json
import subprocess
import sys

import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.cli import main


def test_runtime_imports_neither_torch_nor_transformers():
    code = ("import sys, edgespec, edgespec.runtime.pipeline, edgespec.bench, edgespec.cli, edgespec.defaults; "
            "heavy = [m for m in ('torch', 'transformers', 'optimum', 'onnx') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generate_json(bundle_factory, capsys):
    bundle = bundle_factory(draft="draft", tree="topk:2x2")
    assert main(["generate", str(bundle), "--prompt", "def add", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12 or out["stop_reason"] == "eos"
    assert out["stats"]["target_passes"] >= 1 and isinstance(out["text"], str)


def test_generate_streams_text_and_stats(bundle_factory, capsys):
    assert main(["generate", str(bundle_factory()), "--prompt", "The quick", "--chat", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err and "accepted tokens per target pass" in captured.err


def test_inspect_prints_manifest_and_verifies(bundle_factory, capsys):
    assert main(["inspect", str(bundle_factory(draft="draft"))]) == 0
    out = capsys.readouterr().out
    assert "schema version 3" in out and "sha256 verified" in out and "draft:" in out
    assert "exactness: checked at export on this device" in out and "0 differ" in out


def test_inspect_says_what_is_malformed_in_sections_only_it_reads(bundle_factory, tmp_path, capsys):
    """The quantization and quality sections inform; a hand-edited one is named, not a traceback."""
    import json
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(), bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["target"]["graph"]["quantization"] = {"scheme": "int4", "block_size": 32}
    manifest["quality"] = {"file": "quality.json"}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "quantization malformed in the manifest (KeyError: 'symmetric')" in out
    assert "quality vs the fp32 export malformed in the manifest" in out


def test_an_onnxruntime_failure_is_a_line_not_a_traceback(bundle_factory, monkeypatch, capsys):
    """What onnxruntime raises mid-run (its classes are not RuntimeErrors) becomes a BackendError at the one
    place passes run, and the command ends with a line and 2."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    def failing(*args, **kwargs):
        raise Fail("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMulNBits")

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", failing)
    assert main(["generate", str(bundle_factory()), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "failed in a pass (Fail)" in err and "MatMulNBits" in err and "Traceback" not in err


def test_a_bug_keeps_its_traceback(bundle_factory, monkeypatch):
    """cli.main answers the user's faults with a line; anything else is a bug and reaches the caller whole."""
    def broken(*args, **kwargs):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(Pipeline, "generate", broken)
    with pytest.raises(ValueError, match="internal invariant"):
        main(["generate", str(bundle_factory()), "--prompt", "a", "--max-new-tokens", "2"])


def test_inspect_checks_on_this_device_that_rows_keep_their_bits(bundle_factory, monkeypatch, capsys):
    bundle = str(bundle_factory(draft="draft"))
    assert main(["inspect", bundle, "--check-exact"]) == 0
    assert "exact rows: 48 of 48 tokens have plain decoding's bits" in capsys.readouterr().out  # one lane: a chain of 4
    assert "exact rows" not in (main(["inspect", bundle]), capsys.readouterr().out)[1]

    from edgespec.runtime.decoding.exactness import RowMismatch
    from edgespec.runtime.pipeline import Pipeline

    monkeypatch.setattr(Pipeline, "check_exact",
                        lambda self: (62, [RowMismatch("tree", 3, 2e-6), RowMismatch("chunk", 31, 1e-6)]))
    assert main(["inspect", bundle, "--check-exact"]) == 2
    err = capsys.readouterr().err
    assert "2 of 62 rows differ from plain decoding's bits (chunk, tree; largest difference 2e-06)" in err
    assert "--no-speculate" in err


def test_bench_json_keys(bundle_factory, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["bench", str(bundle_factory()), "--prompts", str(prompts), "--max-new-tokens", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_greedy"] is True
    assert {"tokens_per_s", "time_to_first_token_s"} <= set(report["plain"])
    assert {"tokens_per_s", "mean_accepted_per_pass"} <= set(report["speculative"])
    assert all(0 < report[mode]["python_share"] < 1 for mode in ("plain", "speculative"))
    assert report["speedup"] > 0 and report["peak_rss_mb"] > 0
    assert report["tree"] == "chain:4" and report["ngram"] == {"min_n": 1, "max_n": 4, "partial_match_depth": 5}
    recorded = json.loads((bundle_factory() / "manifest.json").read_text())["exactness"]
    assert report["step_rows"] == recorded["min_rows"]  # the rows this device's check chose at export
    assert main(["bench", str(bundle_factory()), "--prompts", str(prompts), "--max-new-tokens", "8"]) == 0
    assert "tree: chain:4, n-grams of 1..4 tokens, depth 5 unless quoting" in capsys.readouterr().out


def test_bench_rounds_cover_every_round_and_give_each_its_speedup(bundle_factory, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add"}\n{"prompt": "The quick brown fox"}\n')
    bundle = str(bundle_factory())
    assert main(["bench", bundle, "--prompts", str(prompts), "--max-new-tokens", "8", "--json"]) == 0
    once = json.loads(capsys.readouterr().out)
    assert once["rounds"] == 1 and once["speedup_by_round"] == [once["speedup"]]
    assert main(["bench", bundle, "--prompts", str(prompts), "--max-new-tokens", "8", "--rounds", "3", "--json"]) == 0
    thrice = json.loads(capsys.readouterr().out)
    assert thrice["rounds"] == 3 and len(thrice["speedup_by_round"]) == 3
    assert all(r > 0 for r in thrice["speedup_by_round"]) and thrice["identical_greedy"] is True
    for mode in ("plain", "speculative"):  # greedy: every round decodes the same tokens
        assert thrice[mode]["tokens"] == 3 * once[mode]["tokens"]
        assert thrice[mode]["target_passes"] == 3 * once[mode]["target_passes"]
    assert main(["bench", bundle, "--prompts", str(prompts), "--max-new-tokens", "8", "--rounds", "2"]) == 0
    assert "(rounds: " in capsys.readouterr().out
    assert main(["bench", bundle, "--prompts", str(prompts), "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_bad_prompts_file(bundle_factory, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"text": "no"}\n')
    assert main(["bench", str(bundle_factory()), "--prompts", str(prompts)]) == 2
    assert "needs a 'messages' list or a 'prompt' string" in capsys.readouterr().err


def _cli_backend(backend, monkeypatch) -> tuple[dict, list[str]]:
    """The bundle options and command-line flags that run `backend`; CoreML's predictor is the saved programs in
    numpy (exporters/mil_reference.py), standing in for macOS's."""
    if backend == "onnx":
        return {}, []
    from edgespec import cli
    from edgespec.exporters.mil_reference import reference_predictor

    kv = backend.split("-")[1]
    monkeypatch.setattr(cli, "coreml_refusal", lambda: None)
    monkeypatch.setattr(cli, "coreml_predictor", reference_predictor)
    monkeypatch.setattr(cli, "preferred_kv", lambda: kv)
    return {"coreml": (kv,)}, ["--backend", "coreml"]


def test_chat_reads_turns_from_stdin(bundle_factory, backend, monkeypatch, capsys):
    import io

    bundle, flags = _cli_backend(backend, monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand again\n\n"))
    assert main(["chat", str(bundle_factory(draft="draft", **bundle)), "--max-new-tokens", "6", *flags]) == 0
    assert capsys.readouterr().err.count("tokens/s") == 2


def test_generate_stops_at_a_stop_string_in_json(bundle_factory, backend, monkeypatch, capsys):
    bundle, flags = _cli_backend(backend, monkeypatch)
    command = ["generate", str(bundle_factory(draft="draft", **bundle)), "--prompt", "The quick", "--json",
               "--max-new-tokens", "16", *flags]
    assert main(command) == 0
    full = json.loads(capsys.readouterr().out)
    stop = full["text"].strip()[-2:]
    assert main([*command, "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["stop_reason"] == "stop_string" and stop not in cut["text"] and full["text"].startswith(cut["text"])


def test_stop_strings_cut_the_text(open_pipeline):
    pipeline = open_pipeline()
    full = pipeline.generate("The quick", config=GenerationConfig(max_new_tokens=30, stop_at_eos=False))
    start = next(i for i in range(len(full.text) // 2, len(full.text)) if not full.text[i].isspace())
    stop = full.text[start : start + 2]
    cut = pipeline.generate("The quick", config=GenerationConfig(max_new_tokens=30, stop_at_eos=False,
                                                                  stop_strings=(stop,)))
    assert cut.stop_reason == "stop_string" and stop not in cut.text
    assert full.text.startswith(cut.text) and len(cut.text) < len(full.text)


def test_stop_strings_never_reach_the_stream(open_pipeline):
    """A stop string spanning several tokens is held back while it may still be forming."""
    pipeline = open_pipeline()
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    full = pipeline.generate("The quick", config=config)
    ends, text = [], ""
    stream = pipeline.codec.stream()
    for token in full.token_ids:
        text += stream.push(token)
        ends.append(len(text))
    # a stop string that starts inside one token and ends inside a later one
    cut = next(i for i in range(1, len(ends) - 2) if ends[i + 1] - ends[i] >= 1 and ends[i] - ends[i - 1] >= 2)
    stop = text[ends[cut] - 1 : ends[cut + 1]]
    start = text.find(stop)
    shown = []
    result = pipeline.generate("The quick", config=GenerationConfig(max_new_tokens=40, stop_at_eos=False,
                                                                     stop_strings=(stop,)), on_text=shown.append)
    assert result.stop_reason == "stop_string"
    assert "".join(shown) == result.text == text[:start]
    assert len(result.token_ids) == sum(1 for end in ends if end <= start)  # tokens wholly before the stop


def test_the_default_bundles_cache_name_follows_its_policy_and_build(tmp_path, monkeypatch):
    """A cached default bundle is rebuilt when the quantization policy or the exporter's build of it changes."""
    from edgespec import defaults

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    policy = tmp_path / "policy.json"
    policy.write_text(defaults.HEAD_INT8_POLICY.read_text())
    monkeypatch.setattr(defaults, "HEAD_INT8_POLICY", policy)
    first = defaults.default_bundle_path()
    assert defaults.default_bundle_path() == first and first.parent == tmp_path / "bundles"
    policy.write_text('{"tensors": {"lm_head": "fp16"}}')
    second = defaults.default_bundle_path()
    monkeypatch.setattr(defaults, "builder_digest", lambda: "a-changed-exporter")
    assert len({first, second, defaults.default_bundle_path()}) == 3


def test_the_builder_digest_follows_every_file_of_the_builder(tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    from edgespec import defaults

    package = tmp_path / "fakebuilder"
    shutil.copytree(Path(defaults.__file__).parent.parent / "quant", package)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = defaults.builder_digest(("fakebuilder",))
    (package / "policies" / "head-int8.json").write_text("{}")  # package data counts, not only sources
    assert defaults.builder_digest(("fakebuilder",)) != before
