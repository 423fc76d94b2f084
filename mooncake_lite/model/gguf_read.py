"""A direct reader of a GGUF file's header: its key/values and where each tensor's bytes lie.

gguf-py's ``GGUFReader`` builds a field object per element of every array, ~3.5 s for a 49k-token
vocabulary and its merges on a small CPU, in every process that starts. The format is simple
(little-endian: magic, version, counts, typed key/values, tensor infos, aligned data), so this
reads it in one pass with ``struct`` and leaves the tensor bytes to a memory map; dequantization
stays with ``gguf.quants``, the format's reference implementation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from mooncake_lite.model.errors import CheckpointError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one scalar (8 = string, 9 = array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]      # as GGUF lists them: innermost first
    qtype: int                 # a GGMLQuantizationType value
    offset: int                # absolute byte offset in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """PyTorch order: outermost first."""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise CheckpointError(f"{self.path}: not a readable GGUF file (truncated at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: not a readable GGUF file (a string runs past the end)")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            return self.array(item_type, count)
        if vtype not in _SCALARS:
            raise CheckpointError(f"{self.path}: not a readable GGUF file (value type {vtype})")
        return self.take(_SCALARS[vtype])

    def array(self, item_type: int, count: int) -> tuple:
        if item_type == STRING:
            return tuple(self.string() for _ in range(count))
        if item_type in _SCALARS:   # one unpack for the whole array
            size = struct.calcsize(_SCALARS[item_type]) * count
            if self.pos + size > len(self.buf):   # checked before a format string of `count` is built
                raise CheckpointError(f"{self.path}: not a readable GGUF file (an array runs past the end)")
            values = struct.unpack_from(f"<{count}{_SCALARS[item_type][1]}", self.buf, self.pos)
            self.pos += size
            return values
        return tuple(self.value(item_type) for _ in range(count))


def read_header(path: str) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(key/values, tensor name -> info) of the GGUF file at ``path``."""
    import mmap
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse(view, path)
            except CheckpointError as exc:
                # Keep only the message: the exception's frames hold views of the map, which
                # must all be gone before it can close.
                problem = str(exc)
            finally:
                view.release()
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None
    raise CheckpointError(problem)


def _parse(buf: memoryview, path: str) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != MAGIC:
        raise CheckpointError(f"{path}: not a readable GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: not a readable GGUF file (format version {version})")
    num_tensors, num_kv = cur.take("<Q"), cur.take("<Q")
    fields = {}
    for _ in range(num_kv):
        key = cur.string()
        fields[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    end = cur.pos
    alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-end // alignment) * alignment     # the data section starts aligned
    return fields, {n: TensorInfo(n, d, q, data_start + o) for n, d, q, o in infos}

