"""The reference executor: runs any graph in numpy, in float32 or float64.

It is the oracle of the project: fusion must not change its outputs, gradients must
match its finite differences, and the GPU must match it.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..arrays import bf16_exact
from ..errors import GraphError, InputError, ShapeError
from .inputs import INT32_RANGE, beyond_int32, listed
from .ir import Graph
from .ops import OPS


def check_array(kind: str, name: str, arr, node, float_dtype=np.float32, copy: bool = True) -> np.ndarray:
    """``arr`` as the value of a graph input or parameter ``node``: its shape, and integers for
    an i32 node (as int32), else floats of ``float_dtype`` (bf16 values for a bf16 node: a tensor
    stored in bf16 is kept exactly or not at all); ShapeError otherwise. A copy in row order,
    so that numpy's sums run in one order whatever the layout it came in (a checkpoint's
    transposed views: ``engine.weights.bind_weights``); ``copy=False``: ``arr`` itself where
    it already has the dtype (an upload only reads it)."""
    arr = np.asarray(arr)
    if tuple(arr.shape) != node.shape:
        raise ShapeError(f"{kind} {name!r}: expected shape {list(node.shape)}, found {list(arr.shape)}")
    if node.dtype == "i32":
        if not np.issubdtype(arr.dtype, np.integer):
            raise ShapeError(f"{kind} {name!r}: expected integers (i32), found {arr.dtype}")
        _require_int32(kind, name, arr)
        dtype = np.int32
    elif node.dtype == "bf16" and not bf16_exact(arr):
        raise ShapeError(f"{kind} {name!r} is stored as bf16, but its values are not all bf16 values")
    else:
        dtype = float_dtype
    return np.array(arr, dtype, order="C") if copy else arr.astype(dtype, copy=False)


def _require_int32(kind: str, name: str, arr: np.ndarray) -> None:
    """Integers beyond int32 are refused: the cast to an i32 buffer would wrap them
    (2**40 would read row 0) without a word."""
    wide = beyond_int32(arr)
    if wide.size:
        raise InputError(f"{kind} {name!r} holds {listed(wide)}, {INT32_RANGE}")


def evaluate(graph: Graph, inputs: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray],
             dtype=np.float32, keep: str = "outputs") -> dict[int, np.ndarray]:
    """Run every live node; return the values of all nodes (keep='all') or only those
    the outputs need (keep='outputs')."""
    float_dtype = np.dtype(dtype)
    missing = [n for n in graph.inputs if n not in inputs]
    missing += [n for n in graph.parameters if n not in params]
    if missing:
        raise GraphError(f"graph {graph.name!r}: no value given for {', '.join(sorted(missing))}")
    live = graph.live_nodes() if keep == "outputs" else set(range(len(graph)))
    values: dict[int, np.ndarray] = {}
    for name, i in graph.inputs.items():
        values[i] = check_array("input", name, inputs[name], graph[i], float_dtype)
    for name, i in graph.parameters.items():
        values[i] = check_array("parameter", name, params[name], graph[i], float_dtype)
    for i, c in graph.constants.items():
        values[i] = c.astype(float_dtype) if c.dtype.kind == "f" else c
    with np.errstate(all="ignore"):   # IEEE results, as the GPU gives; a NaN loss is the trainer's to name
        for node in graph.nodes:
            if node.id in values or node.id not in live:
                continue
            args = [values[i] for i in node.inputs]
            out = np.asarray(OPS[node.op].ref(*args, **node.attrs))
            if node.dtype == "f32":
                out = out.astype(float_dtype, copy=False)
            if out.shape != node.shape:
                raise AssertionError(f"{graph.format_node(node)}: reference produced shape {list(out.shape)}")
            values[node.id] = out
    return values


def run(graph: Graph, inputs: Mapping[str, np.ndarray], params: Mapping[str, np.ndarray],
        dtype=np.float32) -> dict[str, np.ndarray]:
    """The graph's named outputs."""
    values = evaluate(graph, inputs, params, dtype)
    return {name: values[i] for name, i in graph.outputs.items()}
