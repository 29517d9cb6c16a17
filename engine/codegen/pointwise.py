"""The pointwise archetype: a fused elementwise DAG, one thread per output element.
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from .common import Capabilities, Kernel, PLAIN, UnsupportedOpError, WG, _finish, broadcast_strides, f32_bits, grid_1d


# ---------------------------------------------------------------- pointwise

# One WGSL expression per elementwise op; {0}, {1} are the operands.
POINTWISE_EXPR = {
    "neg": "(-{0})",
    "exp": "exp({0})",
    "log": "log({0})",
    "sqrt": "sqrt({0})",
    "rsqrt": "(1.0 / sqrt({0}))",
    "reciprocal": "(1.0 / {0})",
    "abs": "abs({0})",
    "relu": "relu_({0})",  # keeps NaN, as numpy and torch do
    "sigmoid": "sigmoid_({0})",
    "tanh": "tanh_({0})",
    "silu": "({0} * sigmoid_({0}))",
    "stop_gradient": "{0}",
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "bias_add": "({0} + {1})",
    "swiglu": "({0} * sigmoid_({0}) * {1})",
    "relu_grad": "select(0.0, {0}, {1} > 0.0)",
    "abs_grad": "({0} * sign({1}))",
}

ACTIVATION_EXPR = {"none": "x", "relu": "relu_(x)", "silu": "x * sigmoid_(x)",
                   "gelu": "gelu_(x)", "gelu_tanh": "gelu_tanh_(x)"}


def _expr(op: str, args: list[str], attrs: dict, consts: list[float]) -> str:
    if op in ("gelu", "gelu_grad"):
        fn = op.replace("gelu", "gelu_tanh" if attrs.get("approximate") == "tanh" else "gelu")
        return f"{fn}_({', '.join(args)})"
    if op == "pow":
        e = float(attrs["exponent"])
        if e == 1.0:
            return args[0]
        if e == 2.0:
            return f"({args[0]} * {args[0]})"
        consts.append(e)
        c = f"c{len(consts) - 1}"
        if e == int(e):
            return f"pow_int_({args[0]}, {c})"
        return f"pow({args[0]}, {c})"
    if op not in POINTWISE_EXPR:
        raise UnsupportedOpError(f"no GPU kernel for op {op!r} inside a pointwise program yet")
    return POINTWISE_EXPR[op].format(*args)


def _pointwise(graph: Graph, node: Node, caps: Capabilities = PLAIN) -> Kernel:
    if node.op == "pointwise":
        program = node.attrs["program"]
    else:
        attrs = tuple((k, v) for k, v in node.attrs.items())
        program = ((node.op, tuple(("in", i) for i in range(len(node.inputs))), attrs),)
    out_shape = node.shape
    rank = len(out_shape)
    operands = [graph[i] for i in node.inputs]
    meta = [node.size] + list(out_shape)
    offsets, loads = [], []
    need_coords = False
    for k, x in enumerate(operands):
        if x.shape == out_shape:
            loads.append(f"    let a{k} = in{k}[idx];")
            meta += [0] * rank
        else:
            need_coords = True
            meta += broadcast_strides(x.shape, out_shape)
            offsets.append(k)
            loads.append(f"    let a{k} = in{k}[o{k}];")
    off_lines = []
    if need_coords:
        off_lines += [f"    var o{k} = 0u;" for k in offsets]
        off_lines.append("    var rem = idx;")
        off_lines.append("    for (var d = i32(RANK) - 1; d >= 0; d = d - 1) {")
        off_lines.append("        let n = m(1u + u32(d));")
        off_lines.append("        let c = rem % n;")
        off_lines.append("        rem = rem / n;")
        for k in offsets:
            off_lines.append(f"        o{k} = o{k} + c * m({1 + rank * (k + 1)}u + u32(d));")
        off_lines.append("    }")
    consts: list[float] = []
    body = []
    for j, (op, args, attrs) in enumerate(program):
        vals = []
        for kind, v in args:
            if kind == "in":
                vals.append(f"a{v}")
            elif kind == "t":
                vals.append(f"t{v}")
            else:
                consts.append(float(v))
                vals.append(f"c{len(consts) - 1}")
        body.append(f"    let t{j}: f32 = {_expr(op, vals, dict(attrs), consts)};")
    cbase = len(meta)
    const_lines = [f"    let c{i} = mf({cbase + i}u);" for i in range(len(consts))]
    meta += [f32_bits(c) for c in consts]
    names = [f"in{k}" for k in range(len(operands))]
    return _finish(f"pointwise:{node.op}", "pointwise", "pointwise.wgsl", names,
                   ["f32"] * len(operands), "f32", meta, grid_1d(-(-node.size // WG)),
                   RANK=rank, OFFSETS="\n".join(off_lines), LOADS="\n".join(const_lines + loads),
                   BODY="\n".join(body), RESULT=f"t{len(program) - 1}")
