"""Weights files (safetensors) and binding them to a graph's parameters.

``load_safetensors`` parses the format itself (8-byte little-endian header
length, JSON header, raw little-endian data) so that it can read bf16 with numpy
alone and check everything: every problem raises ``WeightsError`` naming the file
and what is wrong, never a raw exception. Floats come back as float32, integers
as int32.

``save_safetensors`` writes a temp file next to the target and renames it.

``bind_weights`` checks a set of tensors against the shapes a model expects and
reports every missing, unexpected and mis-shaped tensor in one error.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from .arrays import widen_bf16
from .errors import OutputError, WeightsError
from .files import write_atomically

# safetensors itself refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000

# dtype name -> (numpy dtype of the stored little-endian data, itemsize)
_DTYPES = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),  # raw bits, widened to float32 below
    "I64": ("<i8", 8),
    "I32": ("<i4", 4),
    "I16": ("<i2", 2),
    "I8": ("i1", 1),
    "U64": ("<u8", 8),
    "U32": ("<u4", 4),
    "U16": ("<u2", 2),
    "U8": ("u1", 1),
    "BOOL": ("u1", 1),
}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_INT32 = np.iinfo(np.int32)


class WeightsMismatchError(WeightsError):
    """Tensors do not fit the model; lists every problem at once.

    ``missing``: [(name, expected shape)], ``unexpected``: [(name, shape)],
    ``misshaped``: [(name, expected shape, found shape)].
    """

    def __init__(self, message, missing=(), unexpected=(), misshaped=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.misshaped = list(misshaped)


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _sniff(head: bytes) -> str:
    """A hint about what a file that is not safetensors looks like."""
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return " (it looks like a zip archive, e.g. a numpy .npz or a PyTorch .pt/.bin checkpoint)"
    if head.startswith(b"\x93NUMPY"):
        return " (it looks like a numpy .npy file)"
    if head.startswith(b"\x80"):
        return " (it looks like a Python pickle, e.g. a PyTorch .bin checkpoint)"
    if head.startswith(b"\x89HDF"):
        return " (it looks like an HDF5 file)"
    if head and all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return " (it looks like a text file)"
    return ""


def load_safetensors(path, progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Read a .safetensors file: float tensors as float32, integer ones as int32.
    ``progress(bytes read, file size)`` after each tensor (what it raises ends the read)."""
    path = Path(path)
    where = f"weights file {path}"
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise WeightsError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise WeightsError(f"{where}: is a directory, not a .safetensors file") from None
    except OSError as exc:
        raise WeightsError(f"{where}: cannot open it ({exc.strerror or exc})") from None
    with f:
        try:
            return _read(f, path, where, progress)
        except WeightsError:
            raise
        except OSError as exc:
            raise WeightsError(f"{where}: cannot read it ({exc.strerror or exc})") from None
        except MemoryError:
            raise WeightsError(f"{where}: not enough memory to load it") from None


def _read(f, path: Path, where: str, progress=None) -> dict[str, np.ndarray]:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    not_st = f"{where} is not a safetensors file"
    if size == 0:
        raise WeightsError(f"{where} is empty (0 bytes), not a safetensors file")
    if size < 8:
        raise WeightsError(
            f"{where} is truncated or not a safetensors file{_sniff(head)}: "
            f"it has {size} bytes, but the header length alone takes 8"
        )
    (header_len,) = struct.unpack("<Q", head)
    available = size - 8
    if header_len > MAX_HEADER_BYTES:
        raise WeightsError(
            f"{not_st}{_sniff(head)}: its first 8 bytes give a header length of "
            f"{header_len} bytes (safetensors allows at most {MAX_HEADER_BYTES})"
        )
    if header_len > available:
        raise WeightsError(
            f"{where}: truncated or not a safetensors file{_sniff(head)}: "
            f"header says {header_len} bytes of JSON header, file has {available} after the length field"
        )
    if header_len < 2:
        raise WeightsError(f"{not_st}{_sniff(head)}: header length {header_len} is too small for JSON")
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise WeightsError(f"{where}: file shrank while reading the header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WeightsError(
            f"{where}: corrupt header or not a safetensors file{_sniff(head + raw[:64])}: "
            f"the {header_len}-byte header is not valid JSON ({exc})"
        ) from None
    if not isinstance(header, dict):
        raise WeightsError(f"{where}: corrupt header: the JSON header is a {type(header).__name__}, not an object")

    data_start = 8 + header_len
    data_len = size - data_start
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise WeightsError(f"{where}: corrupt header: __metadata__ is not an object")

    entries = []
    for name, entry in header.items():
        entries.append((name, *_check_entry(name, entry, where)))

    # Truncation first (the most common failure), reported for the whole file.
    needed = max((end for _, _, _, _, end in entries), default=0)
    if needed > data_len:
        raise WeightsError(
            f"{where}: truncated: header says {needed} bytes of data, file has {data_len}"
        )
    spans = sorted((begin, end, name) for name, _, _, begin, end in entries if end > begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise WeightsError(
                f"{where}: corrupt header: tensors {n0!r} (bytes {b0}..{e0}) and "
                f"{n1!r} (bytes {b1}..{e1}) overlap"
            )

    out: dict[str, np.ndarray] = {}
    for name, dtype, shape, begin, end in entries:
        f.seek(data_start + begin)
        stored = np.empty(math.prod(shape), dtype=_DTYPES[dtype][0])   # read straight into it: no bytes object to copy
        if f.readinto(memoryview(stored).cast("B")) != end - begin:
            raise WeightsError(f"{where}: truncated while reading tensor {name!r}")
        out[name] = _convert(stored, dtype, shape, name, where)
        if progress is not None:
            progress(f.tell(), size)
    return out


def _check_entry(name, entry, where):
    bad = f"{where}: corrupt header: tensor {name!r}"
    if not isinstance(entry, dict):
        raise WeightsError(f"{bad} is described by a {type(entry).__name__}, not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise WeightsError(f"{bad} has no dtype")
    if dtype not in _DTYPES:
        raise WeightsError(
            f"{where}: tensor {name!r} has dtype {dtype}, which is not supported "
            f"(supported: {', '.join(_DTYPES)})"
        )
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WeightsError(f"{bad} has shape {shape!r}; expected a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise WeightsError(f"{bad} has data_offsets {offsets!r}; expected [begin, end]")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise WeightsError(f"{bad} has data_offsets [{begin}, {end}]; need 0 <= begin <= end")
    itemsize = _DTYPES[dtype][1]
    nbytes = math.prod(shape) * itemsize
    if end - begin != nbytes:
        raise WeightsError(
            f"{bad}: shape {_fmt_shape(shape)} of {dtype} needs {nbytes} bytes, "
            f"but data_offsets [{begin}, {end}] span {end - begin}"
        )
    return dtype, tuple(shape), begin, end


def _convert(stored: np.ndarray, dtype: str, shape: tuple, name: str, where: str) -> np.ndarray:
    """The tensor ``stored`` (its elements as the file has them, read into a new array) as
    float32 or int32; F32 comes back as it is, without a copy."""
    if dtype == "BF16":   # a bf16 value is the upper half of a float32's bits
        array = widen_bf16(stored.reshape(shape))
    elif dtype in _FLOAT_DTYPES:
        array = stored.astype(np.float32, copy=False)
    else:
        if stored.size and dtype in ("I64", "U64", "U32"):
            lo, hi = stored.min(), stored.max()
            if lo < _INT32.min or hi > _INT32.max:
                raise WeightsError(
                    f"{where}: tensor {name!r} ({dtype}) holds values in [{lo}, {hi}], "
                    "outside the int32 range the engine uses"
                )
        array = stored.astype(np.int32, copy=False)
    return array.reshape(shape)


def save_safetensors(tensors: Mapping[str, np.ndarray], path, metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (floats as float32, integers as int32) atomically."""
    path = Path(path)
    where = f"weights file {path}"
    prepared = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise WeightsError(f"cannot save {where}: tensor name {name!r} is not a string")
        array = np.asarray(value)
        if array.dtype.kind == "f":
            array = array.astype(np.float32)
        elif array.dtype.kind in "iub":
            array = array.astype(np.int32)
        else:
            raise WeightsError(f"cannot save {where}: tensor {name!r} has dtype {array.dtype}")
        prepared[name] = np.asarray(array, order="C")  # (ascontiguousarray makes 0-d 1-d)
    if metadata is not None:
        metadata = {str(k): str(v) for k, v in metadata.items()}

    from safetensors.numpy import save

    try:
        blob = save(prepared, metadata=metadata)
    except Exception as exc:
        raise WeightsError(f"cannot save {where}: {exc}") from None

    try:
        write_atomically(path, blob, durable=True)
    except OutputError as exc:
        raise WeightsError(str(exc)) from None   # the importers' callers catch WeightsError


def _transposed(array: np.ndarray, how) -> np.ndarray:
    if how is None or how is True:
        if array.ndim != 2:
            return array  # reported as mis-shaped by the caller's shape check
        return array.T
    axes = tuple(how)
    if sorted(axes) != list(range(array.ndim)):
        return array
    return np.transpose(array, axes)


def _as_stored(shape: tuple, how) -> tuple:
    """An engine-layout ``shape`` as a file stores it where ``_transposed(stored, how)``
    gives the engine's layout (``how``: None, True or an axes permutation)."""
    if how is None or len(shape) < 2:
        return shape
    if how is True:
        return tuple(reversed(shape)) if len(shape) == 2 else shape
    axes = tuple(how)
    if sorted(axes) != list(range(len(shape))):
        return shape
    stored = [0] * len(shape)
    for i, axis in enumerate(axes):
        stored[axis] = shape[i]
    return tuple(stored)


def bind_weights(
    tensors: Mapping[str, np.ndarray],
    expected: Mapping[str, Iterable[int]],
    transposes: Iterable[str] | Mapping[str, object] = (),
    allow_missing: bool = False,
    source=None,
    owned: bool = False,
) -> dict[str, np.ndarray]:
    """Check ``tensors`` against ``expected`` (name -> shape) and return float32
    arrays for the expected names: new contiguous ones (but see ``owned``).

    ``transposes`` names tensors stored transposed (HF Linear stores [out, in],
    the engine wants [in, out]); as a dict it maps a name to an axes permutation
    (or True for a 2-D transpose). ``source`` (a file name) goes into the error
    message. All problems are collected and raised in one ``WeightsMismatchError``;
    nothing is modified on failure.

    ``owned``: the tensors are the caller's to give away (``load_safetensors`` just made
    them): float32 ones are bound as they are and transposed ones as views, uncopied. A
    transposing copy of a 1B-parameter checkpoint took 16 s on a 2-core host, and
    generation, which keeps the weights [out, in] as the file does, transposed them back.
    """
    if isinstance(transposes, Mapping):
        how = dict(transposes)
    else:
        how = {name: True for name in transposes}

    missing, unexpected, misshaped = [], [], []
    bound: dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        shape = tuple(int(d) for d in shape)
        if name not in tensors:
            if not allow_missing:
                missing.append((name, shape))
            continue
        array = np.asarray(tensors[name])
        stored_shape = array.shape
        if name in how:
            array = _transposed(array, how[name])
        if array.shape != shape:
            misshaped.append((name, shape, array.shape, stored_shape if name in how else None))
            continue
        bound[name] = (np.asarray(array, dtype=np.float32) if owned
                       else np.array(array, dtype=np.float32, order="C", copy=True))
    for name, value in tensors.items():
        if name not in expected:
            unexpected.append((name, tuple(np.shape(value))))

    if missing or unexpected or misshaped:
        parts = []
        if missing:   # shapes as the file would store them, which is what its writer sees
            parts.append(
                f"{len(missing)} missing: "
                + ", ".join(f"{n} (expected {_fmt_shape(_as_stored(s, how.get(n)))})" for n, s in missing)
            )
        if misshaped:
            items = [f"{n} expected {_fmt_shape(_as_stored(exp, how.get(n)))} found "
                     f"{_fmt_shape(found if stored is None else stored)}" for n, exp, found, stored in misshaped]
            parts.append(f"{len(misshaped)} mis-shaped: " + ", ".join(items))
        if unexpected:
            parts.append(
                f"{len(unexpected)} unexpected: "
                + ", ".join(f"{n} {_fmt_shape(s)}" for n, s in unexpected)
            )
        head = f"weights file {source}" if source is not None else "weights"
        verb = "does not fit" if source is not None else "do not fit"
        raise WeightsMismatchError(
            f"{head} {verb} the model: " + "; ".join(parts),
            missing=missing,
            unexpected=unexpected,
            misshaped=[(n, e, f) for n, e, f, _ in misshaped],
        )
    return bound
