"""Text for causal language models: documents from ``.txt`` files (a file is a
document) and ``.jsonl`` files (a line's ``"text"`` field is one), then one stream of
token ids cut into training windows.

``token_windows`` cuts the stream into windows of ``width`` ids that overlap by one id,
so that every id but the first is a prediction target exactly once (a model whose
targets are its tokens shifted by one takes width = seq + 1; one that shifts inside
takes width = seq); the last window is padded, its padding marked not valid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..errors import DataError
from .datasets import TEXT_SUFFIXES, files_of


def read_documents(path) -> list[str]:
    """The non-empty documents of a .txt/.jsonl file or of a folder's such files, in name order."""
    path = Path(path)
    files = [path] if path.is_file() else files_of(path, TEXT_SUFFIXES)
    documents: list[str] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"data {file}: not UTF-8 text (byte {exc.start} cannot be decoded)") from None
        except OSError as exc:
            raise DataError(f"data {file}: cannot read it ({exc.strerror or exc})") from None
        documents += _jsonl_texts(file, text) if file.suffix.lower() == ".jsonl" else [text]
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise DataError(f"data {path}: the dataset is empty (no text)")
    return documents


def _jsonl_texts(file: Path, text: str) -> list[str]:
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise DataError(f"data {file}, line {number}: not JSON ({exc})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"data {file}, line {number}: no \"text\" field holding a string")
        out.append(record["text"])
    return out


def token_stream(documents: Iterable[str], encode, vocab: int) -> np.ndarray:
    """The documents encoded one after the other, each id checked against the vocabulary."""
    ids = np.asarray([i for doc in documents for i in encode(doc)], dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.size:
        raise DataError(f"the tokenizer gave id {int(bad[0])}, outside the model's vocabulary [0, {vocab}); "
                        f"use the tokenizer.json of this checkpoint")
    return ids


def token_windows(ids: Sequence[int], width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows [n, width] int32, valid [n, width] bool): window k starts at id
    k * (width - 1); the last is padded with ``pad`` (not valid)."""
    ids = np.asarray(ids, dtype=np.int64)
    if width < 2:
        raise DataError(f"text windows need at least 2 tokens, found {width}; raise --set seq")
    if len(ids) < 2:
        raise DataError(f"the text gives {len(ids)} token{'s' if len(ids) != 1 else ''}; "
                        f"training needs at least 2 (a token and the next)")
    stride = width - 1
    count = -(-(len(ids) - 1) // stride)
    length = count * stride + 1
    stream = np.full(length, pad, np.int64)
    stream[:len(ids)] = ids
    valid = np.zeros(length, bool)
    valid[:len(ids)] = True
    view = np.lib.stride_tricks.sliding_window_view
    return (view(stream, width)[::stride][:count].astype(np.int32),
            view(valid, width)[::stride][:count].copy())
