"""The graph IR: a list of nodes in topological order, with named inputs,
parameters and outputs.

Nodes are immutable and refer to their operands by id (the index in
``Graph.nodes``); a node can only use nodes built before it, so the list is always
topologically sorted. Every builder method goes through ``Graph.apply``, which runs
the op's shape rule from ``engine.ops`` and raises a ``ShapeError`` naming the op,
the node and the shapes when the operands do not fit.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import GraphError, ShapeError
from .ops import OPS, OpShapeError, TensorType

DTYPES = {"f32": np.float32, "i32": np.int32}
# Bytes an element of each dtype takes in memory. bf16 is a storage type only: a parameter
# kept as the upper halves of its f32 values (exactly, engine.optimize.bf16_weights), which
# the kernels reading it widen back to f32.
ITEMSIZE = {"f32": 4, "i32": 4, "bf16": 2}
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Node:
    id: int
    op: str
    inputs: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str = "f32"
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    name: str | None = None
    # The modules the node came from (``model.layers.3.self_attn``): one for a node a
    # module built, several for a fused node, none for the graph's own top level.
    modules: tuple[str, ...] = field(default=(), compare=False, hash=False)

    @property
    def module(self) -> str:
        """The innermost module holding all of the node's modules ('' at the top level)."""
        return common_module(self.modules)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return ITEMSIZE[self.dtype] * self.size

    @property
    def label(self) -> str:
        return f"%{self.id}" + (f" '{self.name}'" if self.name else "")


def common_module(modules: Iterable[str]) -> str:
    """The longest common dotted prefix of module paths: ``model.layers.3`` for
    ``model.layers.3.mlp`` and ``model.layers.3.self_attn``; '' when there is none."""
    paths = [m.split(".") for m in modules]
    if not paths:
        return ""
    common = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def module_set(modules) -> tuple[str, ...]:
    """A module path, or several, as a node's sorted ``modules`` tuple ('' and None drop out)."""
    if modules is None or isinstance(modules, str):
        return (modules,) if modules else ()
    return tuple(sorted({m for m in modules if m}))


def _canon(v: Any) -> Any:
    """Attributes as plain, hashable, JSON-friendly values (tuples for lists)."""
    if isinstance(v, (list, tuple)):
        return tuple(_canon(x) for x in v)
    if isinstance(v, np.generic):
        return v.item()
    return v


class Graph:
    """A dataflow graph of tensor ops. Build it with the methods below."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: list[Node] = []
        self.inputs: dict[str, int] = {}
        self.parameters: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.constants: dict[int, np.ndarray] = {}
        self.param_meta: dict[str, dict] = {}
        self._scope: tuple[str, ...] = ()

    # ------------------------------------------------------------ core

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def __len__(self) -> int:
        return len(self.nodes)

    def shape(self, x: int) -> tuple[int, ...]:
        return self.nodes[x].shape

    def _append(self, op, inputs, ttype: TensorType, attrs, name=None, modules=None) -> int:
        node = Node(len(self.nodes), op, tuple(inputs), tuple(int(n) for n in ttype.shape),
                    ttype.dtype, attrs, name, self._scope if modules is None else module_set(modules))
        self.nodes.append(node)
        return node.id

    @contextmanager
    def scope(self, modules):
        """Stamp the nodes built inside with a module path (``with g.scope("layers.3.self_attn"):``)
        or with several (a fused or backward node standing for others); '' is the top level.
        Paths are absolute: an inner scope replaces the outer one."""
        outer = self._scope
        self._scope = module_set(modules)
        try:
            yield self
        finally:
            self._scope = outer

    def set_modules(self, node_id: int, modules) -> None:
        """Replace the modules of a node (fusion gives a node those of the nodes it merged)."""
        self.nodes[node_id] = replace(self.nodes[node_id], modules=module_set(modules))

    def apply(self, op: str, *inputs: int, name: str | None = None, **attrs) -> int:
        """Add a node running ``op`` on ``inputs``; attributes not given take the op's defaults."""
        if op not in OPS:
            raise GraphError(f"unknown op {op!r}")
        opdef = OPS[op]
        unknown = set(attrs) - set(opdef.attrs)
        if unknown:
            raise GraphError(f"{op}: unknown attribute(s) {sorted(unknown)}; known: {sorted(opdef.attrs)}")
        full = {k: _canon(attrs.get(k, v)) for k, v in opdef.attrs.items()}
        for i in inputs:
            if not isinstance(i, (int, np.integer)) or not 0 <= i < len(self.nodes):
                raise GraphError(f"{op} (node %{len(self.nodes)}): operand {i!r} is not an earlier node "
                                 f"of graph {self.name!r}")
        types = [TensorType(self.nodes[i].shape, self.nodes[i].dtype) for i in inputs]
        try:
            out = opdef.shape(types, full)
        except OpShapeError as e:
            where = f"node %{len(self.nodes)}" + (f" '{name}'" if name else "")
            shapes = ", ".join(f"{self.nodes[i].label} {list(t.shape)} {t.dtype}" for i, t in zip(inputs, types))
            raise ShapeError(f"{op} ({where}): {e} [operands: {shapes}]") from None
        return self._append(op, inputs, out, full, name)

    # ------------------------------------------------------------ sources and outputs

    def input(self, name: str, shape: Sequence[int], dtype: str = "f32") -> int:
        self._check_new_name(name, self.inputs)
        if dtype not in DTYPES:
            raise GraphError(f"input {name!r}: dtype must be one of {sorted(DTYPES)}, found {dtype!r}")
        if any(int(n) < 0 for n in shape):
            raise ShapeError(f"input {name!r}: negative dimension in {list(shape)}")
        self.inputs[name] = self._append("input", (), TensorType(tuple(shape), dtype), {}, name)
        return self.inputs[name]

    def parameter(self, name: str, shape: Sequence[int], init: dict | None = None,
                  trainable: bool = True, decay: bool | None = None, dtype: str = "f32") -> int:
        """A learned tensor. ``init`` describes how to initialise it (see engine.nn);
        ``decay`` says whether weight decay applies (default: only for rank >= 2);
        ``dtype`` how it is stored (f32, or bf16 for a weight an inference plan reads
        halved, ``engine.optimize.bf16_weights``)."""
        self._check_new_name(name, self.parameters)
        if dtype not in ("f32", "bf16"):
            raise GraphError(f"parameter {name!r}: dtype must be f32 or bf16, found {dtype!r}")
        self.parameters[name] = self._append("parameter", (), TensorType(tuple(shape), dtype), {}, name)
        self.param_meta[name] = {"init": init or {}, "trainable": trainable,
                                 "decay": len(shape) >= 2 if decay is None else decay}
        return self.parameters[name]

    def constant(self, value, name: str | None = None) -> int:
        arr = np.asarray(value)
        dtype = "i32" if np.issubdtype(arr.dtype, np.integer) else "f32"
        arr = arr.astype(DTYPES[dtype])
        nid = self._append("constant", (), TensorType(arr.shape, dtype), {}, name)
        self.constants[nid] = arr
        return nid

    def output(self, name: str, x: int) -> int:
        self._check_new_name(name, self.outputs)
        if not isinstance(x, (int, np.integer)) or not 0 <= x < len(self.nodes):
            raise GraphError(f"output {name!r}: {x!r} is not a node of graph {self.name!r}")
        self.outputs[name] = x
        return x

    def _check_new_name(self, name, table):
        if not isinstance(name, str) or not name:
            raise GraphError(f"names must be non-empty strings, found {name!r}")
        if name in table:
            raise GraphError(f"graph {self.name!r} already has {name!r}")

    # ------------------------------------------------------------ elementwise

    def add(self, x, y, name=None): return self.apply("add", x, y, name=name)
    def sub(self, x, y, name=None): return self.apply("sub", x, y, name=name)
    def mul(self, x, y, name=None): return self.apply("mul", x, y, name=name)
    def div(self, x, y, name=None): return self.apply("div", x, y, name=name)
    def neg(self, x, name=None): return self.apply("neg", x, name=name)
    def exp(self, x, name=None): return self.apply("exp", x, name=name)
    def log(self, x, name=None): return self.apply("log", x, name=name)
    def sqrt(self, x, name=None): return self.apply("sqrt", x, name=name)
    def rsqrt(self, x, name=None): return self.apply("rsqrt", x, name=name)
    def reciprocal(self, x, name=None): return self.apply("reciprocal", x, name=name)
    def abs(self, x, name=None): return self.apply("abs", x, name=name)
    def relu(self, x, name=None): return self.apply("relu", x, name=name)
    def sigmoid(self, x, name=None): return self.apply("sigmoid", x, name=name)
    def tanh(self, x, name=None): return self.apply("tanh", x, name=name)
    def silu(self, x, name=None): return self.apply("silu", x, name=name)
    def stop_gradient(self, x, name=None): return self.apply("stop_gradient", x, name=name)

    def pow(self, x, exponent: float, name=None):
        return self.apply("pow", x, exponent=float(exponent), name=name)

    def gelu(self, x, approximate: str = "none", name=None):
        if approximate not in ("none", "tanh"):
            raise GraphError(f"gelu: approximate must be 'none' or 'tanh', found {approximate!r}")
        return self.apply("gelu", x, approximate=approximate, name=name)

    def bias_add(self, x, b, name=None): return self.apply("bias_add", x, b, name=name)

    def scale(self, x, factor: float, name=None):
        return self.mul(x, self.constant(np.float32(factor)), name=name)

    # ------------------------------------------------------------ reductions and norms

    def sum(self, x, axis=None, keepdims=False, name=None):
        return self.apply("sum", x, axis=axis, keepdims=keepdims, name=name)

    def mean(self, x, axis=None, keepdims=False, name=None):
        return self.apply("mean", x, axis=axis, keepdims=keepdims, name=name)

    def max(self, x, axis=-1, keepdims=False, name=None):
        return self.apply("max", x, axis=axis, keepdims=keepdims, name=name)

    def softmax(self, x, name=None): return self.apply("softmax", x, name=name)
    def log_softmax(self, x, name=None): return self.apply("log_softmax", x, name=name)

    def layer_norm(self, x, w, b, eps=1e-5, name=None):
        return self.apply("layer_norm", x, w, b, eps=float(eps), name=name)

    def rms_norm(self, x, w, eps=1e-6, name=None):
        return self.apply("rms_norm", x, w, eps=float(eps), name=name)

    def group_norm(self, x, w, b, num_groups, eps=1e-5, name=None):
        return self.apply("group_norm", x, w, b, num_groups=int(num_groups), eps=float(eps), name=name)

    # ------------------------------------------------------------ matmul, attention, conv

    def matmul(self, a, b, transpose_a=False, transpose_b=False, name=None):
        return self.apply("matmul", a, b, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b), name=name)

    def linear(self, x, w, b=None, name=None):
        """x @ w (+ b), with w stored [in, out]."""
        y = self.matmul(x, w, name=None if b is not None else name)
        return self.bias_add(y, b, name=name) if b is not None else y

    def attention(self, q, k, v, num_heads, num_kv_heads=None, causal=False, scale=None, name=None):
        return self.apply("attention", q, k, v, num_heads=int(num_heads),
                          num_kv_heads=None if num_kv_heads is None else int(num_kv_heads),
                          causal=bool(causal), scale=None if scale is None else float(scale), name=name)

    def rope(self, x, num_heads, base=10000.0, offset=0, positions=None, scaling=(), name=None):
        """Rotate by positions offset..offset+seq, or by the i32 [batch, seq] node ``positions``;
        ``scaling``: how the frequencies are rewritten (``ops.rope_inverse_frequencies``)."""
        operands = (x,) if positions is None else (x, positions)
        return self.apply("rope", *operands, num_heads=int(num_heads), base=float(base), offset=int(offset),
                          scaling=tuple(scaling), name=name)

    def cache_write(self, cache, x, positions, rope_heads=0, rope_base=10000.0, rope_scaling=(), name=None):
        """x (a node, or several: one per plane of the cache) written at ``positions``."""
        xs = tuple(x) if isinstance(x, (list, tuple)) else (x,)
        return self.apply("cache_write", cache, *xs, positions, rope_heads=int(rope_heads),
                          rope_base=float(rope_base), rope_scaling=tuple(rope_scaling), name=name)

    def argmax(self, x, name=None):
        """The i32 index of each row's largest element (last axis)."""
        return self.apply("argmax", x, name=name)

    def cached_attention(self, q, k, v, positions, num_heads, num_kv_heads=None, scale=None, rope=False,
                         rope_base=10000.0, rope_scaling=(), name=None):
        return self.apply("cached_attention", q, k, v, positions, num_heads=int(num_heads),
                          num_kv_heads=None if num_kv_heads is None else int(num_kv_heads),
                          scale=None if scale is None else float(scale), rope=bool(rope),
                          rope_base=float(rope_base), rope_scaling=tuple(rope_scaling), name=name)

    def conv1d(self, x, w, b=None, stride=1, padding=0, name=None):
        ops = (x, w) if b is None else (x, w, b)
        return self.apply("conv1d", *ops, stride=(int(stride),), padding=(int(padding),), name=name)

    def conv2d(self, x, w, b=None, stride=1, padding=0, name=None):
        pair = lambda v: (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(n) for n in v)
        ops = (x, w) if b is None else (x, w, b)
        return self.apply("conv2d", *ops, stride=pair(stride), padding=pair(padding), name=name)

    # ------------------------------------------------------------ data movement

    def reshape(self, x, shape, name=None):
        return self.apply("reshape", x, shape=tuple(int(n) for n in shape), name=name)

    def transpose(self, x, perm=None, name=None):
        """Permute axes; by default swap the last two."""
        rank = len(self.shape(x))
        if perm is None:
            if rank < 2:
                raise ShapeError(f"transpose ({self[x].label}): needs rank >= 2, found {list(self.shape(x))}")
            perm = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        return self.apply("transpose", x, perm=tuple(int(p) for p in perm), name=name)

    permute = transpose

    def concat(self, xs: Iterable[int], axis=0, name=None):
        xs = tuple(xs)
        if not xs:
            raise GraphError("concat needs at least one operand")
        return self.apply("concat", *xs, axis=int(axis), name=name)

    def slice(self, x, axis, start, stop, name=None):
        """x[start:stop] along ``axis``; x itself where that is all of it (whisper's
        positional table at its full 1500 frames), which would otherwise be copied."""
        shape = self.shape(x)
        rank, axis = len(shape), int(axis)
        axis = axis % rank if -rank <= axis < rank else axis  # out of range: the shape rule says so
        if 0 <= axis < rank and int(start) == 0 and int(stop) == shape[axis]:
            return x
        return self.apply("slice", x, axis=axis, start=int(start), stop=int(stop), name=name)

    def embedding(self, table, ids, name=None):
        return self.apply("embedding", table, ids, name=name)

    # ------------------------------------------------------------ losses

    def cross_entropy_loss(self, logits, labels, ignore_index=-100, name=None):
        """Integer labels (i32, with an ignore index) or soft labels (f32, the logits' shape)."""
        if self[labels].dtype == "f32":
            return self.apply("soft_cross_entropy", logits, labels, name=name)
        return self.apply("cross_entropy", logits, labels, ignore_index=int(ignore_index), name=name)

    def mse_loss(self, pred, target, name=None): return self.apply("mse_loss", pred, target, name=name)
    def bce_loss(self, logits, target, name=None): return self.apply("bce_loss", logits, target, name=name)

    # ------------------------------------------------------------ passes

    def users(self) -> list[list[int]]:
        """For each node, the ids of the nodes that read it."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def toposort(self) -> list[int]:
        """Node ids in dependency order (Kahn's algorithm, ties by id); raises on a cycle."""
        indeg = [len(set(n.inputs)) for n in self.nodes]
        users = [sorted(set(u)) for u in self.users()]
        import heapq
        ready = [n.id for n in self.nodes if indeg[n.id] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != len(self.nodes):
            raise GraphError(f"graph {self.name!r} has a cycle")
        return order

    def live_nodes(self, roots=None) -> set[int]:
        """The nodes ``roots`` (node ids; default: every output) depend on, themselves included."""
        live, stack = set(), list(self.outputs.values() if roots is None else roots)
        while stack:
            i = stack.pop()
            if i not in live:
                live.add(i)
                stack.extend(self.nodes[i].inputs)
        return live

    def prune(self) -> tuple["Graph", dict[int, int]]:
        """Dead-node elimination: keep what the outputs need, plus every input and
        parameter (they are the graph's interface). Returns the new graph and the
        old-id -> new-id map."""
        keep = self.live_nodes() | set(self.inputs.values()) | set(self.parameters.values())
        return self.rebuild(lambda n: n.id in keep)

    def rebuild(self, keep=lambda n: True, stand_in=None, order=None) -> tuple["Graph", dict[int, int]]:
        """A copy with the nodes ``keep`` accepts. ``stand_in(g, node, remap)``, where given,
        may build a node's replacement in the new graph ``g`` itself and return its id (None:
        the node is copied); it may map later nodes in ``remap`` as well (a packed node and
        its parts), which are then not copied. ``order``: the nodes in another topological
        order to copy them in (the order a plan runs them). Returns the graph and the
        old -> new id map."""
        g = Graph(self.name)
        g.param_meta = {k: dict(v) for k, v in self.param_meta.items()}
        remap: dict[int, int] = {}
        for n in (self.nodes if order is None else order):
            if n.id in remap or not keep(n):
                continue
            made = stand_in(g, n, remap) if stand_in else None
            if made is not None:
                remap[n.id] = made
                continue
            remap[n.id] = g._append(n.op, tuple(remap[i] for i in n.inputs), TensorType(n.shape, n.dtype),
                                    n.attrs, n.name, n.modules)
            if n.id in self.constants:
                g.constants[remap[n.id]] = self.constants[n.id]
        g.inputs = {k: remap[v] for k, v in self.inputs.items() if v in remap}
        g.parameters = {k: remap[v] for k, v in self.parameters.items() if v in remap}
        g.param_meta = {k: v for k, v in g.param_meta.items() if k in g.parameters}
        g.outputs = {k: remap[v] for k, v in self.outputs.items()}
        return g, remap

    def identity(self) -> dict[int, int]:
        """The old -> new id map of a rewrite that left this graph as it was."""
        return {n.id: n.id for n in self.nodes}

    def copy(self) -> "Graph":
        return self.rebuild(lambda n: True)[0]

    # ------------------------------------------------------------ printing, hashing, JSON

    def format_node(self, n: Node) -> str:
        args = ", ".join(f"%{i}" for i in n.inputs)
        attrs = {k: v for k, v in n.attrs.items() if k != "program"}
        if "program" in n.attrs:
            attrs["program"] = " ; ".join(op for op, _, _ in n.attrs["program"])
        extra = " {" + ", ".join(f"{k}={v}" for k, v in attrs.items()) + "}" if attrs else ""
        name = f"  # {n.name}" if n.name else ""
        return f"%{n.id} = {n.op}({args}) : {list(n.shape)} {n.dtype}{extra}{name}"

    def __str__(self) -> str:
        outs = {v: k for k, v in self.outputs.items()}
        lines = [f"graph {self.name} ({len(self.nodes)} nodes)"]
        for n in self.nodes:
            line = self.format_node(n)
            if n.id in outs:
                line += f"  -> output '{outs[n.id]}'"
            lines.append("  " + line)
        return "\n".join(lines)

    def to_dict(self, include_constants: bool = True) -> dict:
        def enc(a: np.ndarray):
            return {"dtype": str(a.dtype), "shape": list(a.shape),
                    "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}
        return {
            "format": FORMAT_VERSION,
            "name": self.name,
            "nodes": [{"op": n.op, "inputs": list(n.inputs), "shape": list(n.shape), "dtype": n.dtype,
                       "attrs": _jsonable(n.attrs), "name": n.name, **({"modules": list(n.modules)} if n.modules else {})}
                      for n in self.nodes],
            "inputs": self.inputs, "parameters": self.parameters, "outputs": self.outputs,
            "param_meta": self.param_meta,
            "constants": {str(k): (enc(v) if include_constants else
                                   {"sha256": hashlib.sha256(v.tobytes()).hexdigest(),
                                    "dtype": str(v.dtype), "shape": list(v.shape)})
                          for k, v in self.constants.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def structural_hash(self) -> str:
        """A stable hash of everything that affects computation (not the graph's own name,
        nor the modules its nodes came from)."""
        d = self.to_dict(include_constants=False)
        d.pop("name")
        for nd in d["nodes"]:
            nd.pop("modules", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        """Rebuild a graph, re-running every shape rule (a tampered file cannot smuggle
        in an inconsistent node)."""
        try:
            if d.get("format") != FORMAT_VERSION:
                raise GraphError(f"graph format {d.get('format')!r} is not {FORMAT_VERSION}")
            g = cls(d["name"])
            consts = {int(k): v for k, v in d["constants"].items()}
            names = {v: k for k, v in d["inputs"].items()}
            pnames = {v: k for k, v in d["parameters"].items()}
            for i, nd in enumerate(d["nodes"]):
                op = nd["op"]
                g._scope = module_set(nd.get("modules"))
                if op == "input":
                    g.input(names[i], nd["shape"], nd["dtype"])
                elif op == "parameter":
                    meta = d["param_meta"].get(pnames[i], {})
                    g.parameter(pnames[i], nd["shape"], meta.get("init"), meta.get("trainable", True),
                                meta.get("decay"), nd["dtype"])
                elif op == "constant":
                    c = consts[i]
                    arr = np.frombuffer(base64.b64decode(c["data"]), dtype=c["dtype"]).reshape(c["shape"])
                    g.constant(arr.copy(), name=nd["name"])
                else:
                    g.apply(op, *nd["inputs"], name=nd["name"], **_from_jsonable(nd["attrs"]))
                n = g.nodes[-1]
                if list(n.shape) != list(nd["shape"]) or n.dtype != nd["dtype"] or n.id != i:
                    raise GraphError(f"node %{i} ({op}): stored shape {nd['shape']} {nd['dtype']} "
                                     f"disagrees with its shape rule {list(n.shape)} {n.dtype}")
            g._scope = ()
            for k, v in d["outputs"].items():
                g.output(k, v)
            return g
        except GraphError:
            raise
        except ShapeError as e:  # e.g. an input's stored shape was changed
            raise GraphError(f"graph JSON is inconsistent: {e}") from None
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise GraphError(f"malformed graph JSON: {type(e).__name__}: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise GraphError(f"graph JSON does not parse: {e}") from None
        return cls.from_dict(d)


def _jsonable(v):
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return {"__tuple__": [_jsonable(x) for x in v]}
    if isinstance(v, float) and not math.isfinite(v):
        return {"__float__": repr(v)}
    return v


def _from_jsonable(v):
    if isinstance(v, dict):
        if "__tuple__" in v:
            return tuple(_from_jsonable(x) for x in v["__tuple__"])
        if "__float__" in v:
            return float(v["__float__"])
        return {k: _from_jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_jsonable(x) for x in v]
    return v
