"""What an op is (``OpDef``: shape rule, numpy reference, gradient, kernel archetype), the table
``OPS`` that ``defop`` fills, tensor types, and the shape helpers every declaration shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


Shape = tuple[int, ...]

# Kernel archetypes (DESIGN.md): what kind of GPU kernel runs an op.
SOURCE = "source"          # inputs, parameters, constants: no kernel
POINTWISE = "pointwise"    # elementwise DAG, one thread per output element
REDUCTION = "reduction"    # row reduction with prologue/epilogue
MATMUL = "matmul"          # tiled matmul with fused prologue/epilogue
ATTENTION = "attention"    # attention with online softmax
CONV = "conv"              # convolution
GATHER = "gather"          # embedding lookup and its scatter-add gradient
VIEW = "view"              # reshape: same buffer, no kernel
COPY = "copy"              # data movement: transpose, concat, slice, broadcast

ARCHETYPES = (SOURCE, POINTWISE, REDUCTION, MATMUL, ATTENTION, CONV, GATHER, VIEW, COPY)


@dataclass(frozen=True)
class TensorType:
    shape: Shape
    dtype: str = "f32"


@dataclass
class OpDef:
    """Everything the engine knows about one op."""

    name: str
    archetype: str
    shape: Callable[[list[TensorType], dict], TensorType]
    ref: Callable[..., np.ndarray]
    grad: Callable | None = None
    elementwise: bool = False
    inplace: bool = False   # the result is operand 0 with some elements overwritten, in its storage
    doc: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)


OPS: dict[str, OpDef] = {}


def defop(name, archetype, shape_rule, ref, /, *, elementwise=False, inplace=False, doc="", **attrs) -> OpDef:
    """Declare an op; keyword arguments beyond ``elementwise``, ``inplace`` and ``doc`` are
    its attributes with their defaults."""
    if name in OPS:
        raise ValueError(f"op {name!r} declared twice")
    OPS[name] = OpDef(name, archetype, shape_rule, ref, elementwise=elementwise, inplace=inplace, doc=doc,
                      attrs=attrs)
    return OPS[name]


class OpShapeError(Exception):
    """Raised by a shape rule; the graph adds the op and node it was building."""


def _fail(msg: str):
    raise OpShapeError(msg)


def broadcast_shapes(*shapes: Shape) -> Shape:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        _fail("cannot broadcast shapes " + " and ".join(str(list(s)) for s in shapes))


def _require_float(ts: list[TensorType], what="operand"):
    """f32, or a weight stored as bf16 (which only kernels that widen it as they read see)."""
    for i, t in enumerate(ts):
        if t.dtype not in ("f32", "bf16"):
            _fail(f"{what} {i} must be f32, found {t.dtype}")


def _norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        _fail(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)
