"""The built-in default bundle: SmolLM2-135M-Instruct, built once into the cache folder on first use."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_RECIPE = {"model": "default", "draft": "ngram", "tree": "chain:4", "context": 2048}


def cache_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_CACHE", Path.home() / ".cache" / "edgespec"))


def default_bundle_path() -> Path:
    """Named by edgespec's version and the recipe, so a changed recipe builds a new bundle."""
    from edgespec import __version__

    recipe = hashlib.sha256(json.dumps(DEFAULT_RECIPE, sort_keys=True).encode()).hexdigest()[:8]
    return cache_dir() / "bundles" / f"default-{__version__}-{recipe}"


def ensure_default_bundle() -> Path:
    """Returns the default bundle's folder, exporting it first if it is not there yet."""
    path = default_bundle_path()
    if (path / "manifest.json").is_file():
        return path
    try:
        from edgespec.exporters.export import ExportConfig, export
    except ImportError as err:
        raise SystemExit(f"edgespec: building the default bundle needs the export extra "
                         f"(pip install 'edgespec[export]'): {err}") from err
    print(f"edgespec: building the default bundle once (SmolLM2-135M-Instruct, n-gram drafter) into {path}; "
          "this takes about a minute and is reused afterwards.", file=sys.stderr)
    started = time.perf_counter()
    export(ExportConfig(**DEFAULT_RECIPE, out=path, cache_dir=cache_dir()))
    print(f"edgespec: default bundle ready in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return path


def resolve_bundle(spec: str) -> Path:
    return ensure_default_bundle() if spec == "default" else Path(spec)
