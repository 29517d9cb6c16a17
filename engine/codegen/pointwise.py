"""The pointwise archetype: a fused elementwise DAG, one thread per output element.

Values are f32 unless an operand, a cast or an op on integers makes them i32 (the
comparisons, ``where``, ``maximum``/``minimum``, ``cast`` and ``index_wrap`` take i32 operands);
masks are f32 0.0 / 1.0. The ONNX import ops' helpers (``shaders/pointwise_onnx.wgsl``)
are appended to a kernel whose program uses them, so other kernels keep their source.
"""

from __future__ import annotations

from ..graph.ir import Graph, Node
from .common import (Capabilities, Kernel, PLAIN, UnsupportedOpError, WG, _finish, _template, broadcast_strides,
                     f32_bits, grid_1d, i32_bits)


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
    # ONNX import ops (helpers in shaders/pointwise_onnx.wgsl)
    "erf": "erf_accurate_({0})",
    "softplus": "softplus_({0})",
    "floor": "floor({0})",
    "ceil": "ceil({0})",
    "sign": "sign_({0})",
    "logical_not": "select(0.0, 1.0, !truthy_({0}))",
    "power": "power_({0}, {1})",
    "equal": "select(0.0, 1.0, {0} == {1})",
    "less": "select(0.0, 1.0, {0} < {1})",
    "greater": "select(0.0, 1.0, {0} > {1})",
    "less_equal": "select(0.0, 1.0, {0} <= {1})",
    "greater_equal": "select(0.0, 1.0, {0} >= {1})",
    "where": "select({2}, {1}, truthy_({0}))",
}

# Ops whose expression _expr builds from attributes or operand types, beyond the table.
POINTWISE_SPECIAL = ("gelu", "gelu_grad", "pow", "leaky_relu", "maximum", "minimum", "cast", "index_wrap")
POINTWISE_OPS = tuple(POINTWISE_EXPR) + POINTWISE_SPECIAL

# The ops whose kernels need shaders/pointwise_onnx.wgsl.
_ONNX_HELPER_OPS = frozenset(("erf", "softplus", "sign", "logical_not", "power", "where", "leaky_relu",
                              "maximum", "minimum"))

# Result type of an instruction from its operands' types (f32 unless listed).
_MASK_OPS = frozenset(("equal", "less", "greater", "less_equal", "greater_equal", "logical_not"))


def _result_type(op: str, types: list[str], attrs: dict) -> str:
    if op in _MASK_OPS:
        return "f32"
    if op == "cast":
        return attrs.get("dtype", "f32")
    if op == "index_wrap":
        return "i32"
    if op == "where":
        return types[1]
    return types[0] if types else "f32"

ACTIVATION_EXPR = {"none": "x", "relu": "relu_(x)", "silu": "x * sigmoid_(x)",
                   "gelu": "gelu_(x)", "gelu_tanh": "gelu_tanh_(x)"}


def _expr(op: str, args: list[str], attrs: dict, consts: list, types: list[str] | None = None) -> str:
    """The WGSL expression of one instruction; appends the constants it reads to
    ``consts`` (floats, or ("i32", value) for an integer one)."""
    types = types or ["f32"] * len(args)
    if op in ("maximum", "minimum"):
        return f"{op[:3]}({args[0]}, {args[1]})" if types[0] == "i32" else f"{op}_({args[0]}, {args[1]})"
    if op == "cast":
        src, dst = types[0], attrs.get("dtype", "f32")
        return args[0] if src == dst else f"{dst}({args[0]})"   # i32(f32) truncates toward zero
    if op == "index_wrap":
        consts.append(("i32", int(attrs["size"])))
        return f"select({args[0]}, {args[0]} + c{len(consts) - 1}, {args[0]} < 0)"
    if op == "leaky_relu":
        consts.append(float(attrs["alpha"]))
        return f"leaky_relu_({args[0]}, c{len(consts) - 1})"
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


def _four_at_a_time(node: Node, operands, in_types: list[str], out_type: str) -> bool:
    """Whether a thread takes four elements as one vec4 from each operand (f32 operands of
    the output's shape, whose size is a multiple of 4): the program runs per lane. Scalar
    loads left the H100's memory at 58-70% of the vec4 copy's bandwidth (run 31)."""
    return (node.size % 4 == 0 and out_type == "f32" and all(t == "f32" for t in in_types)
            and all(x.shape == node.shape for x in operands))


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
    consts: list = []
    body = []
    in_types = ["i32" if x.dtype == "i32" else "f32" for x in operands]
    t_types: list[str] = []
    for j, (op, args, attrs) in enumerate(program):
        vals, types = [], []
        for kind, v in args:
            if kind == "in":
                vals.append(f"a{v}")
                types.append(in_types[v])
            elif kind == "t":
                vals.append(f"t{v}")
                types.append(t_types[v])
            else:
                consts.append(float(v))
                vals.append(f"c{len(consts) - 1}")
                types.append("f32")
        attrs = dict(attrs)
        t_types.append(_result_type(op, types, attrs))
        body.append(f"    let t{j}: {t_types[j]} = {_expr(op, vals, attrs, consts, types)};")
    out_type = "i32" if node.dtype == "i32" else "f32"
    if t_types[-1] != out_type:
        raise UnsupportedOpError(f"pointwise program of {graph.format_node(node)} computes {t_types[-1]}, "
                                 f"not its {out_type} output")
    cbase = len(meta)
    const_lines = [f"    let c{i} = mi({cbase + i}u);" if isinstance(c, tuple) else f"    let c{i} = mf({cbase + i}u);"
                   for i, c in enumerate(consts)]
    meta += [i32_bits(c[1]) if isinstance(c, tuple) else f32_bits(c) for c in consts]
    names = [f"in{k}" for k in range(len(operands))]
    result, grid = f"t{len(program) - 1}", grid_1d(-(-node.size // WG))
    four = _four_at_a_time(node, operands, in_types, out_type)
    if four:
        meta[0] = node.size // 4
        in_types, out_type, grid = ["vec4<f32>"] * len(operands), "vec4<f32>", grid_1d(-(-node.size // (4 * WG)))
        loads = [f"    let v{k} = in{k}[idx];" for k in range(len(operands))]
        body = ["    var r: vec4<f32>;"] + [
            "    {\n" + "\n".join("    " + line for line in
                                 [f"    let a{k} = v{k}.{c};" for k in range(len(operands))] + body)
            + f"\n        r.{c} = {result};\n    }}" for c in "xyzw"]
        off_lines, result = [], "r"
    kernel = _finish(f"pointwise:{node.op}", "pointwise", "pointwise.wgsl", names,
                     in_types, out_type, meta, grid,
                     RANK=rank, OFFSETS="\n".join(off_lines), LOADS="\n".join(const_lines + loads),
                     BODY="\n".join(body), RESULT=result)
    if four:
        kernel.notes["variant"] = "vec4"
    if any(op in _ONNX_HELPER_OPS for op, _, _ in program):
        kernel.source += "\n" + _template("pointwise_onnx.wgsl")
    return kernel
