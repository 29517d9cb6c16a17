"""Graph -> egglog facts -> saturation -> our own extraction -> Graph.

egglog's high-level API is slow for large graphs when fed one command per node
(nested terms overflow Python's recursion, ``let`` grows quadratically), so the graph
goes in as relations loaded from tab-separated files in one ``input`` command each, and
the ``build`` ruleset of ``rules.py`` binds every node to a one-op term. Extraction does
not use egglog's extractor: the e-graph is serialized to JSON and ``extract`` picks one
e-node per e-class with a Dijkstra-like pass (Knuth's generalisation) over the bytes-moved
cost of ``cost.py``; every loop is iterative, so depth costs nothing.
"""

from __future__ import annotations

import gc
import heapq
import json
import math
import os
import tempfile
import time
from collections import defaultdict

import numpy as np
from egglog import EGraph, unstable_combine_rulesets

from ..graph.ir import Graph, _canon
from ..graph.ops import OPS, OpShapeError, TensorType
from . import cost, rules
from .rules import ACTIVATIONS, AXIS_ALL, AXIS_LAST, BINARY, REDUCE, UNARY

SOURCES = ("input", "parameter", "constant")
_UNARY_NAME = {v: k for k, v in UNARY.items()}
_BINARY_NAME = {v: k for k, v in BINARY.items()}
_REDUCE_NAME = {v: k for k, v in REDUCE.items()}
_ACT_NAME = {v: k for k, v in ACTIVATIONS.items()}


def _attr_key(attrs: dict) -> str:
    return repr(sorted(attrs.items()))


class Interner:
    def __init__(self):
        self.ids: dict = {}
        self.values: list = []

    def __call__(self, value) -> int:
        if value not in self.ids:
            self.ids[value] = len(self.values)
            self.values.append(value)
        return self.ids[value]


# ---------------------------------------------------------------- translation

class Translation:
    """The facts describing one graph, plus what is needed to turn terms back into ops."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.shapes = Interner()
        self.opaque = Interner()          # (op, attrs key) -> key; attrs kept in opaque_attrs
        self.opaque_attrs: dict[int, dict] = {}
        self.rows: dict[str, list[tuple]] = defaultdict(list)
        self.rep = self._cse()
        self.cse_merged = sum(1 for n in graph.nodes if self.rep[n.id] != n.id and n.op not in SOURCES)
        self.uses = self._uses()
        for n in graph.nodes:
            if self.rep[n.id] == n.id:
                self._facts(n)

    def _cse(self) -> list[int]:
        """Canonical representative of each node (what egglog's hash-consing merges anyway)."""
        seen: dict = {}
        rep = []
        for n in self.graph.nodes:
            if n.op in SOURCES:
                rep.append(n.id)
                continue
            key = (n.op, _attr_key(n.attrs), tuple(rep[i] for i in n.inputs))
            rep.append(seen.setdefault(key, n.id))
        return rep

    def _uses(self) -> dict[int, int]:
        uses: dict[int, int] = defaultdict(int)
        for n in self.graph.nodes:
            if self.rep[n.id] == n.id:
                for i in {self.rep[i] for i in n.inputs}:
                    uses[i] += 1
        for o in self.graph.outputs.values():
            uses[self.rep[o]] += 1
        return uses

    def _facts(self, n):
        g, row = self.graph, self.rows
        ins = [self.rep[i] for i in n.inputs]
        row["NShape"].append((n.id, self.shapes(n.shape), n.shape[-1] if n.shape else -1, math.prod(n.shape[:-1])))
        row["NUses"].append((n.id, self.uses.get(n.id, 0)))
        if len(n.shape) == 1:
            row["NVec"].append((n.id, n.shape[0]))
        op, at = n.op, n.attrs
        if op in SOURCES:
            value = g.constants.get(n.id)
            if (op == "constant" and value.shape == () and value.dtype.kind == "f"
                    and math.isfinite(float(value))):
                row["NScalar"].append((n.id, float(value)))
            else:
                row["NLeaf"].append((n.id,))
            if op == "constant" and _is_causal_mask(value):
                row["NCausalMask"].append((n.id,))
        elif n.dtype != "f32" and op not in ("reshape", "transpose"):
            self._opaque(n, ins)
        elif op in UNARY and op != "gelu":
            row["NUnary"].append((n.id, UNARY[op], ins[0]))
        elif op == "gelu":
            row["NUnary"].append((n.id, UNARY["gelu_tanh" if at["approximate"] == "tanh" else "gelu"], ins[0]))
        elif op in BINARY:
            row["NBinary"].append((n.id, BINARY[op], ins[0], ins[1]))
        elif op == "bias_add":
            row["NBiasAdd"].append((n.id, ins[0], ins[1]))
        elif op == "pow" and at["exponent"] is not None:
            row["NPow"].append((n.id, ins[0], float(at["exponent"])))
        elif op in REDUCE:
            row["NReduce"].append((n.id, REDUCE[op], ins[0], AXIS_ALL if at["axis"] is None else AXIS_LAST,
                                   int(bool(at["keepdims"]))))
        elif op == "matmul":
            row["NMatmul"].append((n.id, ins[0], ins[1], int(at["transpose_a"]), int(at["transpose_b"])))
        elif op == "softmax":
            row["NSoftmax"].append((n.id, ins[0]))
        elif op == "rms_norm":
            row["NRmsNorm"].append((n.id, ins[0], ins[1], float(at["eps"])))
        elif op == "group_norm" and at["activation"] == "none":
            row["NGroupNorm"].append((n.id, *ins, at["num_groups"], float(at["eps"])))
        elif op == "transpose":
            row["NTranspose"].append((n.id, ins[0], rules.perm_code(at["perm"])))
            self._perm_facts(n)
        elif op == "reshape":
            row["NReshape"].append((n.id, ins[0], self.shapes(n.shape)))
            self._head_facts(n)
        else:
            self._opaque(n, ins)

    def _opaque(self, n, ins):
        if 1 <= len(ins) <= 4:
            key = self.opaque((n.op, _attr_key(n.attrs)))
            self.opaque_attrs[key] = (n.op, n.attrs)
            self.rows[f"NOp{len(ins)}"].append((n.id, key, *ins))
        else:
            self.rows["NLeaf"].append((n.id,))

    def _perm_facts(self, n):
        perm = tuple(n.attrs["perm"])
        if perm == tuple(range(len(perm))):
            self.rows["NIdentityPerm"].append((rules.perm_code(perm),))
        src = self.graph[n.inputs[0]]
        if src.op == "transpose":
            inner = tuple(src.attrs["perm"])
            both = tuple(inner[j] for j in perm)
            self.rows["NPermCompose"].append((rules.perm_code(inner), rules.perm_code(perm), rules.perm_code(both)))
            if both == tuple(range(len(both))):
                self.rows["NIdentityPerm"].append((rules.perm_code(both),))

    def _head_facts(self, n):
        src = self.graph[n.inputs[0]].shape
        out = n.shape
        if len(src) == 3 and len(out) == 4 and src[:2] == out[:2] and out[2] * out[3] == src[2]:
            self.rows["NHeadSplit"].append((n.id, out[2]))
        if len(src) == 4 and len(out) == 3 and src[:2] == out[:2] and src[2] * src[3] == out[2]:
            self.rows["NHeadMerge"].append((n.id,))


def _is_causal_mask(value) -> bool:
    if value is None or value.ndim < 2 or value.shape[-1] != value.shape[-2] or value.dtype.kind != "f":
        return False
    if any(d != 1 for d in value.shape[:-2]):
        return False
    sq = value.reshape(value.shape[-2:]).astype(np.float64)
    upper = np.triu(np.ones(sq.shape, dtype=bool), 1)
    return bool(np.all(sq[~upper] == 0) and np.all(sq[upper] <= -1e9))


# ---------------------------------------------------------------- saturation

def _fmt(v) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def load(tr: Translation) -> EGraph:
    eg = EGraph()
    cmds = []
    with tempfile.TemporaryDirectory(prefix="meganeura-egglog-") as tmp:
        for name, rows_ in tr.rows.items():
            path = os.path.join(tmp, name + ".tsv")
            with open(path, "w") as fh:
                fh.write("".join("\t".join(_fmt(v) for v in r) + "\n" for r in rows_))
            cmds.append((rules.RELATIONS[name], path))
        # running the (still empty) build ruleset declares the sort and the relations
        eg.run(1, ruleset=rules.BUILD)
        text = "".join(f'(input {eg._callable_to_egg(rel)[1]} "{path}")' for rel, path in cmds)
        eg._egraph.run_program(*eg._egraph.parse_program(text))
    eg.run(1, ruleset=rules.BUILD)
    return eg


def saturate(eg: EGraph, max_iterations: int, node_limit: int, time_limit: float):
    """Run every rule, one iteration at a time, until nothing changes or a limit is hit."""
    combined = unstable_combine_rulesets(*rules.egglog_rulesets(), name="fusion")
    matches: dict[str, int] = defaultdict(int)
    start = time.perf_counter()
    stop, iterations = "iteration_limit", 0
    size = 0
    for iterations in range(1, max_iterations + 1):
        rep = eg.run(1, ruleset=combined)
        for decl, count in rep.num_matches_per_rule.items():
            if decl in rules.RULE_OF_DECL:
                matches[rules.RULE_OF_DECL[decl]] += count
        size = sum(n for _, n in eg.all_function_sizes())
        if not rep.updated:
            stop = "saturated"
            break
        if size > node_limit:
            stop = "node_limit"
            break
        if time.perf_counter() - start > time_limit:
            stop = "time_limit"
            break
    return stop, iterations, size, dict(matches)


# ---------------------------------------------------------------- extraction

class ENode:
    __slots__ = ("ctor", "args", "cls")

    def __init__(self, ctor, args, cls):
        self.ctor, self.args, self.cls = ctor, args, cls

    def children(self):
        return [a for kind, a in self.args if kind == "c"]


def free(eg) -> None:
    """Free egglog's native e-graph now, on this thread. It is "unsendable": dropped on
    another thread it panics. Its Python state sits in reference cycles (closures of the
    functions egglog made), so it would be freed by whichever thread's collection found
    it: the Studio's GUI thread. Dropping the state's reference to the native object
    frees it here; where egglog keeps it elsewhere, a collection on this thread does
    (which also finalizes other threads' garbage: on the Studio's worker that deadlocked
    against the main thread, hence not by default)."""
    state = getattr(eg, "_state", None)
    if state is not None and hasattr(state, "egraph"):
        state.egraph = None
    else:
        gc.collect()


def read_egraph(eg: EGraph):
    """The serialized e-graph as {class: [ENode]} and {class: [original node ids]}."""
    data = json.loads(eg._serialize(split_primitive_outputs=False).to_json())
    nodes = data["nodes"]
    classes: dict[str, list[ENode]] = defaultdict(list)
    refs: dict[str, list[int]] = defaultdict(list)
    for nd in nodes.values():
        op = nd["op"]
        if not op.startswith("T."):
            continue
        args = []
        for ch in nd["children"]:
            c = nodes[ch]
            if ch.startswith("primitive-"):
                args.append(("v", float(c["op"]) if c["eclass"].startswith("f64") else int(c["op"])))
            else:
                args.append(("c", c["eclass"]))
        ctor = op[2:]
        if ctor == "ref":
            refs[nd["eclass"]].append(args[0][1])
        else:
            classes[nd["eclass"]].append(ENode(ctor, args, nd["eclass"]))
    return classes, refs


class Extractor:
    """Pick one e-node per e-class minimising bytes moved; lower e-nodes to graph ops."""

    def __init__(self, tr: Translation, classes, refs):
        self.tr, self.classes, self.refs = tr, classes, refs
        self.class_of = {}
        for cls, ids in refs.items():
            for i in ids:
                self.class_of[i] = cls
        self.absent = {c for c, ens in classes.items() if any(e.ctor == "absent" for e in ens)}
        self.type: dict[str, TensorType] = {}
        self.choice: dict[str, tuple] = {}     # class -> (ENode, op, attrs, child classes)
        self.cost: dict[str, int] = {}

    def class_of_node(self, node_id: int) -> str:
        return self.class_of[self.tr.rep[node_id]]

    def private(self, cls) -> bool:
        """Read by a single node: its cost belongs to that reader alone."""
        ids = self.refs.get(cls)
        return not ids or sum(self.tr.uses.get(i, 0) for i in ids) <= 1

    def operand_classes(self, en: ENode) -> set[str]:
        """The e-classes an e-node reads: its children, or for the leaf of a computed node
        (an op with more operands than the opaque terms take) that node's operands."""
        if en.ctor == "leaf":
            node = self.tr.graph[en.args[0][1]]
            return set() if node.op in SOURCES else {self.class_of_node(i) for i in node.inputs}
        return set(en.children())

    def lower(self, en: ENode):
        """(op, attrs, operand classes) of an e-node; None for handles with no op."""
        a = en.args
        v = [x for _, x in a]
        c = lambda i: v[i]   # noqa: E731
        k = en.ctor
        if k == "leaf":
            node = self.tr.graph[v[0]]
            if node.op in SOURCES:
                return ("source", {"node": node.id}, [])
            return (node.op, node.attrs, [self.class_of_node(i) for i in node.inputs])
        if k == "scalar":
            return ("scalar", {"value": v[0]}, [])
        if k == "unary":
            name = _UNARY_NAME[v[0]]
            if name.startswith("gelu"):
                return ("gelu", {"approximate": "tanh" if name == "gelu_tanh" else "none"}, [c(1)])
            return (name, {}, [c(1)])
        if k == "binary":
            return (_BINARY_NAME[v[0]], {}, [c(1), c(2)])
        if k in ("bias_add", "swiglu"):
            return (k, {}, [c(0), c(1)])
        if k in ("softmax", "log_softmax"):
            return (k, {}, [c(0)])
        if k == "pow":
            return ("pow", {"exponent": v[1]}, [c(0)])
        if k == "reduce":
            return (_REDUCE_NAME[v[0]], {"axis": -1 if v[2] == AXIS_LAST else None, "keepdims": bool(v[3])},
                    [c(1)])
        if k == "matmul":
            return ("matmul", {"transpose_a": bool(v[2]), "transpose_b": bool(v[3])}, [c(0), c(1)])
        if k == "fused_matmul":
            extra = [x for x in (v[5], v[6]) if x not in self.absent]
            return ("fused_matmul", {"transpose_a": bool(v[2]), "transpose_b": bool(v[3]),
                                     "activation": _ACT_NAME[v[4]], "has_add": v[5] not in self.absent,
                                     "has_residual": v[6] not in self.absent}, [v[0], v[1], *extra])
        if k == "layer_norm":
            return ("layer_norm", {"eps": v[3]}, [c(0), c(1), c(2)])
        if k == "rms_norm":
            return ("rms_norm", {"eps": v[2]}, [c(0), c(1)])
        if k == "norm_matmul":
            return ("norm_matmul", {"eps": v[3], "transpose_b": bool(v[4])}, [c(0), c(1), c(2)])
        if k == "group_norm":
            return ("group_norm", {"num_groups": v[3], "eps": v[4], "activation": _ACT_NAME[v[5]]},
                    [c(0), c(1), c(2)])
        if k == "attention":
            return ("attention", {"num_heads": v[3], "num_kv_heads": None if v[4] == v[3] else v[4],
                                  "causal": bool(v[5]), "scale": v[6]}, [c(0), c(1), c(2)])
        if k == "transpose":
            return ("transpose", {"perm": _perm_decode(v[1])}, [c(0)])
        if k == "reshape":
            return ("reshape", {"shape": self.tr.shapes.values[v[1]]}, [c(0)])
        if k.startswith("op"):
            op, attrs = self.tr.opaque_attrs[v[0]]
            return (op, attrs, v[1:])
        return None   # absent

    def _type(self, op, attrs, kids):
        if op == "source":
            n = self.tr.graph[attrs["node"]]
            return TensorType(n.shape, n.dtype)
        if op == "scalar":
            return TensorType(())
        full = {key: _canon(attrs.get(key, d)) for key, d in OPS[op].attrs.items()}
        return OPS[op].shape([self.type[k] for k in kids], full)

    def _local(self, op, kids, out: TensorType) -> int:
        if op in ("source", "scalar"):
            return 0
        nbytes = cost.node_bytes(op, [self.type[k].shape for k in kids], out.shape, kids)
        return nbytes * 64 + (8 if cost.is_dispatch(op) else 0) + 1

    def run(self):
        """Knuth's generalised Dijkstra: an e-node becomes a candidate once all its
        operand classes are settled; the cheapest candidate settles its class. Cost is
        local bytes + private operands' costs + the largest shared operand's cost."""
        parents = defaultdict(list)
        pending = {}
        heap = []
        counter = 0
        for cls, ens in self.classes.items():
            for en in ens:
                kids = self.operand_classes(en)
                pending[id(en)] = len(kids)
                for ch in kids:
                    parents[ch].append(en)
                if not kids:
                    counter = self._push(heap, en, counter)
        while heap:
            c_, _, cls, en, lowered, ty = heapq.heappop(heap)
            if cls in self.cost:
                continue
            self.cost[cls], self.type[cls], self.choice[cls] = c_, ty, (en, *lowered)
            for p in parents[cls]:
                pending[id(p)] -= 1
                if pending[id(p)] == 0 and p.cls not in self.cost:
                    counter = self._push(heap, p, counter)

    def _push(self, heap, en, counter):
        lowered = self.lower(en)
        if lowered is None:
            heapq.heappush(heap, (0, counter, en.cls, en, ("absent", {}, []), None))
            return counter + 1
        op, attrs, kids = lowered
        if any(k in self.absent for k in kids):
            return counter
        try:
            ty = self._type(op, attrs, kids)
        except (OpShapeError, KeyError, TypeError):
            return counter   # a term whose shapes do not fit is never chosen
        total = self._local(op, kids, ty)
        shared = 0
        for k in set(kids):
            if self.private(k):
                total += self.cost[k]
            else:
                shared = max(shared, self.cost[k])
        heapq.heappush(heap, (total + shared, counter, en.cls, en, lowered, ty))
        return counter + 1


def _perm_decode(code: int) -> tuple[int, ...]:
    digits = []
    while code >= 16:
        digits.append(code % 16)
        code //= 16
    rank = code
    return tuple(reversed(digits[:rank]))


# ---------------------------------------------------------------- rebuild

def rebuild(graph: Graph, ex: Extractor) -> tuple[Graph, dict[int, str]]:
    """The extracted Graph (sources first, in their original order; shapes re-derived by
    Graph.apply) and, for each new node, the e-class it came from."""
    g = Graph(graph.name)
    made: dict[str, int] = {}
    class_of_new: dict[int, str] = {}
    for n in graph.nodes:
        if n.op not in SOURCES:
            continue
        if n.op == "input":
            nid = g.input(n.name, n.shape, n.dtype)
        elif n.op == "parameter":
            meta = graph.param_meta[n.name]
            nid = g.parameter(n.name, n.shape, meta.get("init"), meta.get("trainable", True), meta.get("decay"))
            g.param_meta[n.name] = dict(meta)
        else:
            nid = g.constant(graph.constants[n.id], name=n.name)
        cls = ex.class_of_node(n.id)
        made.setdefault(cls, nid)
        class_of_new[nid] = cls
    names = {}
    for n in graph.nodes:
        if n.name and n.op not in SOURCES:
            names.setdefault(ex.class_of_node(n.id), n.name)
    roots = [ex.class_of_node(o) for o in graph.outputs.values()]
    for root in roots:
        stack = [(root, False)]
        while stack:
            cls, expanded = stack.pop()
            if cls in made:
                continue
            _, op, attrs, kids = ex.choice[cls]
            if not expanded:
                stack.append((cls, True))
                stack.extend((k, False) for k in kids if k not in made)
                continue
            if op == "scalar":
                nid = g.constant(np.float32(attrs["value"]))
            else:
                nid = g.apply(op, *[made[k] for k in kids], name=names.get(cls), **attrs)
            made[cls] = nid
            class_of_new[nid] = cls
    for name, o in graph.outputs.items():
        g.output(name, made[ex.class_of_node(o)])
    return g, class_of_new


def origins(graph: Graph, ex: Extractor, class_of_new: dict[int, str]) -> dict[int, list[int]]:
    """For each new node, the original nodes it replaced: those of its e-class, and
    behind them every original node whose e-class did not survive on its own."""
    kept = set(class_of_new.values())
    members = defaultdict(list)
    for n in graph.nodes:
        members[ex.class_of_node(n.id)].append(n.id)
    out = {}
    for nid, cls in class_of_new.items():
        seen, stack = set(), list(members[cls])
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            for j in graph[i].inputs:
                cj = ex.class_of_node(j)
                if cj not in kept:
                    stack.extend(members[cj])
        out[nid] = sorted(seen)
    return out
