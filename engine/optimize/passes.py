"""The passes that follow ``optimize`` on the graph a session runs, in order, each with
what it did: one place for the training pipeline, the inference pipeline, ``meganeura
optimize`` and the Studio to share. Given the ``OptimizeReport`` of the graph they start
from, they extend it, so that the fusion report and its node ids describe the graph
that runs, not the e-graph's result before them."""

from __future__ import annotations

from collections import Counter

from ..graph.ir import Graph
from ..graph.ops import OPS, SOURCE
from . import cost
from .activation_grad import fold_activation_gradients
from .attention_stats import share_attention_statistics
from .conv_activation import fold_conv_activations
from .norm_residual import fold_residual_gradients
from .preactivation import reuse_preactivations
from .report import OptimizeReport, where
from .schedule import outputs_early
from .stacked_products import stack_products

TRAINING = (("attention_stats", share_attention_statistics), ("preactivation", reuse_preactivations),
            ("norm_residual", fold_residual_gradients), ("stacked_products", stack_products),
            ("activation_grad", fold_activation_gradients), ("outputs_early", outputs_early))
INFERENCE = (("stacked_products", stack_products), ("conv_activation", fold_conv_activations))
WHY = {   # what each pass buys, where the cost model's bytes and dispatches do not show it
    "attention_stats": "the attention forward also writes the log-sum-exp its backward needs, "
                       "instead of a second kernel computing the scores again",
    "preactivation": "a product the backward needs without its activation is computed once, "
                     "and the activation applied to it pointwise",
    "stacked_products": "products of one input by weights of one shape (q, k, v) run as one batched "
                        "product, which keeps more of the GPU busy; the backward adds their input "
                        "gradients in one product and makes their weights' gradients in one",
    "norm_residual": "a norm's input gradient and the gradient along the residual are added as the "
                     "norm's backward kernel writes its result, not by a pass of their own",
    "activation_grad": "an activation's gradient is applied by the product computing the gradient that "
                       "arrives at it, as it writes its result, not by a pass of its own",
    "conv_activation": "a convolution's activation is applied as its kernel writes the result, "
                       "not by a pass of its own over it",
    "outputs_early": "nodes that only lead to outputs (weight and bias gradients) run as soon as "
                     "their operands are ready, so the tensors they read are freed sooner",
}


def run_passes(graph: Graph, passes=INFERENCE, report: OptimizeReport | None = None) -> tuple[Graph, dict[str, int]]:
    """``graph`` through ``passes`` (TRAINING after autodiff's ``optimize``, INFERENCE after
    a forward's); returns it and how many nodes each pass rewrote. ``report``, the one
    ``optimize`` gave for ``graph``, is brought up to date with the result."""
    counts = {}
    for name, apply in passes:
        before = graph
        graph, counts[name], remap = apply(graph)
        if report is not None and counts[name]:
            _account(report, name, before, graph, remap)
    if report is not None:
        report.passes = {**report.passes, **counts}
        report.nodes_after = len(graph)
        report.bytes_after, report.dispatches_after = cost.graph_cost(graph)
    return graph, counts


def optimize_inference(graph: Graph) -> tuple[Graph, OptimizeReport]:
    """A forward graph as an inference session runs it: ``optimize``, then the INFERENCE
    passes, with the report describing the result."""
    from . import optimize
    out, report = optimize(graph)
    out, _ = run_passes(out, INFERENCE, report)
    return out, report


def optimize_generation(graph: Graph) -> tuple[Graph, OptimizeReport, dict[str, int]]:
    """A generation graph (a prefill or a decode step) as its session runs it: ``optimize``,
    the few-row fusions of a decode step (``few_rows``), then the INFERENCE passes (a
    prefill's stacked products); returns it, the report of ``optimize`` and {fusion: count}."""
    from . import optimize
    from .few_rows import fuse_few_rows
    out, report = optimize(graph)
    out, few = fuse_few_rows(out)
    out, _ = run_passes(out, INFERENCE)
    return out, report, few


def _account(report: OptimizeReport, name: str, before: Graph, after: Graph, remap: dict[int, int]) -> None:
    """``report``'s node ids moved from ``before`` to ``after``, and a row for pass ``name``:
    the nodes it made (those that are not plain copies), where they sit, what it saved."""
    copies, preimages = set(), {}
    for old in before.nodes:
        new = remap.get(old.id)
        if new is None:
            continue
        preimages.setdefault(new, []).append(old.id)
        n = after[new]
        if (n.op, n.attrs, n.inputs) == (old.op, old.attrs, tuple(remap.get(i) for i in old.inputs)):
            copies.add(new)
    origins = {new: sorted({o for old in olds for o in report.origins.get(old, ())})
               for new, olds in preimages.items()}
    consumers = after.users()
    for n in reversed(after.nodes):   # a node no old one maps to stands for what its consumers stand for
        if n.id not in origins:
            origins[n.id] = sorted({o for c in consumers[n.id] for o in origins.get(c, ())})
    report.origins = {k: v for k, v in sorted(origins.items()) if v}
    report.rule_nodes = {rule: sorted({remap[i] for i in ids if i in remap})
                         for rule, ids in report.rule_nodes.items()}
    made = [n.id for n in after.nodes if n.id not in copies and OPS[n.op].archetype != SOURCE]
    report.rule_nodes[name] = made
    report.rule_modules[name] = dict(Counter(where(after[i]) for i in made))
    (bytes_before, dispatches_before), (bytes_after, dispatches_after) = cost.graph_cost(before), cost.graph_cost(after)
    report.rule_bytes_saved[name] = bytes_before - bytes_after
    report.pass_dispatches_saved[name] = dispatches_before - dispatches_after
