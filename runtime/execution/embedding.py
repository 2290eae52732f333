"""The embedding stage done by indexing its table in the stage's weights file, memory-mapped: a pass reads
the rows of its tokens, not the table. Streamed as a stage instead, the whole table would be fetched and
given back on every pass to look up a row or a few (history.md §76).

A table is what the manifest's `embedding_table` describes (exporters/weights.py `external_table`): a
float32/float16 array, or 4-bit levels in blocks along the hidden axis with a float scale per block and,
optionally, 4-bit zero points, laid out as onnxruntime's GatherBlockQuantized reads them (two values a
byte, the first in the low half; the zero points packed over the whole tensor, not row by row). A quantized row is computed as that operator computes it, (level -
zero point) x scale in float32, so a pass sees the same bits either way (tested against the operator).
"""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from ..contract.errors import BundleError

FLOAT_TYPES = ("float32", "float16")
NIBBLE_TYPES = ("uint4", "int4")  # without zero points the levels are the values (GatherBlockQuantized)


class MappedEmbedding:
    """Rows of the table become resident as they are read, and are dropped again (MADV_DONTNEED) every
    `reset_every` rows read, so the table never holds more than resident_bound() bytes however long the
    conversation."""

    def __init__(self, folder: Path, table: dict, reset_every: int):
        self.shape, self.kind = tuple(int(d) for d in table["shape"]), table["dtype"]
        with open(Path(folder) / table["file"], "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        rows, width = self.shape
        if self.kind in FLOAT_TYPES:
            self.table = self._array(table["offset"], np.dtype(self.kind), (rows, width))
        elif self.kind in NIBBLE_TYPES:
            blocks = width // int(table["block_size"])
            self.table = self._array(table["offset"], np.uint8, (rows, width // 2))
            self.scales = self._array(table["scales"]["offset"], np.dtype(table["scales"]["dtype"]), (rows, blocks))
            zero = table.get("zero_points")
            self.zero_points = None if zero is None else \
                self._array(zero["offset"], np.uint8, (-(-rows * blocks // 2),))
        else:
            raise BundleError(f"the manifest's embedding table has dtype {self.kind!r}: re-export the bundle")
        self.reset_every, self.rows_read = reset_every, 0

    def _array(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count, dtype = int(np.prod(shape)), np.dtype(dtype)
        if int(offset) + count * dtype.itemsize > len(self.map):
            raise BundleError("the manifest's embedding table lies past the end of its weights file: re-export")
        return np.frombuffer(self.map, dtype, count=count, offset=int(offset)).reshape(shape)

    @staticmethod
    def row_parts(table: dict) -> list[int]:
        """Bytes of one row in each array the table keeps (levels, scales, zero points), at most."""
        width = int(table["shape"][1])
        if table["dtype"] in FLOAT_TYPES:
            return [width * np.dtype(table["dtype"]).itemsize]
        blocks = width // int(table["block_size"])
        parts = [width // 2, blocks * np.dtype(table["scales"]["dtype"]).itemsize]
        return parts + ([blocks // 2 + 1] if table.get("zero_points") else [])

    @staticmethod
    def table_bytes(table: dict) -> int:
        rows, width = (int(d) for d in table["shape"])
        if table["dtype"] in FLOAT_TYPES:
            return rows * width * np.dtype(table["dtype"]).itemsize
        blocks = width // int(table["block_size"])
        zero = -(-rows * blocks // 2) if table.get("zero_points") else 0
        return rows * (width // 2 + blocks * np.dtype(table["scales"]["dtype"]).itemsize) + zero

    @staticmethod
    def resident_bound(table: dict, reset_every: int) -> int:
        """A row read maps each of its parts' pages: a part spans at most its pages plus one."""
        pages_per_row = sum(-(-part // mmap.PAGESIZE) + 1 for part in MappedEmbedding.row_parts(table))
        return min(MappedEmbedding.table_bytes(table), reset_every * pages_per_row * mmap.PAGESIZE)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        if self.rows_read + ids.size > self.reset_every:
            self.map.madvise(mmap.MADV_DONTNEED)
            self.rows_read = 0
        self.rows_read += ids.size
        if self.kind in FLOAT_TYPES:
            return self.table[ids].astype(np.float32)  # [1, N, H]
        levels = _nibbles(self.table[ids], self.kind)  # [1, N, H]
        blocks = self.scales.shape[1]
        if self.zero_points is None:
            zero = np.zeros(ids.shape + (blocks,), np.int8)
        else:  # element r * blocks + b of the flat tensor: the low or high half of its byte
            at = ids[..., None] * blocks + np.arange(blocks)
            halves = _nibbles(self.zero_points[at // 2][..., None], self.kind)
            zero = np.take_along_axis(halves, (at % 2)[..., None], axis=-1)[..., 0]
        shifted = (levels.reshape(ids.shape + (blocks, -1)).astype(np.float32)
                   - zero[..., None].astype(np.float32))
        return (shifted * self.scales[ids][..., None].astype(np.float32)).reshape(ids.shape + (-1,))


def _nibbles(packed: np.ndarray, kind: str) -> np.ndarray:
    """Two 4-bit values a byte, the first in the low half; int4's are signed."""
    pairs = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,)).astype(np.int8)
    return np.where(pairs > 7, pairs - 16, pairs).astype(np.int8) if kind == "int4" else pairs
