"""The Studio, driven with pytest-qt offscreen (small model settings throughout)."""

import numpy as np
import pytest
from PySide6.QtCore import QSettings, QTimer
from PySide6.QtWidgets import QFileDialog, QMessageBox

from app.graph_view import NodeItem
from app.window import MainWindow
from engine.autodiff import differentiate
from engine import models

SMALL = {"mlp": {"batch": 8}, "whisper-tiny": {"mel_len": 64}, "gpt-tiny": {"seq": 16, "batch": 2},
         "audio-align": {"mel_len": 64, "batch": 2}}


@pytest.fixture
def errors(monkeypatch):
    """QMessageBox.critical records instead of blocking."""
    seen = []
    monkeypatch.setattr(QMessageBox, "critical", lambda parent, title, text, *a, **k: seen.append((title, text)))
    return seen


@pytest.fixture
def window(qtbot, tmp_path, errors):
    settings = QSettings(str(tmp_path / "studio.ini"), QSettings.Format.IniFormat)
    w = MainWindow("mlp", settings=settings, model_settings=SMALL["mlp"])
    qtbot.addWidget(w)
    w.show()
    yield w
    if w.training_panel.worker is not None:
        w.training_panel.stop()
        qtbot.waitUntil(lambda: w.training_panel.worker is None, timeout=10000)


def node_items(w):
    return [i for i in w.graph_view.scene.items() if isinstance(i, NodeItem)]


def test_launch(window):
    assert window.windowTitle() == "Meganeura Studio"
    assert window.state.model_name == "mlp"
    assert "·" in window.adapter_label.text()
    assert [window.tabs.tabText(i) for i in range(window.tabs.count())][:2] == ["Graph", "Training"]


@pytest.mark.parametrize("name", models.names())
def test_load_each_model_draws_every_node(window, name):
    assert window.load_model(name, SMALL[name])
    graph = window.state.graph("original")
    assert len(node_items(window)) == len(graph.nodes)
    # clicking a node fills the property panel
    item = window.graph_view.items[len(graph.nodes) - 1]
    item.setSelected(True)
    assert f"%{item.node.id}" in window.graph_view.props.toPlainText()
    assert "shape" in window.graph_view.props.toPlainText()


def test_training_graph_and_search(window):
    window.load_model("whisper-tiny", SMALL["whisper-tiny"])
    window.graph_view.kind_box.setCurrentIndex(2)           # Training (fwd + bwd)
    graph = window.state.graph("training")
    assert window.graph_view.graph is graph
    assert len(node_items(window)) == len(graph.nodes) > 500
    window.graph_view.search.setText("attention")
    hits = window.graph_view.highlighted()
    assert hits and all(graph[i].op.startswith("attention") or "attention" in (graph[i].name or "")
                        for i in hits)


def test_fusion_row_highlights_nodes_contract(window):
    """The panel against the OptimizeReport contract (a stand-in report)."""
    graph = window.state.graph("original")
    fused = next(n.id for n in graph.nodes if n.op == "bias_add")

    class Report:
        def to_dict(self):
            return {"nodes_before": 10, "nodes_after": 10, "dispatches_before": 4, "dispatches_after": 2,
                    "bytes_before": 4096, "bytes_after": 2048, "rules": {"matmul_add": 2},
                    "rule_bytes_saved": {"matmul_add": 2048}, "saturated": True, "seconds": 0.01,
                    "origins": {str(fused): [fused - 1, fused]}, "rule_nodes": {"matmul_add": [fused]}}

    window.state.set_optimized(graph, Report())
    table = window.fusion_panel.table
    assert table.rowCount() == 1 and table.item(0, 0).text() == "matmul_add"
    table.selectRow(0)
    assert window.graph_view.kind == "optimized"
    assert window.graph_view.highlighted() == [fused]
    window.graph_view.items[fused].setSelected(True)
    assert "fuses 2 original node(s)" in window.graph_view.props.toPlainText()


def test_fusion_with_real_optimizer(window, qtbot):
    try:
        from engine.optimize import optimize  # noqa: F401
    except ImportError:
        pytest.skip("engine.optimize not available yet")
    worker = window.fusion_panel.run_optimizer()
    assert worker is not None
    with qtbot.waitSignal(worker.finished, timeout=30000):
        pass
    if window.errors:
        pytest.skip(f"optimizer failed: {window.errors[-1]}")
    table = window.fusion_panel.table
    opt = window.state.graphs["optimized"]
    if table.rowCount() == 0:
        pytest.skip("no rule fired on mlp")
    table.selectRow(0)
    assert window.graph_view.graph is opt
    assert len(node_items(window)) == len(opt.nodes)
    assert window.graph_view.highlighted()


def test_train_ten_steps_event_loop_alive(window, qtbot):
    import time
    ticks = [time.perf_counter()]
    timer = QTimer()
    timer.setInterval(5)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start()
    panel = window.training_panel
    panel.steps.setValue(10)
    panel.lr.setValue(0.01)
    panel.batch.setValue(64)
    worker = panel.start()
    with qtbot.waitSignal(panel.runFinished, timeout=30000) as blocker:
        pass
    ticks.append(time.perf_counter())
    timer.stop()
    assert blocker.args == ["finished"]
    assert panel.plotted_points() == 10
    assert len(panel.smooth_curve.getData()[0]) == 10
    assert panel.progress.value() == 10
    gaps = np.diff(ticks)
    assert gaps.max() < 0.25, f"the UI event loop stalled for {gaps.max():.3f} s during training"
    assert not worker.is_running
    assert panel.save_button.isEnabled() and panel.export_button.isEnabled()
    # trained parameters went back to the state
    assert window.state.params is not None and panel.last_trainer.step_count == 10


def test_stop_mid_run(window, qtbot):
    panel = window.training_panel
    panel.steps.setValue(100000)
    panel.start()
    qtbot.waitUntil(lambda: len(panel.losses) >= 3, timeout=20000)
    with qtbot.waitSignal(panel.runFinished, timeout=10000) as blocker:
        window.stop_action.trigger()
    assert blocker.args == ["stopped"]
    assert panel.worker is None
    assert 3 <= panel.last_trainer.step_count < 100000
    assert panel.start_button.isEnabled()


def test_nan_stops_with_message(window, qtbot, errors):
    panel = window.training_panel
    params = {k: v.copy() for k, v in window.state.params.items()}
    params["fc1.bias"][:] = np.nan
    window.state.set_params(params)
    panel.steps.setValue(200)
    with qtbot.waitSignal(panel.runFinished, timeout=30000) as blocker:
        panel.start()
    assert blocker.args == ["failed"]
    assert errors and "step 0" in errors[-1][1] and errors[-1][0] == "Training stopped"
    assert panel.worker is None and panel.start_button.isEnabled()


def test_bad_weights_file_keeps_previous(window, tmp_path, monkeypatch, errors):
    good = tmp_path / "good.safetensors"
    model = window.state.model
    params = {k: np.full_like(v, 0.5) for k, v in window.state.params.items()}
    model.save_weights(params, good)
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(good), ""))
    window.open_action.trigger()
    assert not errors and window.state.weights_path == str(good)
    assert window.model_panel.recent.item(0).text() == str(good)

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage, not a safetensors file" * 10)
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(bad), ""))
    window.open_action.trigger()
    assert errors and "bad.safetensors" in errors[-1][0]
    assert window.state.model_name == "mlp" and window.state.weights_path == str(good)
    assert all(np.all(v == 0.5) for v in window.state.params.values())

    # a file for another model: the message lists the offending tensors
    other = tmp_path / "other.safetensors"
    models.create("mlp", ["batch=8"]).save_weights(
        {k: np.zeros((3,) * v.ndim, np.float32) for k, v in params.items()}, other)
    assert not window.load_weights(str(other))
    assert "fc1.weight" in errors[-1][1]
    # still working: switch model and draw it
    assert window.load_model("gpt-tiny", SMALL["gpt-tiny"])
    assert len(node_items(window)) == len(window.state.graph("original").nodes)
