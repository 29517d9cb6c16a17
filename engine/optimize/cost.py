"""The cost model: bytes moved through device memory.

Every kernel reads each of its distinct operands once and writes its result once, so a
node costs ``sum(operand bytes) + result bytes``. Views (reshape) and sources move
nothing. Fusing two kernels therefore saves exactly the write and the re-read of the
intermediate they used to exchange, which is what the extractor minimises.
"""

from __future__ import annotations

import math

from ..graph.ops import OPS, SOURCE, VIEW

ELEMENT_BYTES = 4


def tensor_bytes(shape) -> int:
    return ELEMENT_BYTES * math.prod(shape)


def is_dispatch(op: str) -> bool:
    """Whether the op runs a kernel of its own (sources and views do not)."""
    return OPS[op].archetype not in (SOURCE, VIEW)


def node_bytes(op: str, operand_shapes, out_shape, operand_ids=None) -> int:
    """Bytes one node moves; operands given twice (x * x) are read once."""
    if not is_dispatch(op):
        return 0
    shapes = list(operand_shapes)
    if operand_ids is not None:
        shapes = list({i: s for i, s in zip(operand_ids, operand_shapes)}.values())
    return sum(tensor_bytes(s) for s in shapes) + tensor_bytes(out_shape)


def graph_node_bytes(graph, node) -> int:
    return node_bytes(node.op, [graph[i].shape for i in node.inputs], node.shape, node.inputs)


def graph_cost(graph) -> tuple[int, int]:
    """(bytes moved, dispatches) of the nodes the outputs need."""
    live = graph.live_nodes()
    nodes = [graph[i] for i in sorted(live)]
    return (sum(graph_node_bytes(graph, n) for n in nodes), sum(is_dispatch(n.op) for n in nodes))
