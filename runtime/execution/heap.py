"""Giving freed memory back to the system after a request.

glibc keeps freed heap pages for reuse, and after a large block is freed it raises its threshold for
mapping blocks of their own (up to 32 MiB), so a long-running process that allocates varied sizes (a
prefill chunk's logits, onnxruntime's intermediates) grows by what it freed (benchmarks/history.md §47).
malloc_trim(0) returns those pages; elsewhere there is nothing to do.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Callable


def heap_trimmer() -> Callable[[], None]:
    """A function that returns freed heap pages to the system: glibc's malloc_trim, or a no-op."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return lambda: None
    trim = getattr(libc, "malloc_trim", None)  # musl has none
    if trim is None:
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0) and None
