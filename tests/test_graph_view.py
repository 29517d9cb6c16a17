"""The graph view on a real model (issue 20, item 4), driven with pytest-qt offscreen: a
checkpoint opens on one box per layer, a double-click opens a block and closes it,
search selects a node inside a closed block, a profile colours boxes by their module's
GPU time, the Per module table selects boxes, and a SmolLM2-135M-shaped Llama's
training graph lays out and paints (timed as a smoke, never asserted)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from llama_checkpoint import save_llama
from PySide6.QtCore import QPointF, QSettings, Qt
from PySide6.QtWidgets import QMessageBox

from app.graph_items import heat_colour
from app.graph_view import GraphView
from app.window import MainWindow

LAYERS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama6"), layers=LAYERS, seed=2)


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch, checkpoint):
    errors = []
    monkeypatch.setattr(QMessageBox, "critical", lambda parent, title, text, *a, **k: errors.append((title, text)))
    settings = QSettings(str(tmp_path / "studio.ini"), QSettings.Format.IniFormat)
    w = MainWindow(checkpoint, settings=settings, model_settings={"seq": 8})
    qtbot.addWidget(w)
    w.resize(1400, 900)
    w.show()
    qtbot.waitUntil(lambda: w.state.graphs.get("optimized") is not None
                    and w.graph_view.graph is w.state.graphs["optimized"], timeout=30000)
    yield w
    w.wait_for_workers(20)
    assert not errors and not w.errors


def double_click(qtbot, view: GraphView, scene_point: QPointF, module: str) -> None:
    """Double-click there and wait for ``module`` to open or close."""
    was_open = module in view.frames
    view.canvas.centerOn(scene_point)
    qtbot.mouseDClick(view.canvas.viewport(), Qt.MouseButton.LeftButton,
                      pos=view.canvas.mapFromScene(scene_point))
    qtbot.waitUntil(lambda: (module in view.frames) != was_open, timeout=3000)


def test_checkpoint_opens_on_its_layers_and_a_double_click_opens_and_closes_a_block(window, qtbot):
    view, graph = window.graph_view, window.graph_view.graph
    layers = {f"model.layers.{i}" for i in range(LAYERS)}
    assert layers <= set(view.boxes) and {"model", "model.layers"} <= set(view.frames)
    assert view.boxes["model.layers.2"].label == "layers.2" and "model.embed_tokens" in view.boxes
    assert not [n for n in view.items if graph[n].module.startswith("model.layers.")]   # no layer's node drawn
    assert view.canvas.transform().m11() >= 0.8                                         # opens readable

    double_click(qtbot, view, view.boxes["model.layers.2"].sceneBoundingRect().center(), "model.layers.2")
    assert "model.layers.2" in view.frames and "model.layers.2" not in view.boxes
    own = [n.id for n in graph.nodes if n.module == "model.layers.2"]            # the residual adds
    assert own and all(i in view.items for i in own)
    assert {"model.layers.2.self_attn", "model.layers.2.mlp", "model.layers.2.input_layernorm"} <= set(view.boxes)
    assert layers - {"model.layers.2"} <= set(view.boxes)                          # the others stay closed
    frame = view.frames["model.layers.2"]
    assert frame.sceneBoundingRect().contains(view.items[own[0]].sceneBoundingRect())

    double_click(qtbot, view, frame.scenePos() + QPointF(60, 10), "model.layers.2")   # its title bar
    assert "model.layers.2" in view.boxes and "model.layers.2" not in view.frames
    assert not any(i in view.items for i in own)


def test_search_highlights_closed_blocks_and_enter_selects_a_node(window, qtbot):
    view, graph = window.graph_view, window.graph_view.graph
    # the attention ops and the post_attention_layernorm weights: two in each layer
    hits = [n.id for n in graph.nodes if "attention" in n.op or "attention" in (n.name or "")]
    window._focus_search()
    qtbot.keyClicks(view.search, "attention")
    assert view.highlighted() == hits and len(hits) == 2 * LAYERS
    assert all(view.boxes[f"model.layers.{i}"].matches == 2 for i in range(LAYERS))
    assert f"matches: {2 * LAYERS}" in view.info.text()
    for k in range(2):          # Enter: the next match, with what holds it opened
        qtbot.keyClick(view.search, Qt.Key.Key_Return)
        node = graph[hits[k]]
        assert view.selected() == [node.id] and node.module in view.frames
        assert view.props.toPlainText().startswith(f"%{node.id}  {node.op}")
        assert f"module: {node.module}" in view.props.toPlainText()
    assert {graph[h].op for h in hits} == {"attention", "parameter"}
    # a module's name finds its box
    view.search.setText("layers.4")
    assert view.module_hits == {"model.layers.4"} and view.boxes["model.layers.4"].highlighted


def test_profile_colours_boxes_by_their_modules_gpu_time_and_tables_select_them(window, qtbot):
    view = window.graph_view
    panel = window.profiler_panel
    panel.steps.setValue(2)
    with qtbot.waitSignal(panel.runFinished, timeout=60000) as blocker:
        panel.run()
    assert blocker.args == ["finished"]
    p = window.state.profile
    assert view.graph is p.graph and view.colour_mode == "heat"
    last = [d for d in p.report.dispatches if d.step == p.report.steps - 1]
    total = sum(d.gpu_ns for d in last)
    for path, box in view.boxes.items():
        # from the dispatches' own modules, independently of the graph's nodes
        ns = sum(d.gpu_ns for d in last if d.module == path or d.module.startswith(path + "."))
        assert view.module_heat.get(path, 0) == ns, path
        if ns:
            assert box.colour == heat_colour(ns / total) and "%" in box.lines[1]
    busiest = max((f"model.layers.{i}" for i in range(LAYERS)), key=lambda m: view.module_heat[m])
    assert view.boxes[busiest].colour.lightness() <= min(view.boxes[f"model.layers.{i}"].colour.lightness()
                                                         for i in range(LAYERS))
    # the Per module table: one row per block, in model order; a row selects its box
    table = panel.module_table
    names = table.names()
    assert names[:LAYERS + 1] == ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(LAYERS)]
    row = names.index("model.layers.3")
    table.table.clicked.emit(table.model.index(row, 0))
    assert view.selected_modules() == ["model.layers.3"] and view.props.toPlainText().startswith(
        "module model.layers.3")
    assert "GPU time (last step)" in view.props.toPlainText()
    # selecting a node in the graph selects its kernel's row in the kernel table
    view.expand("model.layers.1.self_attn")
    attention = next(n.id for n in view.graph.nodes if n.op == "attention" and n.module == "model.layers.1.self_attn")
    view.scene.clearSelection()
    view.items[attention].setSelected(True)
    picked = panel.kernel_table.selectionModel().selectedRows()
    assert [panel.kernel_model.key(i.row(), 0) for i in picked] == ["model.layers.1.self_attn:attention:causal=True"]


def test_smollm2_shaped_training_graph_lays_out_and_paints(qtbot, tmp_path):
    """A smoke on the real shape (hidden 576, 30 layers, 9 heads over 3, intermediate 1536;
    the vocabulary does not change the graph's structure): timings printed, not asserted."""
    from engine.importers.hf.llama import LlamaModel
    from engine.optimize import optimize
    from engine.autodiff.gradients import differentiate
    config = dict(model_type="llama", vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  rope_theta=100000.0, tie_word_embeddings=True)
    model = LlamaModel(Path(tmp_path), config, {})
    forward, _ = optimize(model.build(train=True))
    graph, _ = optimize(differentiate(forward)[0])

    class State:                         # what the view reads of the Studio's state
        profile = None

        def origins(self):
            return {}

        def dispatches_of(self, graph, node_id):
            return None

    view = GraphView(State())
    qtbot.addWidget(view)
    view.resize(1200, 800)
    view.show()
    timings = {}
    start = time.perf_counter()
    view.show_graph(graph, "training")
    timings["open (layout + items)"] = time.perf_counter() - start
    assert {f"model.layers.{i}" for i in range(30)} <= set(view.boxes) and len(view.items) < 40

    def paint(label):
        start = time.perf_counter()
        view.canvas.viewport().grab()
        timings[f"paint: {label}"] = time.perf_counter() - start

    paint("blocks")
    start = time.perf_counter()
    view.toggle("model.layers.7")
    timings["open a layer"] = time.perf_counter() - start
    paint("a layer open")
    start = time.perf_counter()
    view.expand_all()
    timings["expand all"] = time.perf_counter() - start
    assert len(view.items) > 2000 and not view.boxes
    paint("all open")
    view.canvas.fit()
    paint("all open, fitted")
    print(f"\n{len(graph.nodes)} nodes: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
