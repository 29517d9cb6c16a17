"""Which builder makes the kernel of each op (``kernel_for``), and the paths a device's capabilities select.
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from ..graph.ops import OPS
from .attention import ATTENTION_BACKWARD, ATTENTION_KEYS, _cached_attention, attention_queries
from .attention_coop import attention_forward, coop_attention_supported, split_products
from .attention_coop_backward import attention_backward, coop_backward_supported
from .common import Capabilities, Kernel, PLAIN, UnsupportedOpError
from .convolution import _conv
from .copies import _cache_write, _copy, _embedding, _embedding_grad, _rope, _widen
from .matmul import _matmul, _norm_matmuls, _swiglu_matmul, product_reads_bf16
from .pointwise import POINTWISE_OPS, _pointwise
from .pooling import _conv_direct, _conv_direct_grad, _max_pool_grad, _pool
from .reduction import (_LOSS_ROWS, _LOSS_TERMS, _ROW_KERNELS, _ROW_MODES, _argmax, _loss, _row_kernel, _row_reduce,
                        _norm_param_grad, _row_dot, _sum_to, argmax_partials_slots)


# ---------------------------------------------------------------- dispatch table

_BUILDERS = {}
for _op in list(POINTWISE_OPS) + ["pointwise"]:
    _BUILDERS[_op] = _pointwise
for _op in ("matmul", "fused_matmul", "norm_matmul"):
    _BUILDERS[_op] = _matmul
_BUILDERS["norm_matmuls"] = _norm_matmuls
for _op in _ROW_MODES:
    _BUILDERS[_op] = _row_reduce
for _op in (*_LOSS_ROWS, *_LOSS_TERMS):
    _BUILDERS[_op] = _loss
_BUILDERS["sum_to"] = _sum_to
_BUILDERS["norm_param_grad"] = _norm_param_grad
_BUILDERS["row_dot"] = _row_dot
_BUILDERS["argmax"] = _argmax
for _op in ("transpose", "broadcast_to", "slice", "pad", "concat"):
    _BUILDERS[_op] = _copy
_BUILDERS["embedding"] = _embedding
_BUILDERS["widen"] = _widen
_BUILDERS["rope"] = _rope
_BUILDERS["conv1d"] = _BUILDERS["conv2d"] = _conv
_BUILDERS["attention"] = _BUILDERS["attention_stats"] = attention_forward
_BUILDERS["cached_attention"] = _cached_attention
_BUILDERS["cache_write"] = _cache_write
_BUILDERS["swiglu_matmul"] = _swiglu_matmul
for _op in ATTENTION_BACKWARD:
    _BUILDERS[_op] = attention_backward
for _op in _ROW_KERNELS:
    _BUILDERS[_op] = _row_kernel
_BUILDERS["embedding_grad"] = _embedding_grad
_BUILDERS["conv_input_grad"] = _BUILDERS["conv_weight_grad"] = _conv
_BUILDERS["conv_general"] = _conv_direct
_BUILDERS["max_pool"] = _BUILDERS["avg_pool"] = _pool
_BUILDERS["conv_general_input_grad"] = _BUILDERS["conv_general_weight_grad"] = _conv_direct_grad
_BUILDERS["max_pool_grad"] = _max_pool_grad


def supported_ops() -> list[str]:
    return sorted(_BUILDERS)


def unsupported_ops() -> list[str]:
    return sorted(n for n, d in OPS.items() if n not in _BUILDERS and d.archetype not in ("source", "view"))


def reads_bf16(graph: Graph, node: Node, index: int, caps: Capabilities = PLAIN) -> bool:
    """Whether ``node``'s kernel reads its operand ``index`` stored as bf16 (widening it as it
    loads): an embedding's table, a widen's operand, a product's weights
    (``product_reads_bf16``), a copy's operands into an f32 result. Any other reader of a
    bf16 weight reads it through a widen (engine.optimize.bf16_weights)."""
    builder = _BUILDERS.get(node.op)
    if builder in (_matmul, _norm_matmuls, _swiglu_matmul):
        return product_reads_bf16(node, index)
    if builder is _copy:
        return node.dtype == "f32"
    return node.op in ("embedding", "widen") and index == 0


def kernel_for(graph: Graph, node: Node, caps: Capabilities = PLAIN, sums: str = "") -> Kernel:
    """The kernel that runs ``node`` (one dispatch) on a device with ``caps``; ``sums``
    ("a" or "b", a plain product only): it also adds up that operand's rows (columns)
    where it can (``Kernel.sums`` says; engine/codegen/product_sums.py)."""
    builder = _BUILDERS.get(node.op)
    if builder is None:
        raise UnsupportedOpError(
            f"no GPU kernel for op {node.op!r} yet ({graph.format_node(node)}); "
            f"run it with the reference backend (--backend reference)")
    unread = [i for i, x in enumerate(node.inputs) if graph[x].dtype == "bf16" and not reads_bf16(graph, node, i, caps)]
    if unread:
        raise UnsupportedOpError(f"{graph.format_node(node)}: its kernel does not read operand {unread[0]} stored "
                                 f"as bf16; widen it first (engine.optimize.bf16_weights)")
    if node.op == "pointwise":
        for op, _, _ in node.attrs["program"]:
            if op not in POINTWISE_OPS:
                raise UnsupportedOpError(f"no GPU kernel for op {op!r} inside the pointwise program "
                                         f"of {graph.format_node(node)} yet")
    if sums:
        if node.op != "matmul":
            raise UnsupportedOpError(f"only a plain product adds up an operand, not {graph.format_node(node)}")
        return builder(graph, node, caps, sums=sums)
    return builder(graph, node, caps)


def product_combining(graph: Graph, product: Node, parts: int, head_dim: int,
                      caps: Capabilities = PLAIN) -> Kernel | None:
    """The kernel of ``product`` (a one-row matmul or fused_matmul whose A is a split cached
    attention's value) reading that attention's ``parts`` (of heads of ``head_dim``) in
    A's place and combining them itself, or None where it cannot (matmul's vector kernel)."""
    if product.op not in ("matmul", "fused_matmul") or product.attrs.get("transpose_a", False):
        return None
    return _matmul(graph, product, caps, parts=(parts, head_dim))


def product_with_argmax(graph: Graph, product: Node, caps: Capabilities = PLAIN) -> Kernel | None:
    """The kernel of ``product`` (a one-row matmul, fused_matmul or norm_matmul: a decode
    step's LM head) whose workgroups each also leave their columns' best value and its column,
    which ``reduction.argmax_of_partials`` then reduces in the argmax's place; None where it
    cannot (matmul's vector kernel, K whole). Its extra binding follows the output."""
    if product.op not in ("matmul", "fused_matmul", "norm_matmul") or product.attrs.get("transpose_a", False):
        return None
    kernel = _matmul(graph, product, caps, best=argmax_partials_slots(len(product.inputs) + 2))   # after out
    if kernel is not None:
        kernel.notes["variant"] += ", each workgroup's best value and its column left for the argmax"
    return kernel


def describe_paths(caps: Capabilities) -> dict:
    """Which path each archetype takes (``meganeura doctor`` and the plan show it)."""
    q = attention_queries(64, caps)
    return {"reductions": "subgroup" if caps.subgroups else "workgroup memory",
            "matmul": ("cooperative matrices: f16 operands (gradients scaled into f16's range), f32 "
                       "accumulation, for products of at least 16 x 16 x 16, their lean tiles where a "
                       f"workgroup runs K <= {caps.tuning.lean_k}; the rest register-blocked f32"
                       if caps.matmul_f16 else
                       "cooperative matrices: each f32 operand as two f16 parts (scaled into f16's range), three "
                       "products accumulating in f32, for products of at least 16 x 16 x 16; the rest "
                       "register-blocked f32"
                       if caps.matmul_split else
                       "register-blocked f32 (vec4 loads where the layout allows)"),
            "attention": ("flash on cooperative matrices ("
                          + ("q, k, v and P each as two f16 parts, three products"
                             if split_products(caps) else "f16 q, k, v and P")
                          + ", f32 scores and softmax) at head dims of whole fragments up to 128 (the backward's "
                          "up to 64; beyond, autodiff decomposes it); the backward's dq, dk, dv "
                          + (("on cooperative matrices too (every operand scaled into f16's range)" if split_products(caps)
                              else "on cooperative matrices too (dO and dS scaled into f16's range)")
                             if coop_backward_supported(64, caps) else "f32")
                          if coop_attention_supported(64, caps) else
                          f"flash, {q} queries x {ATTENTION_KEYS} keys a workgroup at head dim 64 "
                          f"({caps.workgroup_storage // 1024} KiB of workgroup memory)")}
