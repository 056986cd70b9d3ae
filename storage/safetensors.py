"""A strict safetensors reader and a small writer, with no pickle anywhere.

The format: 8 bytes little-endian header length N, N bytes of UTF-8 JSON mapping
tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
the data section that follows the header), optional "__metadata__" of str -> str.

Everything is validated when the file is opened, before any tensor is read: header
size, JSON, dtypes, offsets inside the data section, no two tensors overlapping,
dtype size x shape = byte length. Tensors are read with pread into fresh arrays.

In memory, bf16 has no numpy dtype: bf16 tensors are uint16 arrays holding the raw
bits (colibri stores no other 16-bit integer tensors, so uint16 means bf16).
"""

import json
import os
from dataclasses import dataclass

import numpy as np

from .errors import (
    HeaderInvalid,
    HeaderTooSmall,
    HeaderTruncated,
    TensorMissing,
    TensorOutOfBounds,
    TensorOverlap,
    TensorSizeMismatch,
    UnsupportedDtype,
)

HEADER_BYTES_MAX = 100 * 1024 * 1024  # the reference implementation's limit

# safetensors dtype name -> (numpy storage dtype, bytes per element)
DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64),
    "BOOL": np.dtype(np.bool_),
    # one-byte floats, kept as their codes (storage/fpformats.py): FP8 weights, e8m0 scales
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "F8_E8M0": np.dtype(np.uint8),
}
# the dtypes model weights may have; the others are readable (e.g. for scales or ids) but not weights
WEIGHT_DTYPES = ("F32", "F16", "BF16")


def dtype_name(arr: np.ndarray, bf16: bool = True) -> str:
    """The safetensors dtype name of an in-memory array (uint16 is taken as bf16).

    Raises UnsupportedDtype for a numpy dtype with no safetensors name here.
    """
    if arr.dtype == np.uint16 and bf16:
        return "BF16"
    for name, dt in DTYPES.items():
        if dt == arr.dtype and name != "BF16":
            return name
    raise UnsupportedDtype(f"no safetensors dtype for numpy {arr.dtype}")


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """Widen bf16 bits (uint16) to float32, exactly."""
    return (a.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bits (uint16), to nearest even, NaN kept NaN (as torch does)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def n_bytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One safetensors file, its header parsed and checked at construction.

    Raises HeaderTooSmall, HeaderTruncated, HeaderInvalid, UnsupportedDtype,
    TensorOutOfBounds, TensorOverlap or TensorSizeMismatch, each naming the file
    (and the tensor), and OSError if the file cannot be opened.
    """

    def __init__(self, path: str):
        self.path = str(path)
        with open(self.path, "rb") as f:
            self.file_bytes = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise HeaderTooSmall(f"{self.path}: {self.file_bytes} bytes, shorter than the 8-byte header length")
            header_bytes = int.from_bytes(prefix, "little")
            if header_bytes > HEADER_BYTES_MAX or 8 + header_bytes > self.file_bytes:
                raise HeaderTruncated(
                    f"{self.path}: header claims {header_bytes} bytes but the file has {self.file_bytes - 8} "
                    "after the length prefix (truncated or not a safetensors file)"
                )
            raw = f.read(header_bytes)
        self.data_begin = 8 + header_bytes
        self.metadata, self.entries = self._parse(raw)

    def _parse(self, raw: bytes) -> tuple[dict, dict[str, TensorEntry]]:
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HeaderInvalid(f"{self.path}: header is not valid UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise HeaderInvalid(f"{self.path}: header is a JSON {type(header).__name__}, not an object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise HeaderInvalid(f"{self.path}: __metadata__ must map strings to strings")
        data_bytes = self.file_bytes - self.data_begin
        entries = {}
        for name, e in header.items():
            entries[name] = self._entry(name, e, data_bytes)
        reach = None  # the tensor reaching furthest among those that start earlier
        for t in sorted((t for t in entries.values() if t.n_bytes), key=lambda t: t.begin):
            if reach is not None and t.begin < reach.end:
                raise TensorOverlap(f"{self.path}: tensors {reach.name!r} and {t.name!r} overlap")
            if reach is None or t.end > reach.end:
                reach = t
        return metadata, entries

    def _entry(self, name: str, e, data_bytes: int) -> TensorEntry:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise HeaderInvalid(f"{where}: entry needs dtype, shape and data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPES:
            raise UnsupportedDtype(f"{where}: dtype {dtype!r} is not supported")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise HeaderInvalid(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise HeaderInvalid(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if begin < 0 or end < begin or end > data_bytes:
            raise TensorOutOfBounds(
                f"{where}: data_offsets [{begin}, {end}] outside the data section of {data_bytes} bytes"
            )
        n_elem = 1
        for d in shape:
            n_elem *= d
        want = n_elem * DTYPES[dtype].itemsize
        if want != end - begin:
            raise TensorSizeMismatch(
                f"{where}: {dtype} {shape} needs {want} bytes but data_offsets span {end - begin}"
            )
        return TensorEntry(name, dtype, tuple(shape), self.data_begin + begin, self.data_begin + end)

    def read(self, name: str) -> np.ndarray:
        """Read one tensor into a new array of its storage dtype (bf16 as uint16).

        Raises TensorMissing if the name is not in the file, OSError on a failed read.
        """
        e = self.entries.get(name)
        if e is None:
            raise TensorMissing(f"{self.path}: no tensor {name!r}")
        arr = np.empty(e.shape, dtype=DTYPES[e.dtype])
        if e.n_bytes:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                view = memoryview(arr.reshape(-1).view(np.uint8))
                done = 0
                while done < e.n_bytes:
                    n = os.preadv(fd, [view[done:]], e.begin + done)
                    if n <= 0:
                        raise OSError(f"{self.path}: short read of tensor {name!r}")
                    done += n
            finally:
                os.close(fd)
        return arr


class SafetensorsWriter:
    """Writes a safetensors file whose data is produced sequentially.

    `entries` are (name, dtype name, shape) in data order; each starts where the previous
    ends (the format allows no gaps: add padding tensors to align). The header is padded
    with spaces so the data section starts at a multiple of `header_align`. Call
    `write` with the data in order, then `close`, which checks that every byte came.
    Raises UnsupportedDtype for an unknown dtype name, OSError on I/O, ValueError when
    the data written does not match the entries.
    """

    def __init__(self, path: str, entries: list[tuple[str, str, tuple]], metadata: dict | None = None,
                 header_align: int = 8):
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self.offsets = {}
        for name, dtype, shape in entries:
            if dtype not in DTYPES:
                raise UnsupportedDtype(f"{path}: tensor {name!r}: unknown dtype {dtype!r}")
            n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
            self.offsets[name] = offset
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % header_align)
        self.data_begin = 8 + len(raw)
        self.data_bytes = offset
        self.written = 0
        self.path = path
        self.f = open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little"))
        self.f.write(raw)

    def write(self, data) -> None:
        mv = memoryview(data)
        if mv.nbytes == 0:  # a tensor with a zero in its shape: valid, no bytes (memoryview cannot cast it)
            return
        mv = mv.cast("B")
        self.f.write(mv)
        self.written += mv.nbytes

    def close(self) -> None:
        if self.written != self.data_bytes:
            self.f.close()
            raise ValueError(f"{self.path}: wrote {self.written} data bytes, header promises {self.data_bytes}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors (uint16 arrays are stored as BF16) to path as safetensors.

    The data section starts 8-byte aligned, as the reference writer does. Writes to
    path + ".tmp" and renames when complete. Raises UnsupportedDtype for an array with
    no safetensors dtype, OSError on I/O.
    """
    arrays = {name: np.ascontiguousarray(arr) for name, arr in tensors.items()}
    tmp = f"{path}.tmp"
    w = SafetensorsWriter(tmp, [(n, dtype_name(a), a.shape) for n, a in arrays.items()], metadata)
    for a in arrays.values():
        w.write(a.reshape(-1).view(np.uint8))
    w.close()
    os.replace(tmp, path)
