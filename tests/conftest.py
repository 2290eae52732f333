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

    def make(target="target", draft="ngram", tree="chain:4", context=256, lookup=0, lookup_quote=0, suffix=False):
        key = (target, draft, tree, context, lookup, lookup_quote, suffix)
        if key not in made:
            out = root / f"b{len(made)}"
            draft_spec = draft if draft in ("ngram", "recycling", "ngram+recycling", "suffix") else str(models[draft])
            export(ExportConfig(model=str(models[target]), draft=draft_spec, out=out, tree=tree, context=context,
                                lookup=lookup, lookup_quote=lookup_quote, suffix=suffix, cache_dir=root / "cache"))
            made[key] = out
        return made[key]

    return make
