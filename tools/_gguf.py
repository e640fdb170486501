"""A small, fast GGUF reader: metadata, tensor layout and dequantized tensors.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array; on a
tokenizer of ~50k tokens and ~50k merges that takes 10-20 s on a slow CPU, longer than the
whole conversion should. This module parses the (simple, documented) GGUF v2/v3 header with
``struct`` in well under a second and keeps the tensor data memory-mapped; the ``gguf``
package still supplies the quantization tables and the dequantization kernels, so no
quantization format is re-implemented here.

Only used by the checkpoint preparation scripts in ``tools/``; nothing here runs at training
time.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple, Union

import numpy as np

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType) -> struct format of one little-endian scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, still in its stored (possibly quantized) form.

    Attributes:
        name (str): the llama.cpp name, e.g. ``blk.0.attn_q.weight``.
        shape (Tuple[int, ...]): the logical shape in numpy / PyTorch order (GGUF lists the
            dims innermost first; this is that list reversed), e.g. ``(out_features, in_features)``.
        qtype (int): the ``gguf.GGMLQuantizationType`` value.
        raw (np.ndarray): ``uint8`` bytes, ``[*shape[:-1], bytes_per_row]``, a view of the mapping.
    """

    name: str
    shape: Tuple[int, ...]
    qtype: int
    raw: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The tensor as ``float32``, ``shape``, dequantized by the ``gguf`` package.

        Returns:
            np.ndarray: ``float32`` array of ``self.shape`` (a fresh array, not a view).
        """
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(self.raw, GGMLQuantizationType(self.qtype)).reshape(self.shape)
        if not out.flags.writeable:  # F32 / F16 come back as views of the read-only mapping
            out = out.copy()
        return np.ascontiguousarray(out, dtype=np.float32)


@dataclass
class GGUFFile:
    """A parsed GGUF file.

    Attributes:
        path (Path): the file.
        version (int): GGUF format version (2 or 3).
        metadata (Dict[str, Any]): every key-value pair; arrays as Python lists.
        tensors (Dict[str, GGUFTensor]): by name, in file order.
    """

    path: Path
    version: int
    metadata: Dict[str, Any]
    tensors: Dict[str, GGUFTensor]


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buf: Union[bytes, mmap.mmap], pos: int = 0):
        self.buf = buf
        self.pos = pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:  # one bulk read, not `count` struct calls
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            read: Callable[[], Any] = self.string if etype == _STRING else (lambda: self.value(etype))
            return [read() for _ in range(count)]
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf(path: Union[str, Path]) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (nothing is dequantized yet).

    Args:
        path (Union[str, Path]): the ``.gguf`` file.

    Returns:
        GGUFFile: metadata and tensors; tensor data stays memory-mapped for the life of the
        returned object.

    Raises:
        ValueError: not a little-endian GGUF v2/v3 file, or a tensor runs past the file's end.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(mm)
    if mm[:4] != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(mm[:4])!r}).")
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        # A big-endian file reads as a huge version number.
        raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3, little-endian).")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")

    metadata: Dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))

    infos: List[Tuple[str, Tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        qtype, offset = cur.scalar("<I"), cur.scalar("<Q")
        infos.append((name, tuple(reversed(dims)), qtype, offset))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: Dict[str, GGUFTensor] = {}
    for name, shape, qtype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        if shape[-1] % block:
            raise ValueError(f"{path}: tensor {name} row of {shape[-1]} is not a whole number of blocks of {block}.")
        row_bytes = shape[-1] // block * type_size
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        start = data_start + offset
        if start + nbytes > len(mm):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated download?).")
        raw = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=start).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name=name, shape=shape, qtype=qtype, raw=raw)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)
