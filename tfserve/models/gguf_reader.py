"""A GGUF file's header, metadata and tensor table, read in a fraction of a second, its tensors memory-mapped.

`gguf.GGUFReader` makes two numpy views per string and one per number of every metadata array: a 150k-token
vocabulary with its merges took 8 s to open, a 262k one 14 s, before anything was loaded. This reader walks
the header once with `struct`, keeps an array's items as offsets into the mapped file, and makes a value only
when asked. It has `GGUFReader`'s face (`fields`, `tensors`, `ReaderField`, `ReaderTensor`), so gguf-py's and
transformers' code that takes a reader (the GGUF metadata -> config and tokenizer mapping) runs on it too.
"""

from __future__ import annotations

import functools
import logging
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from tfserve.errors import ModelLoadError, first_line

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9

logger = logging.getLogger(__name__)


def read(path: Path) -> Reader:
    """The file's Reader, or a ModelLoadError saying in one line why it cannot be read. transformers' own reader
    fails on a cut file with whatever broke first (`struct.error: unpack_from requires a buffer of at least 1006
    bytes`, a numpy reshape error); this one checks every tensor against the file's size, so it tells a
    truncated download from a model transformers cannot load."""
    try:
        with open(path, "rb") as file:
            magic = file.read(len(MAGIC))
        stat = path.stat()
    except OSError as exc:  # gone, a folder, not ours to read: said as the OS says it
        raise ModelLoadError(f"cannot read {path}: {exc.strerror or first_line(exc)}") from None
    if magic != MAGIC:
        raise _cut_short(path, f"it does not begin with the GGUF magic bytes, {MAGIC.decode()}")
    size, key = stat.st_size, (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    reader = _recent.get(key)
    if reader is not None:
        return reader
    try:
        reader = Reader(path)
    except (ValueError, OSError) as exc:  # a cut file fails wherever its end comes
        logger.debug("reading %s: %s", path, first_line(exc))
        raise _cut_short(path, f"its {size:,} bytes do not hold the header and tensors it describes") from None
    while len(_recent) >= MAX_RECENT:
        _recent.pop(next(iter(_recent)), None)
    _recent[key] = reader
    return reader


# The files read last, by path and identity: a start reads one file's header for its model and again for its
# engine, and walking a 262k-token vocabulary and its merges item by item takes a few tenths of a second.
MAX_RECENT = 2
_recent: dict[tuple, Reader] = {}


def release(path: str | Path) -> None:
    """Forget the file's reader and hand its pages back: once the kernels hold their own (repacked) copies of
    the blocks, the mapped file's pages would count a second time in the server's memory (a 0.5B Q8_0 file's
    650 MB). Views still held (a float tensor used as stored) fault their pages back in from the page cache
    as they are read; nothing was written to the copy-on-write map, so nothing is lost."""
    path = Path(path)
    for key in [key for key in _recent if Path(key[0]) == path]:
        _recent.pop(key).drop_pages()


def _cut_short(path: Path, reason: str) -> ModelLoadError:
    return ModelLoadError(f"cannot read {path}: it is truncated or not a GGUF file ({reason})")


class GGUFFormatError(ValueError):
    """The bytes are not a whole GGUF file: the header or a tensor runs past the end, or the magic is wrong."""


class _Parts(Sequence):
    """A field's `parts` as gguf-py lays them out, made on demand: `parts[i]` for i in the field's `data` is one
    value: a string's bytes, a number as a 1-tuple (what `part[0]` reads); other indices are the framing, which
    no reader of values asks for."""

    def __init__(self, buffer: np.ndarray, kind: int, offsets: np.ndarray, lengths: np.ndarray | None) -> None:
        self.buffer, self.kind, self.offsets, self.lengths = buffer, kind, offsets, lengths
        self._numbers: list | None = None  # every number of the field, read at once when the first is asked for

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if self.kind == STRING:
            start = int(self.offsets[index])
            return self.buffer[start: start + int(self.lengths[index])].tobytes()
        if self._numbers is None:
            first = int(self.offsets[0]) if len(self.offsets) else 0
            self._numbers = np.frombuffer(self.buffer, dtype=_NUMPY[self.kind], count=len(self.offsets),
                                          offset=first).tolist()
        return (self._numbers[index],)


class Field:
    """One metadata key: `value` (a scalar, a string, or a list), and gguf-py's `parts` / `data` / `types`."""

    __slots__ = ("name", "types", "parts", "data", "offset")

    def __init__(self, name: str, types: list, parts: _Parts, offset: int) -> None:
        import gguf

        self.name, self.offset, self.parts = name, offset, parts
        self.types = [gguf.GGUFValueType(t) for t in types]
        self.data = range(len(parts))

    @property
    def value(self) -> Any:
        """The value: a list for an array; strings decoded (invalid UTF-8 replaced)."""
        items = [self._item(i) for i in self.data]
        return items if self.types[0] == ARRAY else items[0]

    def _item(self, index: int) -> Any:
        part = self.parts[index]
        if self.types[-1] == STRING:
            return part.decode("utf-8", "replace")
        return part[0]

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """gguf-py's `ReaderField.contents`."""
        value = self.value
        return value[index_or_slice] if isinstance(value, list) else value


class Tensor:
    """One tensor: its name, GGML type, `shape` as GGUF stores dims (innermost first), and `data`, a view of the
    mapped file: typed [rows..., columns] for F32/F16, else uint8 [rows..., bytes per row]."""

    __slots__ = ("name", "tensor_type", "shape", "n_elements", "n_bytes", "data_offset", "data")

    def __init__(self, name, tensor_type, shape, n_elements, n_bytes, data_offset, data) -> None:
        self.name, self.tensor_type, self.shape = name, tensor_type, shape
        self.n_elements, self.n_bytes, self.data_offset, self.data = n_elements, n_bytes, data_offset, data


class Reader:
    """`Reader(path)`: `fields` {key: Field} and `tensors` [Tensor], in the file's order; `value(key)`."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        if self.path.stat().st_size < len(MAGIC) + 20:  # numpy cannot map an empty file
            raise GGUFFormatError("it is too short to hold a GGUF header")
        # copy-on-write: views are writable, never written; a plain ndarray view slices 10x faster than a memmap
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        self.buffer = self._map.view(np.ndarray)
        self._pos = len(MAGIC)
        if bytes(self.buffer[:4]) != MAGIC:
            raise GGUFFormatError("it does not begin with the GGUF magic bytes")
        version, num_tensors, num_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (this reader knows 2 and 3)")
        self.fields: dict[str, Field] = {}
        for _ in range(num_fields):
            offset = self._pos
            name = self._string()
            self.fields[name] = self._field(name, offset)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, kind, offset))
        alignment = int(self.value("general.alignment") or DEFAULT_ALIGNMENT)
        self.data_offset = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(gguf, *info) for info in infos]

    def drop_pages(self) -> None:
        """Take the mapped file's pages out of this process's resident memory (madvise MADV_DONTNEED)."""
        import mmap

        handle = getattr(self._map, "_mmap", None)
        if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
            handle.madvise(mmap.MADV_DONTNEED)

    def value(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.value

    def _tensor(self, gguf, name: str, dims: tuple, kind: int, offset: int) -> Tensor:
        try:
            tensor_type = gguf.GGMLQuantizationType(kind)
            block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name} has an unknown type {kind}") from None
        num_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims[0] % block:
            raise GGUFFormatError(f"tensor {name}'s rows of {dims[0]} are not whole blocks of {block}")
        row_bytes = dims[0] // block * block_bytes
        num_bytes = num_elements // dims[0] * row_bytes
        start = self.data_offset + offset
        if start + num_bytes > len(self.buffer):
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        raw = self.buffer[start: start + num_bytes]
        rows = tuple(int(d) for d in reversed(dims[1:]))
        if tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = raw.view(np.float32 if tensor_type == gguf.GGMLQuantizationType.F32 else np.float16)
            data = data.reshape(*rows, int(dims[0]))
        else:
            data = raw.reshape(*rows, row_bytes)
        return Tensor(name, tensor_type, np.array(dims, dtype=np.uint64), num_elements, num_bytes, start, data)

    def _field(self, name: str, offset: int) -> Field:
        (kind,) = self._unpack("<I")
        if kind == ARRAY:
            item_kind, count = self._unpack("<IQ")
            offsets, lengths = self._items(item_kind, count)
            return Field(name, [ARRAY, item_kind], _Parts(self.buffer, item_kind, offsets, lengths), offset)
        offsets, lengths = self._items(kind, 1)
        return Field(name, [kind], _Parts(self.buffer, kind, offsets, lengths), offset)

    def _items(self, kind: int, count: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Offsets (and for strings, lengths) of `count` values of `kind` from here on; the position moves past them."""
        item_bytes = 8 if kind == STRING else np.dtype(_NUMPY[kind]).itemsize if kind in _NUMPY else 1
        if count * item_bytes > len(self.buffer) - self._pos:  # a count no file of this size holds (a hostile one)
            raise GGUFFormatError("the metadata runs past the end of the file")
        if kind == STRING:
            offsets = np.empty(count, dtype=np.int64)
            lengths = np.empty(count, dtype=np.int64)
            buffer, pos, unpack = self.buffer, self._pos, struct.unpack_from
            raw = memoryview(buffer)
            try:
                for i in range(count):
                    (length,) = unpack("<Q", raw, pos)
                    offsets[i], lengths[i] = pos + 8, length
                    pos += 8 + length
            except struct.error:
                pos = len(buffer) + 1
            if pos > len(buffer):
                raise GGUFFormatError("the metadata runs past the end of the file")
            self._pos = pos
            return offsets, lengths
        if kind not in _NUMPY:
            raise GGUFFormatError(f"metadata of unknown type {kind}")
        size = np.dtype(_NUMPY[kind]).itemsize
        offsets = self._pos + size * np.arange(count, dtype=np.int64)
        self._pos += size * count
        if self._pos > len(self.buffer):
            raise GGUFFormatError("the metadata runs past the end of the file")
        return offsets, None

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        end = self._pos + length
        if end > len(self.buffer):
            raise GGUFFormatError("the header runs past the end of the file")
        text = bytes(self.buffer[self._pos: end]).decode("utf-8", "replace")
        self._pos = end
        return text

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self.buffer):
            raise GGUFFormatError("the header runs past the end of the file")
        values = struct.unpack_from(fmt, self.buffer, self._pos)
        self._pos += size
        return values


@contextmanager
def serving_gguf_readers() -> Iterator[None]:
    """While inside, `gguf.GGUFReader(path)` (what transformers' GGUF config, tokenizer and weight loading call)
    is this reader, one per file for the two files opened last: transformers opens a file once for the config,
    once for the tokenizer, once for the weights. gguf-py's tensor-name map is built once per architecture
    instead of once per submodule (~200 times for a small model)."""
    import gguf

    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(lambda path, mode="r": Reader(path))
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(make_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_map
