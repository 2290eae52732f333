"""A GGUF file's quantized blocks kept as they are: each block type read into one form MatMulNBits runs.

Every block type here dequantizes, in gguf's reference code (and llama.cpp's), as

    w = scale * (q - zero) + offset        per block of `block` input channels of an output row

with q small unsigned levels, scale the block's float32 scale (for k-quants: the super-block's fp16 d
times the sub-block's integer scale, multiplied in float32 as gguf does), zero an integer and offset a
float (the k-quants' -dmin * m, Q4_1's m) or absent. MatMulNBits stores exactly that: packed levels,
float scales, integer zero points, block sizes 16..256 at 4 or 8 bits; the offset rides beside it as
offsets.py's block sums. The weights the graph multiplies by are then the file's own, bit for bit
(`BlockGrid.dequantize` reproduces gguf's arithmetic, and the exporter checks it against the weights
transformers read).

    type   block  levels  zero  offset      MatMulNBits
    Q4_0     32    0..15     8   -           4 bits
    Q4_1     32    0..15     0   m           4 bits, zero points
    Q8_0     32    0..255  128   -           8 bits (int8 q stored + 128)
    Q4_K     32    0..15     0   -dmin*m     4 bits, zero points
    Q5_K     32    0..31     0   -dmin*m     8 bits, zero points
    Q6_K     16    0..63    32   -           8 bits, zero points
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from edgespec.runtime.contract.errors import ExportError

QK_K = 256
KEPT = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class BlockGrid:
    """A weight [N, K] as N rows of K / block blocks: levels [N, K/block, block] uint8, scales and zeros
    [N, K/block] (float32, uint8), offsets [N, K/block] float32 or None."""

    bits: int  # MatMulNBits' storage: 4 or 8
    block: int
    levels: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    offsets: np.ndarray | None
    kind: str  # the GGUF type (a concatenation: their names joined by +)

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, in gguf's order of operations."""
        w = self.scales[..., None] * (self.levels.astype(np.float32) - self.zeros[..., None].astype(np.float32))
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(self.levels.shape[0], -1)

    def rows(self, order: np.ndarray) -> "BlockGrid":
        return BlockGrid(self.bits, self.block, self.levels[order], self.scales[order], self.zeros[order],
                         None if self.offsets is None else self.offsets[order], self.kind)

    def widened(self, bits: int, block: int) -> "BlockGrid":
        """The same weights in a wider storage or smaller blocks (exact: levels and scales repeat)."""
        if bits < self.bits or self.block % block:
            raise ExportError(f"cannot hold {self.bits}-bit blocks of {self.block} in {bits}-bit blocks of {block}")
        split = self.block // block
        n, count = self.scales.shape
        return BlockGrid(bits, block, self.levels.reshape(n, count * split, block),
                         np.repeat(self.scales, split, axis=1), np.repeat(self.zeros, split, axis=1),
                         None if self.offsets is None else np.repeat(self.offsets, split, axis=1), self.kind)


def concatenate(grids: list[BlockGrid]) -> BlockGrid:
    """Grids stacked along N (q, k and v into one matmul) in the form that holds them all."""
    bits, block = max(g.bits for g in grids), min(g.block for g in grids)
    parts = [g.widened(bits, block) for g in grids]
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    kinds = "+".join(dict.fromkeys(g.kind for g in grids))
    return BlockGrid(bits, block, np.concatenate([p.levels for p in parts]), np.concatenate([p.scales for p in parts]),
                     np.concatenate([p.zeros for p in parts]), offsets, kinds)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[B, bytes] -> levels [B, -1, 2 * group]: each run of `group` bytes holds the low nibbles of a
    group of values, then the high nibbles of the next (gguf's layout)."""
    shaped = qs.reshape(qs.shape[0], -1, 1, group) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shaped & np.uint8(0x0F)).reshape(qs.shape[0], -1, 2 * group)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockGrid:
    """A GGUF tensor's raw bytes [N, row bytes] of block type `kind` -> its BlockGrid ([N, K] = `shape`)."""
    n, k = shape
    if kind == "Q4_0" or kind == "Q4_1":
        head = 2 if kind == "Q4_0" else 4
        blocks = raw.reshape(-1, head + 16)
        scales = _f16(blocks[:, 0:2])
        levels = _nibbles(blocks[:, head:], 16).reshape(-1, 32)
        zeros = np.full(scales.shape, 8 if kind == "Q4_0" else 0, np.uint8)
        offsets = _f16(blocks[:, 2:4]) if kind == "Q4_1" else None
        return _grid(4, 32, levels, scales, zeros, offsets, kind, n, k)
    if kind == "Q8_0":
        blocks = raw.reshape(-1, 34)
        levels = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _grid(8, 32, levels, _f16(blocks[:, 0:2]), np.full(len(blocks), 128, np.uint8), None, kind, n, k)
    if kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        blocks = raw.reshape(-1, size)
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scales, offsets = d[:, None] * sc, -(dmin[:, None] * mn)  # gguf: d * q - dm
        if kind == "Q4_K":
            levels = _nibbles(blocks[:, 16:], 32)
        else:
            qh = blocks[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            high = (qh & np.uint8(1)).reshape(-1, 8, 32)
            levels = _nibbles(blocks[:, 48:], 32).reshape(-1, 8, 32) | (high << np.uint8(4))
        bits = 4 if kind == "Q4_K" else 8
        return _grid(bits, 32, levels.reshape(-1, 32), scales.reshape(-1), np.zeros(scales.size, np.uint8),
                     offsets.reshape(-1), kind, n, k)
    if kind == "Q6_K":
        blocks = raw.reshape(-1, 210)
        ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:210]
        scales = _f16(d)[:, None] * sc.copy().view(np.int8).astype(np.float32)  # [B, 16]
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        levels = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))
        return _grid(8, 16, levels.reshape(-1, 16), scales.reshape(-1), np.full(scales.size, 32, np.uint8), None,
                     kind, n, k)
    raise ExportError(f"GGUF block type {kind} is not kept on its grid ({', '.join(KEPT)} are)")


def _grid(bits, block, levels, scales, zeros, offsets, kind, n, k) -> BlockGrid:
    count = k // block
    return BlockGrid(bits, block, np.ascontiguousarray(levels.reshape(n, count, block), np.uint8),
                     np.ascontiguousarray(scales.reshape(n, count), np.float32), zeros.reshape(n, count),
                     None if offsets is None else np.ascontiguousarray(offsets.reshape(n, count), np.float32), kind)


def matmul_nbits_inputs(grid: BlockGrid) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(packed levels, scales [N * K/block], zero points as MatMulNBits takes them or None for its implied
    2^(bits-1), offsets [K/block, N] or None)."""
    levels = grid.levels
    packed = levels[..., 0::2] | (levels[..., 1::2] << 4) if grid.bits == 4 else levels
    zeros = None
    if not np.all(grid.zeros == 1 << (grid.bits - 1)):
        zeros = grid.zeros
        if grid.bits == 4:  # two blocks' zero points a byte, the first in the low nibble
            if zeros.shape[1] % 2:
                zeros = np.concatenate([zeros, np.full((zeros.shape[0], 1), 8, np.uint8)], axis=1)
            zeros = zeros[:, 0::2] | (zeros[:, 1::2] << 4)
        zeros = np.ascontiguousarray(zeros, np.uint8).reshape(-1)
    offsets = None if grid.offsets is None else np.ascontiguousarray(grid.offsets.T)
    return np.ascontiguousarray(packed, np.uint8), grid.scales.reshape(-1), zeros, offsets
