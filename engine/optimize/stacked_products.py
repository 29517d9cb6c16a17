"""Products of one input by several weights of one shape as one batched product.

A layer's q, k and v projections multiply one activation by three weights of the same
shape: three kernels, each too small to fill the GPU at whisper's width (a [12000, 384] x
[384, 384] product is 282 tiles of 128 x 128 for 132 multiprocessors: three waves, the
last a seventh full). Stacked, the weights [3, K, N] make one batched product with the
activation broadcast over the batch, 846 tiles, whose result [3, M, N] holds each product
whole, so zero-copy ``part`` views stand for them. Measured on the H100 (run 30's probe):
199 -> 131 us in f16, 503 -> 361 us in f32. The stack is a copy of the weights a step (and
of the biases, zeros where a product has none), a few microseconds.

In a training graph the backward sums the shared input's gradient over the products,
dq @ wqᵀ + dk @ wkᵀ + dv @ wvᵀ (one ``fused_matmul`` adding the others in its epilogue);
that sum becomes one product over the gradients side by side and the weights stacked
along K (270 -> 125 us in f16, plus the gradients' concat). That concat [dq | dk | dv]
also makes the weights' gradients one product, xᵀ [dq | dk | dv] (three products over
K = 12000 rows at batch 8, 79 us each in f16, too small for the GPU alone), whose rows
are each weight's gradient transposed (a copy puts them back where the weights are
[in, out]), and the biases' gradients one sum over its rows (which the weights' product
computes as it reads the gradients: engine/codegen/product_sums.py), even where a product
has no bias (whisper's k projection: its columns are summed for nothing).
The plan computes those results right where the optimizer reads the gradients.

Run after ``optimize`` on inference graphs and after autodiff on training graphs (the
products' gradients are built by then from the products themselves); decode steps (rows
of a few tokens) are the few-row pass's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..graph.ir import Graph, Node
from ..graph.ops import PART_ALIGN, TensorType

MIN_ROWS = 64   # fewer rows: the vector kernels' (engine.optimize.few_rows), not the tiles'


def _epilogue_adds_only(n: Node) -> bool:
    """A ``fused_matmul`` whose epilogue at most adds a tensor: no activation, residual or
    activation gradient, so that its product can be stacked with others."""
    return n.attrs["activation"] == "none" and not n.attrs["has_residual"] and n.attrs["gradient_of"] == "none"


def _weights(graph: Graph, n: Node) -> tuple[int, int | None] | None:
    """(weight, bias or None) of a product this pass stacks: a plain product of a parameter,
    or one adding a parameter bias [N]; None for anything else."""
    if n.op == "matmul":
        bias = None
    elif n.op == "fused_matmul" and _epilogue_adds_only(n):
        bias = n.inputs[2] if n.attrs["has_add"] else None
    else:
        return None
    weight = graph[n.inputs[1]]
    if n.attrs["transpose_a"] or weight.op != "parameter" or len(weight.shape) != 2:
        return None
    if bias is not None and (graph[bias].op != "parameter" or graph[bias].shape != n.shape[-1:]):
        return None
    return weight.id, bias


def _groups(graph: Graph) -> list[list[int]]:
    found: dict[tuple, list[int]] = {}
    for n in graph.nodes:
        if _weights(graph, n) is None:
            continue
        rows = math.prod(n.shape[:-1])
        if rows < MIN_ROWS or rows * n.shape[-1] % PART_ALIGN:
            continue
        key = (n.inputs[0], n.attrs["transpose_b"], graph[n.inputs[1]].shape, n.shape)
        found.setdefault(key, []).append(n.id)
    return [ids for ids in found.values() if len(ids) > 1]


def _input_gradient_sums(graph: Graph, groups: list[list[int]]) -> dict[int, list[tuple[int, int]]]:
    """The backward's sums over a group's products of gradient @ weightᵀ, each found as
    one ``fused_matmul`` whose epilogue adds the other products (autodiff's input gradient
    of the stacked products' shared input, fused by ``optimize``): node -> [(gradient,
    weight)] of every product in the sum, in the order the forward stacks the weights,
    which the weights' gradients then take too: in the arena they lie as in the stack,
    which the plan then reads in place (engine.compile.plan, ``_concats_in_place``)."""
    users, outputs = graph.users(), set(graph.outputs.values())
    weights_of = {frozenset(_weights(graph, graph[i])[0] for i in ids): graph[ids[0]].attrs["transpose_b"]
                  for ids in groups}
    place = {_weights(graph, graph[i])[0]: j for ids in groups for j, i in enumerate(ids)}
    found = {}
    for n in graph.nodes:
        if not (n.op == "fused_matmul" and n.attrs["activation"] == n.attrs["gradient_of"] == "none"
                and n.attrs["has_add"] and not n.attrs["transpose_a"]):
            continue
        tb = n.attrs["transpose_b"]
        terms = [(n.inputs[0], n.inputs[1])]
        for extra in n.inputs[2:]:
            e = graph[extra]
            if e.op != "matmul" or e.attrs["transpose_a"] or e.attrs["transpose_b"] != tb \
                    or users[extra] != [n.id] or extra in outputs:
                break
            terms.append((e.inputs[0], e.inputs[1]))
        else:
            weights = frozenset(w for _, w in terms)
            if len(weights) == len(terms) and weights_of.get(weights) == (not tb) \
                    and len({graph[x].shape for x, _ in terms}) == 1:
                found[n.id] = sorted(terms, key=lambda term: place[term[1]])   # the forward stack's order
    return found


def _base(graph: Graph, nid: int) -> int:
    """The node ``nid`` views through reshapes."""
    while graph[nid].op == "reshape":
        nid = graph[nid].inputs[0]
    return nid


class ParameterGradients(NamedTuple):
    """The weight and bias gradients of the products in one input-gradient sum: ``x`` the
    products' shared input; ``weights`` term index -> its weight's gradient, xᵀ g (weights
    [in, out]) or, where ``outer_first``, gᵀ x (weights [out, in]); ``biases`` term index ->
    its bias's gradient, g summed over its rows. Merged, each is a part of one result,
    which the plan computes right in the gradient arena where the parts fill it exactly
    (engine.compile.plan); bias parts with a gap between them (a product without one)
    are copied there."""

    x: int
    weights: dict[int, int]
    outer_first: bool
    biases: dict[int, int]


def _parameter_gradients(graph: Graph, groups: list[list[int]],
                         sums: dict[int, list[tuple[int, int]]]) -> dict[int, ParameterGradients]:
    """Per input-gradient sum, the parameter gradients of its products (weights only when
    every term's is found, in one orientation)."""
    input_of = {_weights(graph, graph[i])[0]: graph[i].inputs[0] for ids in groups for i in ids}
    products: dict[tuple[int, int], int] = {}   # (what A views, what B views) -> an Aᵀ B product
    row_sums: dict[int, int] = {}               # tensor -> its sum over rows
    for n in graph.nodes:
        if n.op == "matmul" and n.attrs["transpose_a"] and not n.attrs["transpose_b"]:
            products[tuple(_base(graph, i) for i in n.inputs)] = n.id
        elif n.op == "sum_to" and n.shape == graph[n.inputs[0]].shape[-1:]:
            row_sums[n.inputs[0]] = n.id
    found = {}
    for sid, terms in sums.items():
        x = input_of[terms[0][1]]
        weights, orientation = {}, set()
        for i, (d, _) in enumerate(terms):
            for outer_first, pair in ((False, (x, d)), (True, (d, x))):
                if pair in products:
                    weights[i] = products[pair]
                    orientation.add(outer_first)
        biases = {i: row_sums[d] for i, (d, _) in enumerate(terms) if d in row_sums}
        width, k = graph[terms[0][0]].shape[-1], graph[x].shape[-1]
        if len(weights) != len(terms) or len(orientation) != 1 or width * k % PART_ALIGN:
            weights, orientation = {}, {False}
        if width % PART_ALIGN:
            biases = {}
        found[sid] = ParameterGradients(x, weights, orientation.pop(), biases)
    return found


def stack_products(graph: Graph) -> tuple[Graph, int, dict[int, int]]:
    """The graph with each group of products sharing their input and their weights' shape
    made by one batched product, and the backward's sum of their input gradients made by
    one product over the gradients side by side, as are their weights' gradients (their
    biases' one sum); returns it, how many products and gradients it merged and the
    old -> new node ids."""
    found = _groups(graph)
    groups = {ids[0]: ids for ids in found}
    sums = _input_gradient_sums(graph, found)
    if not groups:
        return graph, 0, graph.identity()
    dropped = {graph[n].inputs[j] for n in sums for j in range(2, len(graph[n].inputs))}
    gradients = _parameter_gradients(graph, found, sums)
    merged_at = {nid: sid for sid, p in gradients.items() for nid in [*p.weights.values(), *p.biases.values()]}
    side_by_side: dict[int, int] = {}
    merged: set[int] = set()       # sums whose parameter gradients are made by one product (and one sum)
    left_apart: set[int] = set()   # ... or stay as they were (they came before their terms)

    def gradients_side_by_side(g: Graph, sid: int, new: dict[int, int]) -> int:
        """[g_1 | g_2 | ...] of sum ``sid``'s terms, made once."""
        if sid not in side_by_side:
            with g.scope(graph[sid].modules):
                side_by_side[sid] = g.concat([new[d] for d, _ in sums[sid]], axis=-1)
        return side_by_side[sid]

    def parameter_gradients(g: Graph, sid: int, new: dict[int, int]) -> None:
        """Sum ``sid``'s products' weight gradients as one product and their bias gradients
        as one sum, each mapped in ``new`` to a part of those."""
        p = gradients[sid]
        grads = gradients_side_by_side(g, sid, new)
        width, count = graph[sums[sid][0][0]].shape[-1], len(sums[sid])
        if p.weights:
            k, rows = graph[p.x].shape[-1], math.prod(graph[p.x].shape[:-1])
            with g.scope([mod for nid in p.weights.values() for mod in graph[nid].modules]):
                made = g.matmul(g.reshape(grads, (rows, count * width)), g.reshape(new[p.x], (rows, k)),
                                transpose_a=True)         # row i * width + j: output j of weight i's gradient
                if not p.outer_first:
                    made = g.transpose(g.reshape(made, (count, width, k)), perm=(0, 2, 1))
            for i, nid in p.weights.items():
                new[nid] = g.apply("part", made, offset=i * width * k, shape=graph[nid].shape, name=graph[nid].name)
        if p.biases:
            with g.scope([mod for nid in p.biases.values() for mod in graph[nid].modules]):
                total = g.apply("sum_to", grads, shape=(count * width,))
            for i, nid in p.biases.items():
                new[nid] = g.apply("part", total, offset=i * width, shape=graph[nid].shape, name=graph[nid].name)

    def source(g: Graph, nid: int, new: dict[int, int]) -> int:
        """A parameter's node in ``g``, copied ahead of its place where the stack needs it first."""
        if nid not in new:
            n = graph[nid]
            new[nid] = g._append(n.op, (), TensorType(n.shape, n.dtype), n.attrs, n.name, n.modules)
        return new[nid]

    def input_gradient(g: Graph, n: Node, new: dict[int, int]) -> int:
        """sum of gradient_i @ weight_iᵀ as [gradient_1 | gradient_2 | ...] @ [weight_1; weight_2; ...]ᵀ."""
        terms, tb = sums[n.id], n.attrs["transpose_b"]
        grads = gradients_side_by_side(g, n.id, new)
        with g.scope(n.modules):
            weights = g.concat([source(g, w, new) for _, w in terms], axis=1 if tb else 0)
            made = g.matmul(grads, weights, transpose_b=tb, name=n.name)
        assert g.shape(made) == n.shape
        return made

    def merge_parameter_gradients(g: Graph, sid: int, new: dict[int, int]) -> None:
        """Sum ``sid``'s parameter gradients made now (each mapped in ``new``) if all they
        read is; else left as they are."""
        if sid in merged or sid in left_apart:
            return
        if all(d in new for d, _ in sums[sid]) and gradients[sid].x in new:
            parameter_gradients(g, sid, new)
            merged.add(sid)
        else:
            left_apart.add(sid)

    def stand_in(g: Graph, n: Node, new: dict[int, int]) -> int | None:
        if n.id in sums:
            made = input_gradient(g, n, new)
            if gradients[n.id].weights or gradients[n.id].biases:   # beside the other product reading the concat,
                merge_parameter_gradients(g, n.id, new)              # which then lives no longer than before
            return made
        if n.id in merged_at:
            merge_parameter_gradients(g, merged_at[n.id], new)
            return new[n.id] if merged_at[n.id] in merged else None
        if n.id not in groups:
            return None
        members = [graph[i] for i in groups[n.id]]
        pairs = [_weights(graph, m) for m in members]
        rows = math.prod(n.shape[:-1])
        k, width = graph[n.inputs[0]].shape[-1], n.shape[-1]
        with g.scope([mod for m in members for mod in m.modules]):
            weights = g.concat([g.reshape(source(g, w, new), (1,) + graph[w].shape) for w, _ in pairs], axis=0)
            x = g.reshape(new[n.inputs[0]], (rows, k))
            tb = n.attrs["transpose_b"]
            if any(b is not None for _, b in pairs):
                zeros = g.constant(np.zeros((1, 1, width), np.float32))
                biases = g.concat([zeros if b is None else g.reshape(source(g, b, new), (1, 1, width))
                                   for _, b in pairs], axis=0)
                stacked = g.apply("fused_matmul", x, weights, biases, transpose_b=tb, has_add=True)
            else:
                stacked = g.matmul(x, weights, transpose_b=tb)
        for i, m in enumerate(members):
            with g.scope(m.modules):
                new[m.id] = g.apply("part", stacked, offset=i * rows * width, shape=m.shape, name=m.name)
        return new[n.id]
    out, remap = graph.rebuild(keep=lambda n: n.id not in dropped, stand_in=stand_in)
    rewritten = sum(len(gradients[sid].weights) + len(gradients[sid].biases) for sid in merged)
    return out, sum(len(ids) for ids in groups.values()) + sum(len(t) for t in sums.values()) + rewritten, remap
