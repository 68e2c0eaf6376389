"""The GGUF file format: header parsing on an mmap (dequantisation: layers/quant_blocks.py).

Layout of a GGUF file (all little-endian)::

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, value_type u32, value)
    n_tensors x (name: string, n_dims u32, dims u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

where a string is ``len u64`` + UTF-8 bytes and an array is ``elem_type u32, count u64, elems``.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from pagedlm.layers.quant_blocks import can_dequantize, supported_type_names

_ArrayT = TypeVar("_ArrayT", np.ndarray, torch.Tensor)
_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# Fixed-size scalar value types: struct format and numpy dtype (little-endian).
_SCALAR_FORMATS: dict[int, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


# --------------------------------------------------------------------------------------------
# Low-level file parsing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the GGUF header."""

    name: str
    shape: tuple[int, ...]  # torch/HF order (outermost first), i.e. GGUF dims reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class _Parser:
    """Cursor over the mapped file; only the header region is ever walked with it."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self) -> str:
        n = self.u64()
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        # Token strings can hold partial UTF-8 sequences in odd vocabularies; never fail on them.
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        try:
            fmt, dtype = _SCALAR_FORMATS[vtype]
        except KeyError:
            raise ValueError(
                f"Corrupt GGUF: unknown value type {vtype} at byte {self.pos}"
            ) from None
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += dtype.itemsize
        return value

    def array(self) -> Any:
        etype = self.u32()
        count = self.u64()
        if etype in _SCALAR_FORMATS:
            # Numeric arrays (token types, scores) in one numpy call, copied so that nothing keeps
            # a view into the mapping after the header is parsed.
            dtype = _SCALAR_FORMATS[etype][1]
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        if etype == GGUFValueType.STRING:
            return self._string_array(count)
        return [self.value(etype) for _ in range(count)]

    def _string_array(self, count: int) -> list[str]:
        # Hot loop for vocabularies (~100k strings): locals and no method calls per element.
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


def _tensor_nbytes(ggml_type: GGMLQuantizationType, n_elements: int, name: str) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    except KeyError:
        raise ValueError(f"Tensor {name!r} has unsupported GGML type {ggml_type!r}") from None
    if n_elements % block_size:
        raise ValueError(f"Tensor {name!r}: {n_elements} elements is not a whole number of blocks")
    return n_elements // block_size * type_size


def parse_header(buf: mmap.mmap) -> tuple[int, dict[str, Any], dict[str, GGUFTensorInfo]]:
    if buf[:4] != _GGUF_MAGIC:
        raise ValueError("Not a GGUF file (bad magic)")
    p = _Parser(buf)
    p.pos = 4
    version = p.u32()
    if version not in (2, 3):
        # A byte-swapped version number means a big-endian file, which we do not read.
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (this looks like a big-endian GGUF)" if swapped in (2, 3) else ""
        raise ValueError(f"Unsupported GGUF version {version}{hint}; expected 2 or 3")
    n_tensors = p.u64()
    n_kv = p.u64()
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.string()
        metadata[key] = p.value(p.u32())

    raw_infos = []
    for _ in range(n_tensors):
        name = p.string()
        n_dims = p.u32()
        dims = struct.unpack_from(f"<{n_dims}Q", buf, p.pos)
        p.pos += 8 * n_dims
        type_id = p.u32()
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(
                f"GGUF tensor {name!r} has GGML type {type_id}, which the installed gguf package "
                f"does not know (a newer quantisation: `pip install -U gguf` may help); supported "
                f"types: {', '.join(supported_type_names())}"
            ) from None
        offset = p.u64()
        raw_infos.append((name, dims, ggml_type, offset))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-p.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, ggml_type, offset in raw_infos:
        shape = tuple(int(d) for d in reversed(dims))
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        n_bytes = _tensor_nbytes(ggml_type, n_elements, name)
        start = data_start + offset
        if start + n_bytes > len(buf):
            raise ValueError(f"Truncated GGUF file: tensor {name!r} runs past the end of the file")
        tensors[name] = GGUFTensorInfo(name, shape, ggml_type, start, n_bytes)
    return version, metadata, tensors


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def check_dequantizable(infos: Iterable[GGUFTensorInfo]) -> None:
    """ValueError naming the first tensor stored in a type we cannot dequantise."""
    for info in infos:
        if not can_dequantize(info.ggml_type):
            raise ValueError(
                f"GGUF tensor {info.name!r} is stored as {info.ggml_type.name}, which pagedlm cannot "
                f"dequantise; use a file quantised to supported types: {', '.join(supported_type_names())}"
            )


def unpermute_qk(weight: _ArrayT, n_head: int) -> _ArrayT:
    """Undo llama.cpp's Q/K row permutation.

    HF Llama applies rotary embeddings "rotate-half" style: within a head of size D, element i
    pairs with element i + D/2. ggml's llama rope pairs adjacent elements (2i, 2i+1), so the
    converter reorders each head's output rows from ``[x_0..x_{D/2-1}, y_0..y_{D/2-1}]`` to
    ``[x_0, y_0, x_1, y_1, ...]``. Row ``h*D + 2i + j`` of the GGUF tensor is row
    ``h*D + j*D/2 + i`` of the HF tensor; we read the GGUF rows as ``[head, i, j]`` and swap the
    last two axes. Works for weights ([rows, in]) and biases ([rows]), numpy or torch.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"Cannot un-permute {rows} rows over {n_head} heads")
    rest = tuple(weight.shape[1:])
    grouped = weight.reshape(n_head, rows // n_head // 2, 2, *rest)
    return grouped.swapaxes(1, 2).reshape(tuple(weight.shape))
