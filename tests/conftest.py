import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_model  # noqa: E402


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny random HF folders: a target, a different (unrelated) draft, and other architectures."""
    root = tmp_path_factory.mktemp("models")
    paths = {
        "target": root / "target",
        "draft": root / "draft",
        "qwen2": root / "qwen2",
        "mistral": root / "mistral",
        "untied": root / "untied",
    }
    make_model(paths["target"], "llama", seed=0)
    make_model(paths["draft"], "llama", seed=1, layers=1, hidden=32)
    make_model(paths["qwen2"], "qwen2", seed=2)
    make_model(paths["mistral"], "mistral", seed=3)
    make_model(paths["untied"], "llama", seed=4, tie=False)
    return paths


@pytest.fixture(scope="session")
def bundle_factory(models, tmp_path_factory):
    """Exports (target, draft, tree) once per combination."""
    from edgespec.exporters.export import ExportConfig, export

    made = {}
    root = tmp_path_factory.mktemp("bundles")

    def make(target="target", draft="ngram", tree="chain:4", context=256, lookup=0, lookup_quote=0, suffix=False,
             coreml=()):
        """`coreml`: the KV forms of fp16 CoreML packages written beside the ONNX graphs (none by default)."""
        key = (target, draft, tree, context, lookup, lookup_quote, suffix, coreml)
        if key not in made:
            out = root / f"b{len(made)}"
            draft_spec = draft if draft in ("ngram", "recycling", "ngram+recycling", "suffix") else str(models[draft])
            formats = {"formats": ("onnx", "coreml"), "coreml_kv": coreml, "coreml_compress": "fp16"} if coreml else {}
            export(ExportConfig(model=str(models[target]), draft=draft_spec, out=out, tree=tree, context=context,
                                lookup=lookup, lookup_quote=lookup_quote, suffix=suffix, cache_dir=root / "cache",
                                **formats))
            made[key] = out
        return made[key]

    return make


@pytest.fixture(params=["onnx", "coreml-state", "coreml-io"])
def backend(request):
    """Which backend a test's pipeline decodes on: the ONNX graphs, or the bundle's CoreML packages (KV as states,
    or passed in and out) with their saved programs run in numpy (exporters/mil_reference.py), as on a Mac."""
    return request.param


@pytest.fixture
def open_pipeline(bundle_factory, backend):
    """Pipeline(bundle_factory(...)) on the test's backend."""
    from edgespec.runtime.pipeline import Pipeline

    def open_(**bundle):
        if backend == "onnx":
            return Pipeline(bundle_factory(**bundle))
        from edgespec.exporters.mil_reference import reference_predictor

        kv = backend.split("-")[1]
        return Pipeline(bundle_factory(**bundle, coreml=(kv,)), backend="coreml", predictor=reference_predictor,
                        coreml_kv=kv)

    return open_
