"""Freed memory goes back to the system after a request (glibc keeps it otherwise)."""
import sys

import numpy as np
import pytest
from edgespec.runtime.execution.heap import heap_trimmer


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's heap")
def test_trimming_returns_freed_heap_pages():
    trim = heap_trimmer()
    trim()
    # many blocks under glibc's mapping threshold, freed but for the last: the heap keeps their pages
    blocks = [np.ones(64 * 1024 // 8) for _ in range(4000)]  # 64 KiB each, 250 MiB in all
    keep = blocks[-1]
    del blocks
    before = rss_kib()
    trim()
    assert before - rss_kib() > 100 * 1024, "malloc_trim gave back less than 100 MiB of 250 freed"
    assert keep.sum() == keep.size
