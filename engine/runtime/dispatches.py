"""What each recorded dispatch is: its kernel, graph nodes, bytes moved and estimated
FLOPs (``session_dispatches``), for the profiler and the Studio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..codegen.training import norm_partials
from ..graph.modules import OPTIMIZER_STEP
from ..graph.ops import OPS, norm_matmuls_layout


# ---------------------------------------------------------------- dispatch descriptions

@dataclass
class DispatchInfo:
    """What one recorded dispatch runs (independent of timing)."""

    kernel: str
    archetype: str
    nodes: list[str]
    ops: list[str]
    shapes: dict
    workgroups: tuple
    bytes: int
    flops: int
    plan_index: int | None = None
    output_buffer: int | None = None
    module: str = ""            # the module its nodes came from ('' at the top level)


def _node_name(node) -> str:
    return node.name or f"%{node.id}"


# Matmul-shaped passes over the T x S scores of each attention op (2 flops per score and
# head dim each): the forward's q kᵀ and P v; lse's q kᵀ; dq's q kᵀ, dO vᵀ and dS k; dk and
# dv's q kᵀ, dO vᵀ, dSᵀ q and Pᵀ dO.
# A cached attention's visible keys change every step: it is counted as if all were (an upper bound).
ATTENTION_PASSES = {"attention": 2, "attention_stats": 2, "attention_lse": 1, "attention_grad_q": 3, "attention_grad_kv": 4,
                    "cached_attention": 2}


def estimate_flops(graph, node, passes: int | None = None) -> int:
    """Floating-point operations of one node: exact for matmuls (2·M·N·K plus the
    epilogue) and attention (its matmul-shaped passes plus the softmax; ``passes``: a
    kernel that only multiplies, as dq's product of dS and K), estimates elsewhere
    (pointwise: ops per element; reductions: a few per input element; data movement: 0)."""
    ins = [graph[i] for i in node.inputs]
    op, a, size = node.op, node.attrs, node.size
    arch = OPS[node.op].archetype
    if arch == "matmul":
        x = ins[0]
        if op in ("norm_matmul", "norm_matmuls"):
            k = x.shape[-1]
            products = size if op == "norm_matmul" else sum(
                math.prod(s) for s in norm_matmuls_layout(x.shape, [w.shape for w in ins[2:]], a["transpose_b"])[0])
            return 2 * products * k + 4 * x.size
        k = x.shape[-2] if a.get("transpose_a") else x.shape[-1]
        extra = size * (int(a.get("has_add", False)) + int(a.get("has_residual", False))
                        + int(a.get("activation", "none") != "none") + int(a.get("gradient_of", "none") != "none"))
        return 2 * size * k + extra
    if arch == "attention":
        q, kk = ins[0], ins[1]
        b, s, w = q.shape
        t = kk.shape[1]
        h = a.get("num_heads", 1)
        pairs = b * h * s * t
        if a.get("causal"):
            pairs //= 2
        return 2 * (passes or ATTENTION_PASSES[op]) * pairs * (w // h) + (0 if passes else 5 * pairs)
    if arch == "conv":
        # Each of the three is the same implicit GEMM: 2 flops for every element of the
        # forward's output (dout for the gradients) times every weight of one filter.
        if op in ("conv1d", "conv2d"):
            return 2 * size * math.prod(ins[1].shape[1:]) + (size if len(ins) > 2 else 0)
        if op == "conv_input_grad":   # (dout, w)
            return 2 * ins[0].size * math.prod(ins[1].shape[1:])
        return 2 * ins[1].size * math.prod(node.shape[1:])   # conv_weight_grad (x, dout) -> w
    if arch == "pointwise":
        prog = a.get("program") or a.get("ops") or a.get("body")
        per = len(prog) if isinstance(prog, (list, tuple)) and prog else 1
        if op in ("gelu", "silu", "sigmoid", "tanh", "exp", "log", "swiglu", "rope"):
            per = max(per, 4)
        return per * size
    if arch == "reduction":
        per = {"softmax": 5, "log_softmax": 5, "layer_norm": 8, "rms_norm": 6, "group_norm": 8,
               "cross_entropy": 5, "soft_cross_entropy": 5, "cross_entropy_grad": 5}.get(op, 1)
        return per * max((t.size for t in ins), default=size)
    return 0


def session_dispatches(session) -> list[DispatchInfo]:
    """One ``DispatchInfo`` per dispatch the session records in a step, in order."""
    custom = getattr(session, "profile_dispatches", None)
    if callable(custom):
        return list(custom())
    plan = session.plan
    return [_graph_dispatch(session.graph, plan.dispatches[j]) if plan.dispatches[j].nodes
            else _step_dispatch(plan, plan.dispatches[j]) for j in session.step_dispatches]


def _graph_dispatch(graph, d) -> DispatchInfo:
    """A dispatch running graph nodes: bytes of its operands and outputs, estimated FLOPs.
    The second stage of a two-dispatch node (``:total``: a loss's total, split attention's
    combine, a split-K matmul's sum and epilogue) reads the first stage's partials (and
    the epilogue's operands) and does about one FLOP for each partial."""
    nodes = [graph[n] for n in d.nodes]
    ins = [graph[i] for i in dict.fromkeys(i for n in nodes for i in n.inputs)]   # a tensor two nodes read, once
    nbytes = sum(t.nbytes for t in ins) + sum(n.nbytes for n in nodes)
    flops = sum(estimate_flops(graph, n) for n in nodes)
    if d.archetype == "attention" and not d.kernel.endswith(":total"):
        nbytes = sum(b.size for b in d.bindings)   # with the dS that dkdv writes and dq reads (plan._dq_from_scores)
        if [n.op for n in nodes] == ["attention_grad_q"] and len(d.bindings) == 3:   # dq as the product dS K
            flops = estimate_flops(graph, nodes[0], passes=1)
    if [n.op for n in nodes] == ["argmax"]:   # its row, or the LM head's workgroups' best (decode_folds)
        nbytes = sum(b.size for b in d.bindings)
    if d.kernel.endswith(":total"):
        partial_bytes = d.bindings[0].size
        nbytes = sum(b.size for b in d.bindings[:-1]) + sum(n.nbytes for n in nodes)
        flops = partial_bytes // 4
    return DispatchInfo(
        kernel=d.name, archetype=d.archetype,
        nodes=[_node_name(n) for n in nodes], ops=[n.op for n in nodes],
        shapes={"inputs": [list(t.shape) for t in ins], "output": [list(n.shape) for n in nodes]},
        workgroups=tuple(int(w) for w in d.workgroups), bytes=int(nbytes), flops=int(flops),
        plan_index=d.index, output_buffer=d.writes[0] if d.writes else None, module=d.module)


# FLOPs per element of the optimizer step's kernels (the update's by rule).
_UPDATE_FLOPS = {"sgd": 2, "adam": 14, "adamw": 16}


def _step_dispatch(plan, d) -> DispatchInfo:
    """A dispatch of the optimizer step (a gradient copy, a norm partial sum, the norm's
    total, a group's update), named by the tensors it covers: bytes read and written
    over its elements, FLOPs per element of its rule."""
    n = d.elements
    role = d.kernel.split(":", 1)[1]
    if role == "norm_total":   # n partials, two floats each (scale, scaled sum of squares)
        nbytes, flops = 8 * n + 4, 3 * n
    elif role == "sum_squares":  # two passes over the gradient (its max, then the scaled squares)
        nbytes, flops = 8 * n + 8 * norm_partials(n), 3 * n
    elif role == "gradient":  # copy:gradient
        nbytes, flops = 8 * n, 0
    else:
        states = len(plan.groups[d.group].state_buffers)
        momentum = role == "sgd" and bool((plan.optimizer or {}).get("momentum"))
        nbytes = 4 * n * (3 + 2 * states)  # gradient; parameter and each state read and written
        flops = (_UPDATE_FLOPS.get(role, 4) + 2 * momentum) * n
    return DispatchInfo(
        kernel=d.kernel, archetype=d.archetype, nodes=list(d.names), ops=[role],
        shapes={"inputs": [[n]], "output": [[n]]}, workgroups=tuple(int(w) for w in d.workgroups),
        bytes=int(nbytes), flops=int(flops), plan_index=d.index,
        output_buffer=d.writes[0] if d.writes else None, module=OPTIMIZER_STEP)
