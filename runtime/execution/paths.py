"""Where edgespec keeps what it makes on this machine (default bundles, models, packed weights)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`EDGESPEC_CACHE`, or ~/.cache/edgespec."""
    return Path(os.environ.get("EDGESPEC_CACHE", Path.home() / ".cache" / "edgespec"))


def packed_dir() -> Path:
    """Where a streamed target's packed copies go (its stages' weights in this CPU's layout, once per machine and
    onnxruntime release: about the stages' own size again): `EDGESPEC_PACKED`, or the cache's `prepacked`."""
    return Path(os.environ["EDGESPEC_PACKED"]) if os.environ.get("EDGESPEC_PACKED") else cache_dir() / "prepacked"
