"""The passes that follow ``optimize`` on the graph a session runs, in order, each with
what it did (the fusion report's last lines): one place for the training pipeline, the
inference pipeline and ``meganeura optimize`` to share."""

from __future__ import annotations

from ..graph.ir import Graph
from .attention_stats import share_attention_statistics
from .preactivation import reuse_preactivations
from .stacked_products import stack_products

TRAINING = (("attention_stats", share_attention_statistics), ("preactivation", reuse_preactivations),
            ("stacked_products", stack_products))
INFERENCE = (("stacked_products", stack_products),)


def run_passes(graph: Graph, passes=INFERENCE) -> tuple[Graph, dict[str, int]]:
    """``graph`` through ``passes`` (TRAINING after autodiff's ``optimize``, INFERENCE after
    a forward's); returns it and how many nodes each pass rewrote."""
    counts = {}
    for name, apply in passes:
        graph, counts[name] = apply(graph)
    return graph, counts
