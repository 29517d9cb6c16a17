"""The ``pointwise_dag`` rule: elementwise chains and small DAGs -> one pointwise node.

Grouping elementwise ops is a partition of the graph rather than a local rewrite, so it
runs as a graph pass after extraction (rules.py names it; the report counts it). An
elementwise node joins its reader's group when that reader is elementwise too and is its
only reader (and it is not a graph output): nothing is computed twice and no
intermediate has to stay in memory. 0-d float constants become literals of the program.
"""

from __future__ import annotations

from ..graph.ir import Graph
from ..graph.ops import OPS

MAX_GROUP = 64


def fusible(g: Graph, node) -> bool:
    """An f32 elementwise node of f32 operands (a pointwise program reads f32 values)."""
    return (OPS[node.op].elementwise and node.dtype == "f32"
            and all(g[i].dtype == "f32" for i in node.inputs)
            and node.op not in ("pointwise", "stop_gradient"))


def find_groups(g: Graph) -> dict[int, list[int]]:
    """root id -> member ids (ascending, root last) for groups of two or more nodes."""
    users = [set(u) for u in g.users()]
    outputs = set(g.outputs.values())
    owner: dict[int, int] = {}
    groups: dict[int, list[int]] = {}
    for n in reversed(g.nodes):
        if not fusible(g, n):
            continue
        us = users[n.id]
        if n.id not in outputs and len(us) == 1:
            (u,) = us
            if u in owner and len(groups[owner[u]]) < MAX_GROUP:
                owner[n.id] = owner[u]
                groups[owner[u]].append(n.id)
                continue
        owner[n.id] = n.id
        groups[n.id] = [n.id]
    return {r: sorted(m) for r, m in groups.items() if len(m) > 1}


def _literal(g: Graph, i: int):
    c = g.constants.get(i)
    if c is not None and c.shape == () and c.dtype.kind == "f":
        return float(c)
    return None


def program_of(g: Graph, members: list[int]):
    """(program, external input ids) of a group."""
    index = {m: j for j, m in enumerate(members)}
    external = [i for m in members for i in g[m].inputs if i not in index]
    tensors = [i for i in dict.fromkeys(external) if _literal(g, i) is None]
    if not tensors:
        tensors = list(dict.fromkeys(external))[:1]
    slot = {i: k for k, i in enumerate(tensors)}
    program = []
    for m in members:
        node = g[m]
        args = []
        for i in node.inputs:
            if i in index:
                args.append(("t", index[i]))
            elif i in slot:
                args.append(("in", slot[i]))
            else:
                args.append(("c", _literal(g, i)))
        program.append((node.op, tuple(args), tuple(sorted(node.attrs.items()))))
    return tuple(program), tensors


def fuse_pointwise(g: Graph, origins: dict[int, list[int]]):
    """Returns (new graph, new origins, [(root id in g, members)] for the groups made)."""
    groups = find_groups(g)
    absorbed = {m for ms in groups.values() for m in ms[:-1]}
    out = Graph(g.name)
    out.param_meta = {k: dict(v) for k, v in g.param_meta.items()}
    remap, new_origins = {}, {}
    for n in g.nodes:
        if n.id in absorbed:
            continue
        if n.op in ("input", "parameter", "constant"):
            nid = out._append(n.op, (), _ttype(n), n.attrs, n.name)
            if n.id in g.constants:
                out.constants[nid] = g.constants[n.id]
            src = [n.id]
        elif n.id in groups:
            program, tensors = program_of(g, groups[n.id])
            nid = out.apply("pointwise", *[remap[i] for i in tensors], program=program, name=n.name)
            src = groups[n.id]
        else:
            nid = out.apply(n.op, *[remap[i] for i in n.inputs], name=n.name, **n.attrs)
            src = [n.id]
        remap[n.id] = nid
        new_origins[nid] = sorted({o for s in src for o in origins.get(s, [])})
    out.inputs = {k: remap[v] for k, v in g.inputs.items()}
    out.parameters = {k: remap[v] for k, v in g.parameters.items()}
    out.outputs = {k: remap[v] for k, v in g.outputs.items()}
    return out, new_origins, list(groups.items())


def _ttype(n):
    from ..graph.ops import TensorType
    return TensorType(n.shape, n.dtype)
