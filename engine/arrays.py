"""A checkpoint's arrays on the host, on all of its cores: widening bf16 as it is read,
checking and taking bf16 bits, copying into row order for an upload.

A 1B-parameter checkpoint is 5 GB of float32 on the host; each pass over it takes about
a second on one core. numpy lets go of the GIL as it copies, shifts and reduces, so the
passes here go over blocks of rows on a thread each. A bf16 value is the upper half of a
float32's bits, so its checks and its bits read the float32's halves in place.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
from typing import Callable

import numpy as np

PARALLEL_ELEMENTS = 1 << 20   # elements from which a pass goes over blocks of rows on several threads


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads of the passes, made once (a checkpoint's 150 tensors each made their own)."""
    return concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="arrays")


def in_row_blocks(array: np.ndarray, work: Callable[[object], object]) -> list:
    """``work(rows)`` for blocks of ``array``'s first axis (``rows`` a slice), on the host's
    cores where the array is large, else once (``rows`` then ``...``, all of it); the
    results in order of their blocks."""
    cores = os.cpu_count() or 1
    if array.ndim == 0 or array.size < PARALLEL_ELEMENTS or cores == 1 or array.shape[0] == 1:
        return [work(...)]
    rows = array.shape[0]
    step = max(1, -(-rows // (4 * cores)))
    return list(_pool().map(lambda r: work(slice(r, r + step)), range(0, rows, step)))


def contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` in row order: as it is where it is, else copied (a transpose's copy gathers
    across rows: a 2048 x 8192 weight's bf16 bits took 0.11 s on one core)."""
    if array.flags.c_contiguous or array.ndim == 0:
        return np.ascontiguousarray(array)
    out = np.empty(array.shape, array.dtype)
    in_row_blocks(array, lambda rows: np.copyto(out[rows], array[rows]))
    return out


def widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as the float32 values they are."""
    out = np.empty(bits.shape, np.uint32)
    in_row_blocks(bits, lambda rows: np.left_shift(bits[rows], 16, out=out[rows], dtype=np.uint32))
    return out.view(np.float32)


def _float_halves(arr) -> np.ndarray:
    """``arr`` as float32, each value's two 16-bit halves along a new last axis (a view,
    whatever the layout): [..., 0] the lower, [..., 1] the upper."""
    halves = np.asarray(arr, np.float32)[..., None].view(np.uint16)
    return halves if sys.byteorder == "little" else halves[..., ::-1]


def bf16_exact(arr) -> bool:
    """Whether every value of ``arr`` is a bf16 value (as a checkpoint stored in bf16 gives,
    widened): the lower 16 bits of each float32 are zero. Read in place."""
    lower = _float_halves(arr)[..., 0]
    return not any(in_row_blocks(lower, lambda rows: lower[rows].any()))


def bf16_bits(arr) -> np.ndarray:
    """The bf16 bit patterns (uint16) of bf16 values held as float32 (``bf16_exact``): a view
    of their upper halves in ``arr``'s layout, so that ``contiguous`` moves half the bytes
    where ``arr`` is a transpose."""
    return _float_halves(arr)[..., 1]
