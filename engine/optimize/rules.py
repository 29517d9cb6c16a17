"""Every rewrite rule of the optimizer, in one place, written with egglog's Python API.

The graph enters egglog as *facts* about node ids (relations ``N*`` below, loaded in
bulk from tab-separated files) and one ``build`` ruleset turns each fact into a term
``T.ref(id) == T.<op>(T.ref(input), ...)``. Every graph node is therefore bound to a
shallow term: no expression is ever deeper than one op, whatever the graph's depth.

Facts egglog cannot know by itself come from the graph's shapes, computed in Python:
``uses`` (how many distinct nodes read a tensor, outputs counting as readers),
``shape_of``, ``last_dim``, ``rows``, ``vec_len``, ``HeadSplit``/``HeadMerge`` (reshapes that
split or merge attention heads), ``PermCompose``/``IdentityPerm`` and ``CausalMask``.
A fusion rule only fires when each intermediate it swallows has exactly the readers
inside the pattern (``uses(x) == i64(1)``): fusing a tensor that is read elsewhere would
compute it twice or keep it alive anyway.

Each entry of ``RULES`` is one named rule (its own ruleset, possibly several variants).
The two rules that are not egglog rewrites say so: ``cse`` is egglog's hash-consing (and
a Python pass that counts the merges), ``pointwise_dag`` is a graph pass run after
extraction (grouping elementwise DAGs is a partition problem, not a local rewrite).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from egglog import (Expr, f64, f64Like, function, i64, i64Like, relation, rule,
                    ruleset, eq, union, set_, var, vars_)

# ---------------------------------------------------------------- codes carried in terms

ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}
UNARY = {"relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4, "neg": 10, "exp": 11, "log": 12, "sqrt": 13,
         "rsqrt": 14, "reciprocal": 15, "abs": 16, "sigmoid": 17, "tanh": 18}
BINARY = {"add": 0, "sub": 1, "mul": 2, "div": 3}
REDUCE = {"sum": 0, "mean": 1, "max": 2}
AXIS_LAST, AXIS_ALL = 1, 0

RELU, GELU, GELU_TANH, SILU = 1, 2, 3, 4
NEG, EXP, LOG, SQRT, RSQRT, SIGMOID = 10, 11, 12, 13, 14, 17
ADD, SUB, MUL, DIV = 0, 1, 2, 3
SUM, MEAN, MAX = 0, 1, 2


def perm_code(perm) -> int:
    """A permutation as one integer (4 bits per axis, rank in the top bits)."""
    code = len(perm)
    for p in perm:
        code = code * 16 + int(p)
    return code


P0213 = perm_code((0, 2, 1, 3))


class T(Expr):
    """A tensor-valued term. ``ref(i)`` names graph node ``i``; the others are ops."""

    @classmethod
    def ref(cls, node: i64Like) -> T: ...
    @classmethod
    def leaf(cls, node: i64Like) -> T: ...
    @classmethod
    def absent(cls) -> T: ...
    @classmethod
    def scalar(cls, value: f64Like) -> T: ...
    @classmethod
    def unary(cls, code: i64Like, x: T) -> T: ...
    @classmethod
    def binary(cls, code: i64Like, x: T, y: T) -> T: ...
    @classmethod
    def bias_add(cls, x: T, b: T) -> T: ...
    @classmethod
    def pow(cls, x: T, exponent: f64Like) -> T: ...
    @classmethod
    def reduce(cls, code: i64Like, x: T, axis: i64Like, keepdims: i64Like) -> T: ...
    @classmethod
    def matmul(cls, a: T, b: T, ta: i64Like, tb: i64Like) -> T: ...
    @classmethod
    def fused_matmul(cls, a: T, b: T, ta: i64Like, tb: i64Like, act: i64Like, add: T, residual: T) -> T: ...
    @classmethod
    def softmax(cls, x: T) -> T: ...
    @classmethod
    def log_softmax(cls, x: T) -> T: ...
    @classmethod
    def layer_norm(cls, x: T, w: T, b: T, eps: f64Like) -> T: ...
    @classmethod
    def rms_norm(cls, x: T, w: T, eps: f64Like) -> T: ...
    @classmethod
    def norm_matmul(cls, x: T, w: T, b: T, eps: f64Like, tb: i64Like) -> T: ...
    @classmethod
    def group_norm(cls, x: T, w: T, b: T, groups: i64Like, eps: f64Like, act: i64Like) -> T: ...
    @classmethod
    def swiglu(cls, gate: T, up: T) -> T: ...
    @classmethod
    def attention(cls, q: T, k: T, v: T, heads: i64Like, kv_heads: i64Like, causal: i64Like,
                  scale: f64Like) -> T: ...
    @classmethod
    def transpose(cls, x: T, perm: i64Like) -> T: ...
    @classmethod
    def reshape(cls, x: T, shape: i64Like) -> T: ...
    @classmethod
    def op1(cls, key: i64Like, a: T) -> T: ...
    @classmethod
    def op2(cls, key: i64Like, a: T, b: T) -> T: ...
    @classmethod
    def op3(cls, key: i64Like, a: T, b: T, c: T) -> T: ...
    @classmethod
    def op4(cls, key: i64Like, a: T, b: T, c: T, d: T) -> T: ...


@function(merge=lambda old, new: old + new)
def uses(t: T) -> i64:
    """Distinct readers of a tensor (merged classes add up: conservative)."""


@function(merge=lambda old, new: old)
def shape_of(t: T) -> i64:
    """Interned shape key of a tensor."""


@function(merge=lambda old, new: old)
def last_dim(t: T) -> i64: ...


@function(merge=lambda old, new: old)
def rows(t: T) -> i64:
    """Rows of a tensor: the product of its dims but the last (1 for a vector)."""


@function(merge=lambda old, new: old)
def vec_len(t: T) -> i64:
    """Length of a rank-1 tensor (a norm's weight or bias)."""


HeadSplit = relation("HeadSplit", T, i64)      # reshape [b, s, h*d] -> [b, s, h, d]
HeadMerge = relation("HeadMerge", T)           # reshape [b, s, h, d] -> [b, s, h*d]
CausalMask = relation("CausalMask", T)         # constant [.., s, s]: 0 on and below the diagonal, -inf above
PermCompose = relation("PermCompose", i64, i64, i64)
IdentityPerm = relation("IdentityPerm", i64)

# ---------------------------------------------------------------- graph facts (loaded in bulk)

# name -> (column types, builder: columns as egglog vars -> action list)
R = T.ref

FACTS = {
    "NLeaf": ((i64,), lambda n: [union(R(n)).with_(T.leaf(n))]),
    "NScalar": ((i64, f64), lambda n, v: [union(R(n)).with_(T.scalar(v))]),
    "NUnary": ((i64, i64, i64), lambda n, k, a: [union(R(n)).with_(T.unary(k, R(a)))]),
    "NBinary": ((i64, i64, i64, i64), lambda n, k, a, b: [union(R(n)).with_(T.binary(k, R(a), R(b)))]),
    "NBiasAdd": ((i64, i64, i64), lambda n, a, b: [union(R(n)).with_(T.bias_add(R(a), R(b)))]),
    "NPow": ((i64, i64, f64), lambda n, a, v: [union(R(n)).with_(T.pow(R(a), v))]),
    "NReduce": ((i64, i64, i64, i64, i64),
                lambda n, k, a, t1, t2: [union(R(n)).with_(T.reduce(k, R(a), t1, t2))]),
    "NMatmul": ((i64, i64, i64, i64, i64),
                lambda n, a, b, t1, t2: [union(R(n)).with_(T.matmul(R(a), R(b), t1, t2))]),
    "NSoftmax": ((i64, i64), lambda n, a: [union(R(n)).with_(T.softmax(R(a)))]),
    "NRmsNorm": ((i64, i64, i64, f64), lambda n, a, b, v: [union(R(n)).with_(T.rms_norm(R(a), R(b), v))]),
    "NGroupNorm": ((i64, i64, i64, i64, i64, f64),
                   lambda n, a, b, c, k, v: [union(R(n)).with_(T.group_norm(R(a), R(b), R(c), k, v, 0))]),
    "NTranspose": ((i64, i64, i64), lambda n, a, k: [union(R(n)).with_(T.transpose(R(a), k))]),
    "NReshape": ((i64, i64, i64), lambda n, a, k: [union(R(n)).with_(T.reshape(R(a), k))]),
    "NOp1": ((i64, i64, i64), lambda n, k, a: [union(R(n)).with_(T.op1(k, R(a)))]),
    "NOp2": ((i64, i64, i64, i64), lambda n, k, a, b: [union(R(n)).with_(T.op2(k, R(a), R(b)))]),
    "NOp3": ((i64, i64, i64, i64, i64),
             lambda n, k, a, b, c: [union(R(n)).with_(T.op3(k, R(a), R(b), R(c)))]),
    "NOp4": ((i64, i64, i64, i64, i64, i64),
             lambda n, k, a, b, c, d: [union(R(n)).with_(T.op4(k, R(a), R(b), R(c), R(d)))]),
    "NUses": ((i64, i64), lambda n, k: [set_(uses(R(n))).to(k)]),
    "NShape": ((i64, i64, i64, i64), lambda n, k, a, r: [set_(shape_of(R(n))).to(k), set_(last_dim(R(n))).to(a),
                                                         set_(rows(R(n))).to(r)]),
    "NVec": ((i64, i64), lambda n, k: [set_(vec_len(R(n))).to(k)]),
    "NHeadSplit": ((i64, i64), lambda n, k: [HeadSplit(R(n), k)]),
    "NHeadMerge": ((i64,), lambda n: [HeadMerge(R(n))]),
    "NCausalMask": ((i64,), lambda n: [CausalMask(R(n))]),
    "NPermCompose": ((i64, i64, i64), lambda a, b, c: [PermCompose(a, b, c)]),
    "NIdentityPerm": ((i64,), lambda a: [IdentityPerm(a)]),
}


def _build_rules():
    relations, rules = {}, []
    for name, (types, actions) in FACTS.items():
        rel = relation(name, *types)
        cols = [var(f"{name}_{i}", t) for i, t in enumerate(types)]
        relations[name] = rel
        rules.append(rule(rel(*cols)).then(*actions(*cols)))
    return relations, ruleset(*rules, name="build")


RELATIONS, BUILD = _build_rules()

# ---------------------------------------------------------------- the rewrite rules


@dataclass
class FusionRule:
    name: str
    doc: str
    rules: list = field(default_factory=list)
    in_egglog: bool = True

    def __post_init__(self):
        self.ruleset = ruleset(*self.rules, name=self.name) if self.rules else None


x, y, z, a, b, w, bb, m, f, s, r, u, g, q, k, v = vars_("x y z a b w bb m f s r u g q k v", T)
e1, e2, e3, e4, e5, e6, e7, e8, e9, e10 = vars_("e1 e2 e3 e4 e5 e6 e7 e8 e9 e10", T)
ta, tb, act, h, hk, p1, p2, p3, ks = vars_("ta tb act h hk p1 p2 p3 ks", i64)
eps, c = vars_("eps c", f64)


def _one(*terms):
    """Facts: each term is read by exactly one node (the pattern's own)."""
    return [uses(t) == i64(1) for t in terms]


def _commuted(code, p, q_):
    """Both operand orders of a commutative binary op."""
    return [T.binary(code, p, q_), T.binary(code, q_, p)]


def _matmul_add():
    out = []
    for lhs in _commuted(ADD, m, y) + [T.bias_add(m, y)]:
        out.append(rule(eq(s).to(lhs), eq(m).to(T.matmul(a, b, ta, tb)), *_one(m),
                        shape_of(s) == shape_of(m))
                   .then(union(s).with_(T.fused_matmul(a, b, ta, tb, 0, y, T.absent()))))
    return out


def _matmul_activation():
    out = []
    for code in (RELU, GELU, GELU_TANH, SILU):
        out.append(rule(eq(s).to(T.unary(code, m)), eq(m).to(T.matmul(a, b, ta, tb)), *_one(m))
                   .then(union(s).with_(T.fused_matmul(a, b, ta, tb, code, T.absent(), T.absent()))))
        out.append(rule(eq(s).to(T.unary(code, f)), eq(f).to(T.fused_matmul(a, b, ta, tb, 0, y, T.absent())),
                        *_one(f))
                   .then(union(s).with_(T.fused_matmul(a, b, ta, tb, code, y, T.absent()))))
    return out


def _matmul_residual():
    return [rule(eq(s).to(lhs), eq(f).to(T.fused_matmul(a, b, ta, tb, act, y, T.absent())), *_one(f),
                 shape_of(s) == shape_of(f))
            .then(union(s).with_(T.fused_matmul(a, b, ta, tb, act, y, r)))
            for lhs in _commuted(ADD, f, r)]


def _silu():
    return [rule(eq(s).to(lhs), eq(g).to(T.unary(SIGMOID, x)), *_one(g))
            .then(union(s).with_(T.unary(SILU, x)))
            for lhs in _commuted(MUL, x, g)]


def _swiglu():
    return [rule(eq(s).to(lhs), eq(g).to(T.unary(SILU, x)), *_one(g))
            .then(union(s).with_(T.swiglu(x, u)))
            for lhs in _commuted(MUL, g, u)]


def _square(t):
    """The ways an imported graph squares a tensor."""
    return [T.binary(MUL, t, t), T.pow(t, 2.0)]


def _normalised(num, var_eps):
    """Alternatives for num / sqrt(var_eps): (facts, term, intermediates)."""
    return [(lambda n_: [eq(e9).to(T.unary(SQRT, var_eps)), eq(n_).to(T.binary(DIV, num, e9))]),
            (lambda n_: [eq(e9).to(T.unary(RSQRT, var_eps)), eq(n_).to(T.binary(MUL, num, e9))]),
            (lambda n_: [eq(e9).to(T.unary(RSQRT, var_eps)), eq(n_).to(T.binary(MUL, e9, num))])]


def _layer_norm():
    out = []
    for sq, norm, lhs in itertools.product(_square(e2), _normalised(e2, e5),
                                           _commuted(ADD, e7, bb) + [T.bias_add(e7, bb)]):
        facts = [eq(s).to(lhs), eq(e1).to(T.reduce(MEAN, x, AXIS_LAST, 1)), eq(e2).to(T.binary(SUB, x, e1)),
                 eq(e3).to(sq), eq(e4).to(T.reduce(MEAN, e3, AXIS_LAST, 1)),
                 eq(e5).to(T.binary(ADD, e4, T.scalar(eps))), *norm(e6),
                 eq(e7).to(T.binary(MUL, e6, w)),
                 uses(e2) == i64(2), *_one(e1, e3, e4, e5, e9, e6, e7),
                 vec_len(w) == last_dim(x), vec_len(bb) == last_dim(x)]
        out.append(rule(*facts).then(union(s).with_(T.layer_norm(x, w, bb, eps))))
    return out


def _rms_norm():
    out = []
    for sq, norm, lhs in itertools.product(_square(x), _normalised(x, e5), _commuted(MUL, e6, w)):
        facts = [eq(s).to(lhs), eq(e3).to(sq), eq(e4).to(T.reduce(MEAN, e3, AXIS_LAST, 1)),
                 eq(e5).to(T.binary(ADD, e4, T.scalar(eps))), *norm(e6),
                 *_one(e3, e4, e5, e9, e6), vec_len(w) == last_dim(x)]
        out.append(rule(*facts).then(union(s).with_(T.rms_norm(x, w, eps))))
    return out


def _softmax():
    stable = [eq(e1).to(T.reduce(MAX, x, AXIS_LAST, 1)), eq(e2).to(T.binary(SUB, x, e1)),
              eq(e3).to(T.unary(EXP, e2)), *_one(e1, e2)]
    plain = [eq(e3).to(T.unary(EXP, x))]
    return [rule(eq(s).to(T.binary(DIV, e3, e4)), eq(e4).to(T.reduce(SUM, e3, AXIS_LAST, 1)),
                 uses(e3) == i64(2), *_one(e4), *pre)
            .then(union(s).with_(T.softmax(x)))
            for pre in (stable, plain)]


def _log_softmax():
    return [rule(eq(s).to(T.binary(SUB, e2, e5)), eq(e1).to(T.reduce(MAX, x, AXIS_LAST, 1)),
                 eq(e2).to(T.binary(SUB, x, e1)), eq(e3).to(T.unary(EXP, e2)),
                 eq(e4).to(T.reduce(SUM, e3, AXIS_LAST, 1)), eq(e5).to(T.unary(LOG, e4)),
                 uses(e2) == i64(2), *_one(e1, e3, e4, e5))
            .then(union(s).with_(T.log_softmax(x)))]


# norm_matmul (the norm in the product's prologue) pays where the product has few rows:
# codegen's few-row kernel takes it (up to codegen.matmul.VECTOR_ROWS rows) and sums each
# row's squares once a workgroup, saving a dispatch. On more rows it would run on the
# simple kernel (then 16 x 16, each output summing its row's squares again; since run 48
# a 16 x 64 tile, once a row): a 49,152-word LM head took 17.4 ms fused against about
# 3.5 ms apart, gpt-tiny's 257-word head at batch 8 x 256 125 us against 13 + 31 (run 35,
# H100); the norm and the tiled or cooperative product win.
NORM_MATMUL_MAX_ROWS = 8


def _norm_matmul():
    return [rule(eq(s).to(T.matmul(e1, b, 0, tb)), eq(e1).to(T.rms_norm(x, w, eps)), *_one(e1),
                 rows(s) <= i64(NORM_MATMUL_MAX_ROWS))
            .then(union(s).with_(T.norm_matmul(x, w, b, eps, tb)))]


def _group_norm_silu():
    return [rule(eq(s).to(T.unary(SILU, e1)), eq(e1).to(T.group_norm(x, w, bb, h, eps, 0)), *_one(e1))
            .then(union(s).with_(T.group_norm(x, w, bb, h, eps, SILU)))]


def _attention():
    """reshape(transpose(softmax(scale * q kᵀ [+ causal mask]) v)) on split heads."""
    heads = [eq(e1).to(T.transpose(q, P0213)), eq(q).to(T.reshape(x, ks)), HeadSplit(q, h),
             eq(e2).to(T.transpose(k, P0213)), eq(k).to(T.reshape(y, p1)), HeadSplit(k, hk),
             eq(e3).to(T.transpose(v, P0213)), eq(v).to(T.reshape(z, p2)), HeadSplit(v, hk),
             eq(e4).to(T.matmul(e1, e2, 0, 1)), *_one(q, k, v, e1, e2, e3, e4, e5, e6, e7, e8)]
    tail = [eq(s).to(T.reshape(e8, p3)), HeadMerge(s), eq(e8).to(T.transpose(e7, P0213)),
            eq(e7).to(T.matmul(e6, e3, 0, 0))]
    scaled = [(lambda t: _commuted(MUL, e4, T.scalar(c)), lambda: c),
              (lambda t: [T.binary(DIV, e4, T.scalar(c))], lambda: f64(1.0) / c)]
    out = []
    for scale_terms, scale_value in scaled:
        for scaled_term in scale_terms(None):
            # without mask: e5 is the scaled scores and softmax reads it
            out.append(rule(*heads, *tail, eq(e5).to(scaled_term), eq(e6).to(T.softmax(e5)))
                       .then(union(s).with_(T.attention(x, y, z, h, hk, 0, scale_value()))))
            for masked in _commuted(ADD, e5, g):
                out.append(rule(*heads, *tail, eq(e5).to(scaled_term), eq(e9).to(masked), CausalMask(g),
                                eq(e6).to(T.softmax(e9)), *_one(e9))
                           .then(union(s).with_(T.attention(x, y, z, h, hk, 1, scale_value()))))
    return out


def _transpose_transpose():
    return [rule(eq(s).to(T.transpose(e1, p2)), eq(e1).to(T.transpose(x, p1)), PermCompose(p1, p2, p3))
            .then(union(s).with_(T.transpose(x, p3))),
            rule(eq(s).to(T.transpose(x, p1)), IdentityPerm(p1)).then(union(s).with_(x))]


def _reshape_chain():
    return [rule(eq(s).to(T.reshape(e1, p2)), eq(e1).to(T.reshape(x, p1)))
            .then(union(s).with_(T.reshape(x, p2))),
            rule(eq(s).to(T.reshape(x, p1)), shape_of(x) == p1).then(union(s).with_(x))]


def _identity(code, value, commutes):
    lhs = _commuted(code, x, T.scalar(value)) if commutes else [T.binary(code, x, T.scalar(value))]
    return [rule(eq(s).to(t)).then(union(s).with_(x)) for t in lhs]


RULES: dict[str, FusionRule] = {r.name: r for r in [
    FusionRule("matmul_add", "matmul + bias or add (either side, broadcast or full) -> fused_matmul",
               _matmul_add()),
    FusionRule("matmul_activation", "relu/gelu/silu after matmul(+add) -> fused_matmul epilogue",
               _matmul_activation()),
    FusionRule("matmul_residual", "fused_matmul + residual -> fused_matmul with residual", _matmul_residual()),
    FusionRule("silu", "x * sigmoid(x) -> silu(x)", _silu()),
    FusionRule("swiglu", "silu(gate) * up -> swiglu", _swiglu()),
    FusionRule("layer_norm_decomposed", "mean/sub/square/mean/add eps/sqrt/div/mul/add -> layer_norm",
               _layer_norm()),
    FusionRule("rms_norm_decomposed", "x / sqrt(mean(x²) + eps) * w -> rms_norm", _rms_norm()),
    FusionRule("softmax_decomposed", "exp(x - max) / sum(exp(x - max)) -> softmax", _softmax()),
    FusionRule("log_softmax_decomposed", "(x - max) - log(sum(exp(x - max))) -> log_softmax",
               _log_softmax()),
    FusionRule("norm_matmul", "rms_norm feeding a matmul -> norm_matmul (norm in the prologue)",
               _norm_matmul()),
    FusionRule("group_norm_silu", "silu(group_norm(x)) -> group_norm(activation='silu')", _group_norm_silu()),
    FusionRule("attention_decomposed", "split heads, q kᵀ * scale [+ causal mask], softmax, @ v, merge "
               "heads -> attention", _attention()),
    FusionRule("transpose_transpose", "transpose of transpose -> one transpose (or none)",
               _transpose_transpose()),
    FusionRule("reshape_chain", "reshape of reshape -> one reshape; reshape to the same shape -> nothing",
               _reshape_chain()),
    FusionRule("mul_one", "x * 1 and x / 1 -> x", _identity(MUL, 1.0, True) + _identity(DIV, 1.0, False)),
    FusionRule("add_zero", "x + 0 and x - 0 -> x", _identity(ADD, 0.0, True) + _identity(SUB, 0.0, False)),
    FusionRule("double_negation", "-(-x) -> x",
               [rule(eq(s).to(T.unary(NEG, e1)), eq(e1).to(T.unary(NEG, x))).then(union(s).with_(x))]),
    FusionRule("cse", "common subexpressions: merged by egglog's hash-consing of identical terms "
               "(counted by a Python pass over the input graph)", in_egglog=False),
    FusionRule("pointwise_dag", "chains and small DAGs of elementwise ops -> one pointwise node; a graph "
               "pass after extraction (engine.optimize.pointwise), not an egglog rewrite", in_egglog=False),
]}

RULE_OF_DECL = {rr.decl: fr.name for fr in RULES.values() for rr in fr.rules}


def egglog_rulesets():
    """One ruleset per named rule (so egglog's report counts matches per name)."""
    return [fr.ruleset for fr in RULES.values() if fr.rules]


# ---------------------------------------------------------------- which rules a result node embodies

def _scalar_input(node, const_value, value) -> bool:
    return any(const_value(i) == value for i in node.inputs)


def applied_rules(op: str, attrs: dict, absorbed: list, const_value) -> list[str]:
    """The rules a node of the optimized graph embodies, given the original nodes it
    absorbed (its origins less one node of its own op). One entry per application."""
    ops = [n.op for n in absorbed]
    count = ops.count
    out: list[str] = []
    if op == "fused_matmul" and "matmul" in ops:
        out += ["matmul_add"] * attrs["has_add"] + ["matmul_activation"] * (attrs["activation"] != "none")
        out += ["matmul_residual"] * attrs["has_residual"]
    if op == "swiglu" and "mul" in ops:
        out.append("swiglu")
    if op == "norm_matmul" and "rms_norm" in ops or (op == "norm_matmul" and count("mean")):
        out.append("norm_matmul")
    if op == "group_norm" and attrs.get("activation") == "silu" and ("silu" in ops or "sigmoid" in ops):
        out.append("group_norm_silu")
    if op == "attention" and count("matmul") >= 2:
        out.append("attention_decomposed")
    out += ["silu"] * count("sigmoid")
    if op == "layer_norm" and count("mean") >= 2:
        out.append("layer_norm_decomposed")
    if op in ("rms_norm", "norm_matmul") and count("mean"):
        out.append("rms_norm_decomposed")
    if op == "log_softmax" and count("log"):
        out.append("log_softmax_decomposed")
    elif count("exp") and op in ("softmax", "attention"):
        out.append("softmax_decomposed")
    if op != "attention":
        out += ["transpose_transpose"] * count("transpose") + ["reshape_chain"] * count("reshape")
    out += ["double_negation"] * (count("neg") // 2)
    out += ["mul_one"] * sum(1 for n in absorbed if n.op in ("mul", "div") and _scalar_input(n, const_value, 1.0)
                             and op not in ("attention",))
    out += ["add_zero"] * sum(1 for n in absorbed if n.op in ("add", "sub") and _scalar_input(n, const_value, 0.0))
    return out
