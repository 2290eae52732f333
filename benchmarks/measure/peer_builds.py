"""What peers.py builds once into `EDGESPEC_CACHE/peers/`: the reference model as a Hugging Face folder,
onnxruntime-genai's and OpenVINO GenAI's exports of it, and edgespec's symmetric int4 bundle (the default
recipe at genai's weights: symmetric blocks of 32, int8 activations, by default an int4 head as genai's), the
standing row that compares plain decoding at the same weights (issue 56)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cache_dir() -> Path:
    from edgespec.runtime.execution.paths import cache_dir
    return cache_dir()


def reference_hf() -> Path:
    """The reference model as a Hugging Face folder, from the GGUF the default bundle comes from (once)."""
    if not ((hf := cache_dir() / "peers" / "smollm2-135m-hf") / "config.json").is_file():
        from edgespec.exporters.sources import resolve_source

        model, tokenizer = resolve_source("default", cache_dir()).load()
        # loaded from a GGUF, dequantized: the weights are plain floats, saved as such
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf)
        tokenizer.save_pretrained(hf)
    return hf


def build_once(out: Path, done_file: str, command: list[str], env: dict | None = None) -> Path:
    if not (out / done_file).is_file():
        partial = out.with_name(out.name + ".partial")
        subprocess.run(command + [str(partial)], check=True, env=env)
        partial.replace(out)
    return out


def build_peer(precision: str) -> Path:
    """onnxruntime-genai's export of the reference model at `precision`, by its model builder (once)."""
    return build_once(cache_dir() / "peers" / f"ortgenai-smollm2-135m-{precision}", "genai_config.json", [
        sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(reference_hf()), "-p", precision,
        "-e", "cpu", "-c", str(cache_dir() / "peers" / "builder-cache"), "-o"])


def build_openvino(python: str, precision: str) -> Path:
    """OpenVINO GenAI's export of the same Hugging Face folder at `precision`, by optimum-intel (once). int4 in
    blocks of 32 like genai's (its default 128 does not divide the hidden size 576); int8 per channel."""
    return build_once(cache_dir() / "peers" / f"ovgenai-smollm2-135m-{precision}", "openvino_model.xml", [
        python, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(reference_hf()),
        "--task", "text-generation-with-past", "--weight-format", precision]
        + (["--group-size", "32"] if precision == "int4" else []), {**os.environ, "HF_HUB_OFFLINE": "1"})


def build_symmetric(head: str = "int4") -> Path:
    """The default recipe (the shipped draft, suffix drafting) with symmetric int4 weights instead of the GGUF's
    exact offsets, once; named after the default bundle, so it follows its recipe. `head`: "int4" quantizes
    the head as genai's int4 export does (genai's weights throughout); "int8" keeps the default recipe's
    int8 head (history.md §85: 0.3-0.9 ms a step more, perplexity +20.6% against +28.8%)."""
    from edgespec.defaults import DEFAULT_RECIPE, _default_draft_folder, default_bundle_path
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.quant.schemes import HEAD_INT8_POLICY

    if head not in ("int4", "int8"):
        raise SystemExit(f"--symmetric-head {head}: int4 or int8")
    out = cache_dir() / "peers" / (f"symmetric-int4-head-{head}-" + default_bundle_path().name)
    if not (out / "manifest.json").is_file():
        policy = {"quant_policy": HEAD_INT8_POLICY} if head == "int8" else {}
        export(ExportConfig(**{**DEFAULT_RECIPE, "symmetric": True, "draft": str(_default_draft_folder())},
                            **policy, out=out, cache_dir=cache_dir()))
    return out
