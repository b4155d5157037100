"""A minimal PNG reader for screenshots (8-bit RGB or RGBA, not interlaced): enough to tell a rendered page from a
blank one without an imaging library. Filters 0-2 are vectorized; Average and Paeth run per byte in Python."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np


def read_png(path: Path) -> np.ndarray:
    """-> uint8 [height, width, channels]."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
    assert header is not None, "no IHDR chunk"
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            row = line.copy()
        elif kind == 1:  # Sub: running sum of each channel along the row
            row = (np.cumsum(line.reshape(width, bpp).astype(np.int64), axis=0) % 256).astype(np.uint8).ravel()
        elif kind == 2:  # Up
            row = line + prev
        else:
            row = _sequential(kind, line, prev, bpp)
        out[y] = row
        prev = row
    return out.reshape(height, width, bpp)


def _sequential(kind: int, line: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    cur = bytearray(len(line))
    up = prev.tolist()
    filt = line.tolist()
    for i, x in enumerate(filt):
        a = cur[i - bpp] if i >= bpp else 0
        b = up[i]
        if kind == 3:
            cur[i] = (x + (a + b) // 2) & 0xFF
        else:
            c = up[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            cur[i] = (x + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return np.frombuffer(bytes(cur), dtype=np.uint8)
