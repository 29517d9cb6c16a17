"""Weights kept in bf16 for generation (engine.optimize.bf16_weights): only where every value
is a bf16 value, read by the product kernels and the embedding gather as they are, by
other kernels through a widen; the results are the f32 weights' results, bit for bit."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from engine.arrays import bf16_bits, bf16_exact, contiguous
from engine.codegen import UnsupportedOpError, kernel_for, reads_bf16
from engine.codegen.matmul import vector_layout
from engine.errors import GraphError, ShapeError
from engine.graph import reference
from engine.graph.ir import Graph
from engine.importers.hf import load_checkpoint
from engine.optimize.bf16_weights import (bf16_candidates, direct_readers, keep_out_in, store_weights_bf16,
                                         transposable)
from engine.runtime.device import device_capabilities
from engine.runtime.session import Session
from engine.train.generation import Generator

from llama_checkpoint import llama_relative


def bf16_values(rng, *shape, scale=1.0) -> np.ndarray:
    """Random f32 values that bf16 holds exactly (the lower 16 bits zero)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)


def predicate(caps=None):
    caps = caps or device_capabilities()
    return lambda graph, node, i: reads_bf16(graph, node, i, caps)


def products_graph(k: int, n: int, rows: int = 2, qkv_widths=(70, 34, 34)) -> Graph:
    """Every vector product that reads a weight (plain with an epilogue, B transposed,
    SwiGLU's two, a norm's, norm_matmuls' three) and a product of 64 rows (a tiled kernel)."""
    g = Graph("bf16 products")
    x, nw = g.input("x", (1, rows, k)), g.input("nw", (k,))
    w, wt, wu = g.parameter("w", (k, n)), g.parameter("wt", (n, k)), g.parameter("wu", (k, n))
    qkv = [g.parameter(f"p{i}", (k, width)) for i, width in enumerate(qkv_widths)]
    g.output("fused", g.apply("fused_matmul", x, w, g.input("bias", (n,)), g.input("res", (1, rows, n)),
                              activation="gelu", has_add=True, has_residual=True))
    g.output("transposed", g.matmul(x, wt, transpose_b=True))
    g.output("swiglu", g.apply("swiglu_matmul", x, w, wu, nw, transpose_b=False, eps=1e-5))
    g.output("norm", g.apply("norm_matmul", x, nw, wt, eps=1e-5, transpose_b=True))
    g.output("packed", g.apply("norm_matmuls", x, nw, *qkv, transpose_b=False, eps=1e-5))
    g.output("tall", g.matmul(g.input("rows", (64, k)), w))
    return g


def run(graph, caps, inputs, params):
    session = Session(graph, capabilities=caps)
    session.set_inputs(inputs)
    session.set_parameters(params)
    session.run()
    return session, {name: session.read_output(name) for name in graph.outputs}


@pytest.mark.parametrize("splits", [1, 3])
def test_vector_products_read_bf16_weights_exactly(splits, configure):
    """The same outputs, bit for bit, from the weights stored in bf16 as from them in f32,
    whole and with K in 3 slices (matmul_splits.wgsl adding them), and the reference's."""
    configure(matmul_splits=splits)
    caps = device_capabilities()
    caps = dataclasses.replace(caps, tuning=dataclasses.replace(caps.tuning, vector_small_kib=1))
    rng = np.random.default_rng(splits)
    k, n = 1300, 70
    g = products_graph(k, n)
    inputs = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.inputs.items()}
    params = {name: bf16_values(rng, *g.shape(i)) for name, i in g.parameters.items()}
    stored, widened = store_weights_bf16(g, params, predicate(caps))
    assert widened == 0
    assert [stored[i].dtype for i in stored.parameters.values()] == ["bf16"] * 6
    assert Graph.from_dict(stored.to_dict()).structural_hash() == stored.structural_hash()   # as plans cache it
    session, got = run(stored, caps, inputs, params)
    _, want = run(g, caps, inputs, params)
    for name in g.outputs:
        assert np.array_equal(got[name], want[name]), name
    expected = reference.run(g, inputs, params)
    coop = any("cooperative" in d.variant for d in session.plan.dispatches)   # the tall product's, on Dawn
    for name in g.outputs:   # SwiGLU: silu of one sum times another (test_vector_products_split_along_k)
        bound = (5e-3 if name == "tall" and coop else 1e-5 if name == "swiglu" else 2e-6) * np.abs(expected[name]).max()
        assert np.abs(got[name] - expected[name]).max() <= bound, name
    assert "32 columns x 8 K slices, 3 weights" in next(d.variant for d in session.plan.dispatches
                                                        if d.kernel.startswith("norm_matmuls"))
    split = [d for d in session.plan.dispatches if "vector kernel" in d.variant and "K split" in d.variant]
    assert len(split) == (0 if splits == 1 else 4)   # norm_matmuls keeps K whole
    weights = {b.names[0]: b.nbytes for b in session.plan.buffers if b.kind == "parameter"}
    assert weights["w"] == -(-2 * k * n // 256) * 256
    assert session.get_parameter("wt").tobytes() == params["wt"].tobytes()


@pytest.mark.parametrize("n,splits", [(132, 1), (132, 3), (70, 3)])
def test_one_row_reads_four_bf16_columns_a_thread_exactly(n, splits, configure):
    """A decode step's products (one row) read bf16 weights four columns a thread, two
    words at once, where every B's columns come in fours (132: a last workgroup of 4
    columns past 128), else one (70); the f32 weights' results bit for bit, whole and
    with K in 3 slices (a tail of K too), and the reference's."""
    configure(matmul_splits=splits)
    caps = device_capabilities()
    caps = dataclasses.replace(caps, tuning=dataclasses.replace(caps.tuning, vector_small_kib=1))
    rng = np.random.default_rng(n + splits)
    k = 1300
    g = products_graph(k, n, rows=1, qkv_widths=(68, 36, 36) if n % 4 == 0 else (70, 34, 34))
    inputs = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.inputs.items()}
    params = {name: bf16_values(rng, *g.shape(i)) for name, i in g.parameters.items()}
    stored, _ = store_weights_bf16(g, params, predicate(caps))
    session, got = run(stored, caps, inputs, params)
    _, want = run(g, caps, inputs, params)
    expected = reference.run(g, inputs, params)
    for name in g.outputs:
        assert np.array_equal(got[name], want[name]), name
        if name != "tall":
            bound = (1e-5 if name == "swiglu" else 2e-6) * np.abs(expected[name]).max()
            assert np.abs(got[name] - expected[name]).max() <= bound, name
    vector = {d.kernel.split(":")[0]: d.variant for d in session.plan.dispatches if "vector kernel" in d.variant}
    wide = {op for op, variant in vector.items() if "4 columns a thread" in variant}
    assert wide == ({"fused_matmul", "swiglu_matmul", "norm_matmuls"} if n % 4 == 0 else set())
    assert "matmul" not in wide   # B transposed (its rows contiguous): one column a thread
    fused = next(d for d in session.plan.dispatches if d.kernel.startswith("fused_matmul") and "vector" in d.variant)
    assert fused.workgroups[0] == -(-n // (128 if n % 4 == 0 else 32))   # 32 threads a row of the workgroup


@pytest.mark.parametrize("columns", [1, 2, 4])
def test_weights_kept_out_in_are_read_four_k_steps_a_load(columns):
    """Weights kept [out, in] (``keep_out_in`` of those ``transposable``: read only as
    products' Bs): each product reads them with transpose_b, a thread four K steps a load
    (and ``columns`` columns, ``tuning.vector_deep_columns``); in bf16 the same results as
    in f32, bit for bit, and the reference's to f32 rounding, given the weights transposed
    (the session uploads a transpose's bf16 bits, then puts them in row order)."""
    caps = device_capabilities()
    caps = dataclasses.replace(caps, tuning=dataclasses.replace(caps.tuning, vector_small_kib=1,
                                                                vector_deep_columns=columns))
    rng = np.random.default_rng(5 + columns)
    k, n = 1300, 72
    g = products_graph(k, n, rows=1, qkv_widths=(68, 36, 36))
    inputs = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.inputs.items()}
    params = {name: bf16_values(rng, *g.shape(i)) for name, i in g.parameters.items()}
    names = transposable(g, params)
    assert names == {"w", "wu", "p0", "p1", "p2"}   # wt is read transposed already
    kept = keep_out_in(g, names)
    assert kept.shape(kept.parameters["w"]) == (n, k) and kept.param_meta == g.param_meta
    assert all(kept[i].attrs["transpose_b"] for i in kept.outputs.values() if i != kept.outputs["transposed"])
    given = {name: value.T if name in names else value for name, value in params.items()}
    expected = reference.run(g, inputs, params)
    assert all(np.allclose(expected[name], out, rtol=1e-5, atol=1e-5 * np.abs(out).max())
               for name, out in reference.run(kept, inputs, given).items())
    got = {}
    for dtype, bf16 in (("f32", set()), ("bf16", set(params))):
        stored, _ = store_weights_bf16(kept, bf16, predicate(caps))
        session, got[dtype] = run(stored, caps, inputs, given)
        vector = [d.variant for d in session.plan.dispatches if "vector kernel" in d.variant]
        assert len(vector) == 5 and all("4 K steps a load" in v for v in vector), vector   # 9-18 blocks: K split
        assert all((f"{columns} columns a thread" in v) == (columns > 1) for v in vector), vector
        assert session.get_parameter("w").tobytes() == np.ascontiguousarray(params["w"].T).tobytes()
        with pytest.raises(ShapeError, match=r"parameter 'w': expected shape \[72, 1300\], found \[1300, 72\]"):
            session.set_parameter("w", params["w"])
    coop = any("cooperative" in d.variant for d in session.plan.dispatches)   # the tall product's, on Dawn
    for name in g.outputs:
        assert np.array_equal(got["bf16"][name], got["f32"][name]), name
        bound = (5e-3 if name == "tall" and coop else 1e-5 if name == "swiglu" else 2e-6) * np.abs(expected[name]).max()
        assert np.abs(got["bf16"][name] - expected[name]).max() <= bound, name
    if columns > 1:
        return
    llama = device_capabilities()   # Llama-3.2-1B's 2048 x 2048: K whole kept [out, in], split 8 ways [in, out]
    assert vector_layout(2048, 2048, 1, llama, False, True, 1, 4) == (8, 1)
    assert vector_layout(2048, 2048, 1, llama, True, True, 4, 1) == (32, 8)


def test_only_weights_that_products_alone_read_as_b_are_kept_out_in():
    """Not a weight a product reads transposed already, nor one another op reads too, nor
    the other weights of a product that reads such a one (its Bs share one transpose_b);
    ``keep_out_in`` refuses any other."""
    g = Graph("layouts")
    x, nw = g.input("x", (1, 8)), g.input("nw", (8,))
    a, b, c, d, e = (g.parameter(name, (8, 8)) for name in "abcde")
    g.output("a", g.matmul(x, a))
    g.output("b", g.matmul(x, b, transpose_b=True))
    g.output("c", g.add(g.matmul(x, c), g.exp(c)))
    g.output("de", g.apply("swiglu_matmul", x, d, e, nw, transpose_b=False, eps=1e-5))
    assert transposable(g, "abcde") == {"a", "d", "e"}
    kept = keep_out_in(g, {"a", "d", "e"})
    product_of_c = kept[kept[kept.outputs["c"]].inputs[0]]
    assert kept[kept.outputs["de"]].attrs["transpose_b"] and kept[kept.outputs["a"]].attrs["transpose_b"]
    assert not product_of_c.attrs["transpose_b"] and kept[kept.outputs["b"]].attrs["transpose_b"]   # as they were
    for refused in ("b", "c", "d"):   # d alone: its swiglu's other B is not kept
        with pytest.raises(GraphError, match="not every reader"):
            keep_out_in(g, {refused})
    g.output("e", g.exp(e))
    assert transposable(g, "abcde") == {"a"}


@pytest.mark.parametrize("kernel", ["auto", "simple", "64", "128k8u"])
def test_tiled_products_read_bf16_weights_exactly(kernel, configure):
    """A prefill's products (more rows than the vector kernel takes) read their weights in
    bf16 on every kernel, each way of fetching B (columns one at a time or four as two
    words, a transposed B four along K), edge tiles included, and give the f32 weights'
    results bit for bit, with no widen. ``auto`` is the cooperative kernels where the
    adapter has them (Dawn: f16, or f32 as three f16 products)."""
    configure(matmul=kernel)
    rng = np.random.default_rng(len(kernel))
    k = 200
    g = Graph("bf16 tiled products")
    rows = g.input("rows", (2, 37, k))
    w, w4, wt = g.parameter("w", (k, 70)), g.parameter("w4", (k, 64)), g.parameter("wt", (72, k))
    g.output("scalar", g.apply("fused_matmul", rows, w, g.input("res", (2, 37, 70)), activation="none",
                               has_residual=True))
    g.output("vec4", g.matmul(rows, w4))
    g.output("transposed", g.matmul(rows, wt, transpose_b=True))
    g.output("norm", g.apply("norm_matmul", rows, g.input("nw", (k,)), wt, eps=1e-5, transpose_b=True))
    inputs = {name: rng.standard_normal(g.shape(i)).astype(np.float32) for name, i in g.inputs.items()}
    params = {name: bf16_values(rng, *g.shape(i)) for name, i in g.parameters.items()}
    stored, widened = store_weights_bf16(g, params, predicate())
    assert widened == 0 and all(stored[i].dtype == "bf16" for i in stored.parameters.values())
    session, got = run(stored, None, inputs, params)
    _, want = run(g, None, inputs, params)
    for name in g.outputs:
        assert np.array_equal(got[name], want[name]), name
    variants = {d.variant for d in session.plan.dispatches if "matmul" in d.kernel}
    assert not any("vector" in v for v in variants), variants
    fetches = " ".join(variants)
    if kernel not in ("auto", "simple"):
        assert all(f in fetches for f in ("B outer-scalar", "B outer-vec4", "B k-vec4")), variants


def test_copies_and_stacked_weights_read_bf16_exactly():
    """A prefill stacks its k and v weights (engine.optimize.stacked_products): reshapes of
    the weights, their concat, a batched product. The reshapes stay bf16 (views), the
    concat widens as it copies (never placed over the weights' words in place), and so do
    a transpose and a slice; no widen, the f32 weights' results bit for bit."""
    rng = np.random.default_rng(7)
    k, n = 64, 48
    g = Graph("stacked")
    x = g.input("x", (1, 70, k))
    wk, wv = g.parameter("wk", (k, n)), g.parameter("wv", (k, n))
    stack = g.apply("concat", g.reshape(wk, (1, k, n)), g.reshape(wv, (1, k, n)), axis=0)
    g.output("kv", g.matmul(x, stack))   # x broadcast over the two
    g.output("t", g.transpose(wk, (1, 0)))
    g.output("s", g.apply("slice", wv, axis=1, start=3, stop=40))
    inputs = {"x": rng.standard_normal((1, 70, k)).astype(np.float32)}
    params = {name: bf16_values(rng, k, n) for name in ("wk", "wv")}
    stored, widened = store_weights_bf16(g, params, predicate())
    assert widened == 0
    assert [stored[i].dtype for i in stored[stored.outputs["kv"]].inputs] == ["f32", "f32"]
    assert {stored[i].dtype for i in stored[stored.outputs["kv"]].inputs[1:] for i in stored[i].inputs} == {"bf16"}
    session, got = run(stored, None, inputs, params)
    _, want = run(g, None, inputs, params)
    for name in g.outputs:
        assert np.array_equal(got[name], want[name]), name
    assert direct_readers(g, {"wk", "wv"}, predicate()) == {"wk", "wv"}


def test_kernels_that_read_f32_refuse_a_bf16_operand():
    """An elementwise op: codegen names the operand rather than read its words as floats."""
    g = Graph("refused")
    w = g.parameter("w", (8, 16), dtype="bf16")
    g.output("t", g.add(w, g.input("x", (8, 16))))
    caps = device_capabilities()
    node = g[g.outputs["t"]]
    assert not reads_bf16(g, node, node.inputs.index(w), caps)
    with pytest.raises(UnsupportedOpError, match="stored as bf16; widen it first"):
        kernel_for(g, node, caps)


def test_only_exact_matrices_are_candidates_and_a_decode_keeps_widened_ones_in_f32():
    rng = np.random.default_rng(0)
    exact = bf16_values(rng, 4, 6)
    rounded = exact.copy()
    rounded[2, 3] = np.float32(1.0) + np.float32(2.0 ** -10)   # one value bf16 cannot hold
    params = {"exact": exact, "rounded": rounded, "vector": bf16_values(rng, 6), "odd": bf16_values(rng, 3, 5)}
    assert bf16_candidates(params) == {"exact"}
    g = Graph("readers")
    x = g.input("x", (1, 4))
    a, b = g.parameter("a", (4, 6)), g.parameter("b", (4, 6))
    g.output("y", g.add(g.matmul(x, a), g.matmul(g.input("rows", (64, 4)), b)))
    g.output("t", g.exp(b))
    assert direct_readers(g, {"a", "b"}, predicate()) == {"a"}   # b's exp would read a widen


def test_a_transposed_value_is_uploaded_in_row_order():
    """A weight given as a transpose (generation's, kept [out, in]): its bf16 bits are
    taken in its own order and copied into row order, on several threads when large."""
    value = bf16_values(np.random.default_rng(3), 1100, 1024)   # over PARALLEL_ELEMENTS
    assert contiguous(value.T).flags.c_contiguous and np.array_equal(contiguous(value.T), value.T)
    assert bf16_exact(value.T) and np.array_equal(bf16_bits(value.T), bf16_bits(np.ascontiguousarray(value.T)))
    g = Graph("transposed upload")
    w = g.parameter("w", (1024, 1100), dtype="bf16")
    g.output("y", g.matmul(g.input("x", (1, 1024)), w))
    session = Session(g)
    session.set_parameter("w", value.T)
    assert session.get_parameter("w").tobytes() == np.ascontiguousarray(value.T).tobytes()


def test_a_bf16_parameter_takes_bf16_values_only():
    g = Graph("upload")
    w = g.parameter("w", (4, 6), dtype="bf16")
    g.output("y", g.matmul(g.input("x", (1, 4)), w))
    session = Session(g)
    with pytest.raises(ShapeError, match="'w' is stored as bf16, but its values are not all bf16 values"):
        session.set_parameter("w", np.full((4, 6), 0.1, np.float32))
    value = bf16_values(np.random.default_rng(1), 4, 6)
    session.set_parameter("w", value)
    assert session.get_parameter("w").tobytes() == value.tobytes()


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    """A tiny Llama saved in bf16, as most checkpoints on the Hub are."""
    import torch
    path = tmp_path_factory.mktemp("bf16-llama")
    llama_relative("Llama", 3, tie_word_embeddings=True, max_position_embeddings=128).to(torch.bfloat16) \
        .save_pretrained(path)
    return load_checkpoint(path, {})


def test_a_bf16_checkpoint_generates_as_in_f32_bit_for_bit(bf16_llama, configure):
    """Its weights stay bf16 on the GPU (half the bytes), and the logits of a prefill and of
    decode steps, and greedy ids, equal those of the same weights in f32."""
    model = bf16_llama
    params = model.init_params()
    prompt = [3, 17, 9, 44, 101, 5, 60] * 10 + [1, 2]   # a prefill of tiled products, k and v stacked
    results = {}
    for kept in (True, False):
        configure(bf16_weights=kept)
        generator = Generator(model, params)
        steps = generator.steps(generator.check(prompt, 6))
        logits = [steps.run(prompt, 0, prefill=True)] + [steps.run([t], len(prompt) + j, prefill=False)
                                                         for j, t in enumerate((7, 8, 9))]
        weight_bytes = sum(b.nbytes for b in steps.decode.plan.buffers if b.kind == "parameter")
        prefill = steps.session(len(prompt), prefill=True)
        assert not any(n.op == "widen" for n in prefill.graph.nodes)
        assert any(n.op == "concat" and prefill.graph[n.inputs[0]].op == "reshape" for n in prefill.graph.nodes)
        coop = any("cooperative" in d.variant for d in prefill.plan.dispatches)   # f16 products (Dawn)
        results[kept] = logits, generator.generate(prompt, 6).tokens, weight_bytes, steps.bf16
    (logits, ids, nbytes, kept), (logits32, ids32, nbytes32, none) = results[True], results[False]
    matrices = {name for name, value in params.items() if value.ndim == 2}
    assert kept == matrices and not none
    assert all(np.array_equal(a, b) for a, b in zip(logits, logits32))
    assert ids == ids32
    assert nbytes32 - nbytes >= 0.9 * sum(2 * params[name].size for name in kept)   # half of each kept
    expected = Generator(model, params, backend="reference").steps(256).run(prompt, 0, prefill=True)
    assert np.abs(logits[0] - expected).max() <= (5e-3 if coop else 1e-4) * np.abs(expected).max()


def test_generation_keeps_linear_weights_out_in(bf16_llama, configure):
    """A checkpoint's linear weights stay [out, in] on the GPU (not the tied embedding, which
    a gather reads too), in the decode step and the prefill alike, which stacks its k and v
    weights as they are kept. Against the weights kept [in, out]
    (MEGANEURA_WEIGHT_LAYOUT=in-out), a decode step's sums go in another order: the logits
    to f32 rounding, the same greedy ids."""
    model = bf16_llama
    params = model.init_params()
    prompt = [3, 17, 9, 44, 101, 5, 60] * 10 + [1, 2]
    results = {}
    for layout in ("out-in", "in-out"):
        configure(weight_layout=layout)
        generator = Generator(model, params)
        steps = generator.steps(generator.check(prompt, 6))
        logits = [steps.run(prompt, 0, prefill=True)] + [steps.run([t], len(prompt) + j, prefill=False)
                                                         for j, t in enumerate((7, 8, 9))]
        prefill = steps.session(len(prompt), prefill=True).graph
        stacks = [n.shape for n in prefill.nodes if n.op == "concat" and prefill[n.inputs[0]].op == "reshape"]
        assert not any(n.op == "transpose" and n.inputs[0] in prefill.parameters.values() for n in prefill.nodes)
        shapes = {name: steps.decode.graph.shape(i) for name, i in steps.decode.graph.parameters.items()}
        results[layout] = logits, generator.generate(prompt, 6).tokens, steps.transposed, stacks, shapes
    (logits, ids, kept, stacks, shapes), (logits_io, ids_io, none, stacks_io, shapes_io) = (results["out-in"],
                                                                                            results["in-out"])
    layers = {name for name, value in params.items() if value.ndim == 2 and "layers." in name}
    assert kept == layers and not none
    assert all(shapes[name] == params[name].shape[::-1] for name in layers)
    assert all(shapes_io[name] == params[name].shape for name in layers)
    assert stacks == [(2, 16, 32)] * 2 and stacks_io == [(2, 32, 16)] * 2   # k and v, [out, in] and [in, out]
    for a, b in zip(logits, logits_io):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    assert ids == ids_io


def test_a_checkpoint_opens_without_copies_and_uploads_its_file_layout(bf16_llama, configure):
    """The importer binds the file's tensors as they were read: its [out, in] linear weights
    as transposed views (a 1B checkpoint's transposing copy took 16 s on a 2-core host), the
    parameter dict read-only views of them, and generation, which keeps those weights [out,
    in], uploads the file's own rows: the GPU holds the file's bits."""
    from safetensors.torch import load_file
    stored = {k: v.float().numpy() for k, v in load_file(str(bf16_llama.folder / "model.safetensors")).items()}
    params = bf16_llama.init_params()
    assert params is not bf16_llama.init_params() and all(not v.flags.writeable for v in params.values())
    with pytest.raises(ValueError, match="read-only"):
        params["model.norm.weight"][0] = 1.0
    kept = {name for name in bf16_llama.weight_transposes if name in params}
    assert kept and all(params[name].T.flags.c_contiguous for name in kept)
    assert all(params[name].flags.c_contiguous for name in set(params) - kept)
    for name, value in params.items():
        assert np.array_equal(value.T if name in kept else value, stored[name]), name
    configure(bf16_weights=True, weight_layout="out-in")
    steps = Generator(bf16_llama, params).steps(256)
    for name in steps.transposed:
        assert steps.decode.get_parameter(name).tobytes() == stored[name].tobytes(), name


def test_a_checkpoint_in_f32_keeps_its_weights_in_f32(tmp_path):
    llama_relative("Llama", 4).save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path, {})
    generator = Generator(model, model.init_params())
    steps = generator.steps(256)
    assert steps.bf16 == set()
    assert all(steps.decode.graph[i].dtype == "f32" for i in steps.decode.graph.parameters.values())


def test_cli_generate_says_how_many_weights_stay_bf16(bf16_llama, capsys, configure):
    from engine.cli import main
    argv = ["generate", str(bf16_llama.folder), "--prompt-ids", "3,17,9", "--max-new-tokens", "3", "--backend", "gpu"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights_in_bf16"] == sum(v.ndim == 2 for v in bf16_llama.init_params().values())
    assert out["text"] is None and len(out["tokens"]) == 3   # no tokenizer, a vocabulary of 120: ids in, ids out
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == [str(t) for t in out["tokens"]]
    assert f"; {out['weights_in_bf16']} weights kept in bf16, as the checkpoint stores them" in captured.err
    configure(bf16_weights=False)
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights_in_bf16"] == 0


@pytest.mark.parametrize("family,fields", [
    ("Phi3", dict(pad_token_id=0)),
    ("Granite", dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5,
                     attention_bias=True, tie_word_embeddings=True))])
def test_relatives_in_bf16_generate_as_in_f32(family, fields, tmp_path, configure):
    """Phi-3's fused q/k/v and gate/up weights, which its graph slices (the slices fold into
    the products, at offsets within the weight), and Granite's scales and biases around
    bf16 weights: every matrix stays bf16, and the logits are the f32 weights', bit for bit."""
    import torch
    llama_relative(family, 5, **fields).to(torch.bfloat16).save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path, {})
    params, prompt = model.init_params(), [5, 9, 33, 2]
    logits = {}
    for kept in (True, False):
        configure(bf16_weights=kept)
        steps = Generator(model, params).steps(256)
        logits[kept] = [steps.run(prompt, 0, prefill=True), steps.run([7], 4, prefill=False)]
        if kept:
            assert steps.bf16 == {name for name, value in params.items() if value.ndim == 2}
            fused = [name for name in steps.bf16 if name.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
            assert len(fused) == (4 if family == "Phi3" else 0)
    assert all(np.array_equal(a, b) for a, b in zip(logits[True], logits[False]))
