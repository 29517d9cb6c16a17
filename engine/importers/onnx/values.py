"""Values during translation: ``Ctx`` (ONNX names to graph nodes or numpy constants), the graph helpers
the translations share (reshape, transpose, reduce, slice, gather) and numpy folding of constant subgraphs.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ...graph.ir import Graph
from .checks import Refused


# ---------------------------------------------------------------- values

class Ctx:
    """The state of one translation: the graph, ONNX value name -> node id or numpy constant,
    and which values are booleans (f32 masks)."""

    def __init__(self, g: Graph):
        self.g = g
        self.env: dict[str, Any] = {}
        self.bool: set[str] = set()
        self._const_nodes: dict[int, int] = {}

    def node(self, v) -> int:
        """A graph node for a value (constants become graph constants)."""
        if isinstance(v, np.ndarray):
            key = id(v)
            if key not in self._const_nodes:
                if v.dtype.kind in "iub":
                    if v.size and (v.min() < -2**31 or v.max() >= 2**31):
                        raise Refused(f"integer constant out of the int32 range: {v.min()}..{v.max()}")
                    arr = v.astype(np.int32)
                elif v.dtype.kind == "f":
                    arr = v.astype(np.float32)
                else:
                    raise Refused(f"constant of dtype {v.dtype}")
                self._const_nodes[key] = (self.g.constant(arr), v)[0]
                self._keep = getattr(self, "_keep", []) + [v]  # ids stay unique while we live
            return self._const_nodes[key]
        return v

    def shape(self, v) -> tuple[int, ...]:
        return tuple(v.shape) if isinstance(v, np.ndarray) else self.g.shape(v)

    def dtype(self, v) -> str:
        if isinstance(v, np.ndarray):
            return "i32" if v.dtype.kind in "iub" else "f32"
        return self.g[v].dtype


def _const(v, what: str) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise Refused(f"{what} must be a constant known at import (it depends on a graph input or parameter)")
    return v


def _ints(v, what) -> list[int]:
    return [int(n) for n in np.asarray(_const(v, what)).reshape(-1)]


def _axis(a: int, rank: int) -> int:
    if not -rank <= a < max(rank, 1):
        raise Refused(f"axis {a} out of range for rank {rank}")
    return a % max(rank, 1)


def _f32(ctx, v, what="operand"):
    if ctx.dtype(v) != "f32":
        raise Refused(f"{what} must be float32, found an integer tensor")
    return ctx.node(v)


# ---------------------------------------------------------------- graph helpers

def _reshape(ctx, v, shape):
    shape = tuple(int(n) for n in shape)
    if isinstance(v, np.ndarray):
        return v.reshape(shape)
    if ctx.shape(v) == shape:
        return v
    return ctx.g.reshape(v, shape)


def _transpose(ctx, v, perm):
    perm = tuple(int(p) for p in perm)
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v.transpose(perm))
    if perm == tuple(range(len(perm))):
        return v
    return ctx.g.transpose(v, perm)


def _reduce(ctx, x, axes, keepdims, op):
    """sum/mean/max over any axes: move them last, merge them, reduce the last axis."""
    g = ctx.g
    shape = ctx.shape(x)
    rank = len(shape)
    axes = sorted({_axis(a, rank) for a in axes}) if axes is not None else list(range(rank))
    keep = [i for i in range(rank) if i not in axes]
    if any(shape[a] == 0 for a in axes) or math.prod(shape) == 0:
        raise Refused("reduction over an empty tensor")
    out_shape = tuple(1 if i in axes else n for i, n in enumerate(shape)) if keepdims else \
        tuple(shape[i] for i in keep)
    if not axes:
        return x
    xn = _transpose(ctx, ctx.node(x), keep + axes)
    xn = _reshape(ctx, xn, [shape[i] for i in keep] + [math.prod(shape[a] for a in axes)])
    if op == "min":
        y = g.neg(g.apply("max", g.neg(xn), axis=-1))
    else:
        y = g.apply(op, xn, axis=-1)
    return _reshape(ctx, y, out_shape)


def _slice_axis(ctx, x, axis, start, stop, step):
    """x[start:stop:step] along one axis, ONNX clamping rules; step 1 is the slice op,
    other steps gather the picked indices."""
    n = ctx.shape(x)[axis]
    idx = range(*slice(start, stop, step).indices(n))
    if len(idx) == 0:
        raise Refused("slice is empty (zero-size tensors are not supported)")
    if isinstance(x, np.ndarray):
        return np.take(x, list(idx), axis=axis)
    if step == 1:
        if idx.start == 0 and idx.stop == n:
            return x
        return ctx.g.slice(x, axis, idx.start, idx.stop)
    return _gather(ctx, x, np.asarray(list(idx), dtype=np.int64), axis)


def _gather(ctx, data, indices, axis):
    g = ctx.g
    shape = ctx.shape(data)
    rank = len(shape)
    axis = _axis(axis, rank)
    n = shape[axis]
    if isinstance(data, np.ndarray) and isinstance(indices, np.ndarray):
        idx = indices.astype(np.int64)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise Refused(f"Gather indices out of range [-{n}, {n})")
        return np.take(data, idx, axis=axis)
    if ctx.dtype(data) != "f32":
        raise Refused("Gather on an integer tensor that depends on a graph input")
    if isinstance(indices, np.ndarray):
        idx = indices.astype(np.int64)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise Refused(f"Gather indices out of range [-{n}, {n})")
        idx = np.where(idx < 0, idx + n, idx)
        if idx.ndim == 0:  # one index: a slice without the axis
            y = g.slice(ctx.node(data), axis, int(idx), int(idx) + 1)
            return _reshape(ctx, y, shape[:axis] + shape[axis + 1:])
        ids = ctx.node(idx.astype(np.int32))
    else:
        ids = g.apply("index_wrap", ctx.node(indices), size=n)
    ind_shape = ctx.shape(indices)
    if math.prod(ind_shape) == 0:
        raise Refused("empty indices")
    rest = shape[:axis] + shape[axis + 1:]
    table = _transpose(ctx, ctx.node(data), [axis] + [i for i in range(rank) if i != axis])
    table = _reshape(ctx, table, (n, math.prod(rest)))
    y = g.embedding(table, ids)  # ind_shape + [prod(rest)]
    y = _reshape(ctx, y, ind_shape + rest)
    k = len(ind_shape)
    # ind dims first, then shape[:axis], then shape[axis+1:] -> shape[:axis] + ind + shape[axis+1:]
    perm = list(range(k, k + axis)) + list(range(k)) + list(range(k + axis, k + rank - 1))
    return _transpose(ctx, y, perm)


def _binary(ctx, op, a, b):
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return None
    return ctx.g.apply(op, _f32(ctx, a), _f32(ctx, b))


# ---------------------------------------------------------------- numpy folding
# Ops evaluated with numpy when every operand is a constant (shape arithmetic).

def _np_div(a, b):
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        if np.any(b == 0):
            raise Refused("integer division by zero")
        q = np.abs(a) // np.abs(b)
        return (np.sign(a) * np.sign(b) * q).astype(np.result_type(a, b))  # C-style truncation
    return (a / b).astype(np.result_type(a, b))


FOLD: dict[str, Callable] = {
    "Add": lambda a, b: (a + b).astype(np.result_type(a, b)),
    "Sub": lambda a, b: (a - b).astype(np.result_type(a, b)),
    "Mul": lambda a, b: (a * b).astype(np.result_type(a, b)),
    "Div": _np_div,
    "Neg": lambda a: -a,
    "Abs": np.abs,
    "Equal": np.equal, "Less": np.less, "Greater": np.greater,
    "LessOrEqual": np.less_equal, "GreaterOrEqual": np.greater_equal,
    "Not": np.logical_not, "And": np.logical_and, "Or": np.logical_or,
}
