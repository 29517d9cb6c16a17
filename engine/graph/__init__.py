"""The graph IR and everything it is defined by.

``ir`` (``Graph``, ``Node``: a DAG of ops with shapes checked as it is built), ``ops``
(the op table: every op's shape rule, numpy reference, archetype), ``reference`` (the
numpy executor, the oracle every other backend is checked against) and ``nn`` (the
Module API that models are written in). Imports nothing of the engine but
``engine.errors``.
"""

from .ir import Graph, Node
from .ops import OPS, OpDef, TensorType

__all__ = ["Graph", "Node", "OPS", "OpDef", "TensorType"]
