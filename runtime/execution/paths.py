"""Where edgespec keeps what it makes on this machine (default bundles, models, packed weights)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`EDGESPEC_CACHE`, or ~/.cache/edgespec."""
    return Path(os.environ.get("EDGESPEC_CACHE", Path.home() / ".cache" / "edgespec"))
