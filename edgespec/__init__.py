"""edgespec: speculative decoding for language models on the devices people own."""
from __future__ import annotations

from importlib import import_module
from importlib.metadata import version as _version

__version__ = _version("edgespec")  # pyproject.toml holds the one number

# the public API, loaded on first use: a tool that reads a manifest (runtime/contract) loads no onnxruntime
_PUBLIC = {"EdgespecError": "edgespec.runtime.contract.errors", "ConstraintSpec": "edgespec.runtime.decoding.constraints",
           "GenerationConfig": "edgespec.runtime.decoding.engine", "Pipeline": "edgespec.runtime.pipeline",
           "load": "edgespec.runtime.pipeline"}

__all__ = ["__version__", "ConstraintSpec", "EdgespecError", "GenerationConfig", "Pipeline", "load"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'edgespec' has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name]), name)
