"""A user's training data as a dataset: a dict of arrays keyed by model input name, the
first axis over examples.

``data_kind`` says what a path holds (arrays, text or audio); ``read_arrays`` reads an
``.npz`` or a folder of ``.npy`` files named after the inputs; ``fit_arrays`` checks them
against what the model's training graph takes (every input present, integer or float as
the input is, the shape after the first axis, one example count) and casts them to its
dtypes; ``hold_out`` splits off the validation examples, the same ones whatever the
training seed. Every problem is a ``DataError`` of one line naming the file and the input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import DataError

ARRAY_SUFFIXES = (".npz", ".npy")
TEXT_SUFFIXES = (".txt", ".jsonl")
AUDIO_SUFFIXES = (".wav", ".flac")
HOLDOUT_SEED = 0x5EED   # the validation examples do not change with --seed: runs of any seed compare
DTYPE_NAMES = {"f32": "float32", "i32": "int32"}

# input name -> (shape of one example, dtype "f32" | "i32"): what a training graph takes
InputSpec = Mapping[str, tuple[tuple[int, ...], str]]


def files_of(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files directly in ``folder`` with one of ``suffixes``, by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)


def data_kind(path) -> str:
    """"arrays" (.npz, a folder of .npy), "text" (.txt/.jsonl or a folder of them) or
    "audio" (.wav/.flac or a folder of them; .txt files beside them are transcripts)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data {path}: no such file or folder")
    if path.is_file():
        suffix = path.suffix.lower()
        for kind, suffixes in (("arrays", (".npz",)), ("text", TEXT_SUFFIXES), ("audio", AUDIO_SUFFIXES)):
            if suffix in suffixes:
                return kind
        raise DataError(f"data {path}: not a data file this reads; give an .npz, a .txt or .jsonl file, or a folder "
                        f"of .npy, text or audio (.wav, .flac) files")
    for kind, suffixes in (("arrays", (".npy",)), ("audio", AUDIO_SUFFIXES), ("text", TEXT_SUFFIXES)):
        if files_of(path, suffixes):
            return kind
    raise DataError(f"data folder {path} holds no .npy, .txt, .jsonl, .wav or .flac files")


def read_arrays(path) -> dict[str, np.ndarray]:
    """The arrays of an .npz file, or of a folder's .npy files (each named by its stem)."""
    path = Path(path)
    files = [path] if path.is_file() else files_of(path, (".npy",))
    arrays = {}
    for file in files:
        try:
            loaded = np.load(file, allow_pickle=False)
            if isinstance(loaded, np.ndarray):
                arrays[file.stem] = loaded
            else:
                with loaded:
                    arrays.update({name: loaded[name] for name in loaded.files})
        except (OSError, ValueError, EOFError) as exc:
            raise DataError(f"data {file}: cannot read it as numpy data ({exc})") from None
    return arrays


def example_count(dataset: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(dataset.values()))) if dataset else 0


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def fit_arrays(arrays: Mapping[str, np.ndarray], spec: InputSpec, source) -> dict[str, np.ndarray]:
    """``arrays`` checked against ``spec`` and cast to its dtypes (arrays that are no input
    are dropped). One DataError names the first problem: missing inputs (all of them),
    a dtype or shape (expected against found), unequal or zero example counts."""
    missing = [name for name in spec if name not in arrays]
    if missing:
        wanted = ", ".join(f"{n} ({_shape_text(('N', *spec[n][0]))} {DTYPE_NAMES[spec[n][1]]})" for n in missing)
        held = ", ".join(sorted(arrays)) or "nothing"
        raise DataError(f"data {source}: no array for input(s) {wanted}; it holds {held}")
    out = {}
    for name, (shape, dtype) in spec.items():
        array = np.asarray(arrays[name])
        expected = _shape_text(("N", *shape))
        if array.ndim != len(shape) + 1 or tuple(array.shape[1:]) != tuple(shape):
            raise DataError(f"data {source}: input {name!r} has shape {_shape_text(array.shape)}, "
                            f"expected {expected} (N examples)")
        out[name] = _cast(array, dtype, name, source)
    counts = {name: len(a) for name, a in out.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{n} has {c}" for n, c in counts.items())
        raise DataError(f"data {source}: the arrays disagree on the number of examples ({listed})")
    if not out or example_count(out) == 0:
        raise DataError(f"data {source}: the dataset is empty (0 examples)")
    return out


def _cast(array: np.ndarray, dtype: str, name: str, source) -> np.ndarray:
    if dtype == "i32":
        if array.dtype.kind not in "iu":
            raise DataError(f"data {source}: input {name!r} has dtype {array.dtype}, expected integers (int32)")
        if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
            raise DataError(f"data {source}: input {name!r} holds values outside the int32 range")
        return np.ascontiguousarray(array, dtype=np.int32)
    if array.dtype.kind != "f":
        raise DataError(f"data {source}: input {name!r} has dtype {array.dtype}, expected floats (float32)")
    return np.ascontiguousarray(array, dtype=np.float32)


def take(dataset: Mapping[str, np.ndarray], rows) -> dict[str, np.ndarray]:
    return {k: v[rows] for k, v in dataset.items()}


def hold_out(dataset: Mapping[str, np.ndarray], fraction: float):
    """(training examples, validation examples or None): ``round(fraction * N)`` examples
    (at least one where fraction > 0 and N > 1) chosen by a fixed permutation, so the
    same ones whatever the seed; both parts keep the file's order."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"--val-fraction must be at least 0 and below 1, found {fraction}")
    n = example_count(dataset)
    count = max(1, round(fraction * n)) if fraction > 0 and n > 1 else 0
    if count == 0:
        return dict(dataset), None
    held = np.zeros(n, bool)
    held[np.random.default_rng(HOLDOUT_SEED).permutation(n)[:count]] = True
    return take(dataset, ~held), take(dataset, held)


def check_batch(dataset: Mapping[str, np.ndarray], batch: int, what: str) -> None:
    """A DataError unless ``dataset`` holds at least one full batch."""
    n = example_count(dataset)
    if n < batch:
        raise DataError(f"the {what} has {n} example{'s' if n != 1 else ''}, fewer than one batch of {batch}; "
                        f"lower the batch (--set batch=B) or give more data")
