"""The built-in default bundle: SmolLM2-135M-Instruct with the draft edgespec trained for it, built once
into the cache folder on first use."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from edgespec import __version__
from edgespec.quant.schemes import HEAD_INT8_POLICY
from edgespec.runtime.contract.manifest import SCHEMA_VERSION
from edgespec.runtime.execution.paths import cache_dir

# The draft ships packed (trained tensors only, float16) and is rebuilt against the target on first use.
SHIPPED_DRAFT = Path(__file__).parent / "data" / "drafts" / "smollm2-135m-instruct"
# int4 weights, the one int4 scheme that kept fp32's perplexity here: exact per-block float offsets
# (the reference GGUF's Q4_1 grid, reproduced) with the head in int8 (history.md §40); the
# tree `edgespec tune` chose for this draft (§13), beside suffix drafting over the conversation and earlier
# outputs; each step's tree (the draft's, a suffix chain or the root alone) is chosen by the step controller
# from this device's pass costs (runtime/decoding/controller.py, §57). On int4 every node costs a row of compute:
# one path a step, and the graph one lane (§49)
DEFAULT_RECIPE = {"model": "default", "draft": "shipped", "tree": "chain:1", "context": 2048, "quant": "int4",
                  "symmetric": False, "lanes": 1, "suffix": True}
# The code that builds the default bundle (and records its manifest and exactness verdict): a change to any
# of its files names a new cache folder, so a stale default bundle is never reused.
BUILDER_PACKAGES = ("edgespec.exporters", "edgespec.quant", "edgespec.distill", "edgespec.targets",
                    "edgespec.runtime")


def builder_digest(packages: tuple[str, ...] = BUILDER_PACKAGES) -> str:
    """A digest of the builder packages' files (sources and package data, by relative path)."""
    import importlib

    digest = hashlib.sha256()
    for package in packages:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(f"{package}/{path.relative_to(root).as_posix()}".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def _shipped_draft_digest() -> str:
    digest = hashlib.sha256()
    for name in ("draft.json", "weights.safetensors"):
        digest.update((SHIPPED_DRAFT / name).read_bytes())
    return digest.hexdigest()[:8]


def default_bundle_path() -> Path:
    """Named by edgespec's version, the recipe and its quantization policy, the shipped draft, the bundle schema
    and the code that builds it, so a change builds a new bundle."""
    policy = hashlib.sha256(HEAD_INT8_POLICY.read_bytes()).hexdigest()[:8]
    recipe = json.dumps({**DEFAULT_RECIPE, "draft": _shipped_draft_digest(), "schema": SCHEMA_VERSION,
                         "policy": policy, "builder": builder_digest()}, sort_keys=True)
    return cache_dir() / "bundles" / f"default-{__version__}-{hashlib.sha256(recipe.encode()).hexdigest()[:8]}"


def _default_draft_folder() -> Path:
    """The shipped draft as a Hugging Face folder, rebuilt once against the reference target."""
    from edgespec.distill.pack import unpack_draft
    from edgespec.exporters.sources import resolve_source

    folder = cache_dir() / "models" / f"smollm2-135m-instruct-draft-{_shipped_draft_digest()}"
    if not (folder / "config.json").is_file():
        target, tokenizer = resolve_source("default", cache_dir()).load()
        partial = folder.with_name(folder.name + ".partial")
        unpack_draft(SHIPPED_DRAFT, target, tokenizer, partial)
        partial.replace(folder)
    return folder


def _default_builder() -> Callable[[Path], None]:
    """The export of the default recipe to a folder (ImportError without the export extra)."""
    from edgespec.exporters.export import ExportConfig, export

    def build(path: Path) -> None:
        export(ExportConfig(**{**DEFAULT_RECIPE, "draft": str(_default_draft_folder())}, quant_policy=HEAD_INT8_POLICY,
                            out=path, cache_dir=cache_dir()))
    return build


def ensure_default_bundle(build: Callable[[Path], None] | None = None) -> Path:
    """Returns the default bundle's folder, built first if it is not there yet (`build`: what writes it to a
    folder; default: the export of DEFAULT_RECIPE). Built once however many processes ask at the same time:
    the first holds a lock file beside the folder while it builds; the others wait for it, then use what it
    built (a build that failed leaves the next waiting process to try)."""
    path = default_bundle_path()
    if (path / "manifest.json").is_file():
        return path
    try:
        from filelock import FileLock, Timeout

        build = build or _default_builder()
    except ImportError as err:
        raise SystemExit(f"edgespec: building the default bundle needs the export extra "
                         f"(pip install torch==2.13.0 'edgespec[export]', torch's CPU wheel): {err}") from err
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path.with_name(f"{path.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"edgespec: another process is building the default bundle into {path}; waiting for it to finish",
              file=sys.stderr)
        lock.acquire()
    try:
        if (path / "manifest.json").is_file():  # built while this process waited
            return path
        print(f"edgespec: building the default bundle once (SmolLM2-135M-Instruct and its distilled draft) into "
              f"{path}; this takes about a minute and is reused afterwards.", file=sys.stderr)
        started = time.perf_counter()
        build(path)
        print(f"edgespec: default bundle ready in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    finally:
        lock.release()
    return path


def resolve_bundle(spec: str) -> Path:
    return ensure_default_bundle() if spec == "default" else Path(spec)
