"""The profiler panel's Roofline, Compare and Memory views, driven with pytest-qt
(mlp at batch 8 on lavapipe; real files, real clicks)."""

import json

import pytest
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QColor

from app.compare_view import FASTER, SLOWER

from test_studio import run_profile, wait_optimized, window  # noqa: F401  (fixtures; errors is in conftest)


def click_point(qtbot, roofline, name):
    """A left click on the roofline point of kernel ``name``, where it is drawn."""
    vb = roofline.plot.getPlotItem().vb
    x, y = roofline.positions[name]
    at = roofline.plot.mapFromScene(vb.mapViewToScene(QPointF(x, y)))
    qtbot.mouseClick(roofline.plot.viewport(), Qt.MouseButton.LeftButton, pos=at)


def test_roofline_click_selects_the_kernel_everywhere_and_memory_marks_the_peak(window, qtbot, tmp_path):  # noqa: F811
    wait_optimized(window, qtbot)
    panel = run_profile(window, qtbot, steps=2)
    p = window.state.profile
    kernels = p.report.per_kernel()
    roofline = panel.roofline
    assert set(roofline.positions) == {k["name"] for k in kernels if k["flops"] > 0}
    panel.tables.setCurrentWidget(roofline)
    qtbot.waitExposed(roofline.plot)
    # the kernel with the smallest share of the time, so that its selection is not the default one
    name = min(roofline.positions, key=lambda n: roofline.rows[n]["gpu_ns"])
    with qtbot.waitSignal(panel.kernelSelected, timeout=5000) as blocker:
        click_point(qtbot, roofline, name)
    positions = blocker.args[0]
    last = p.report.steps - 1
    assert positions == [d.index for d in p.report.dispatches if d.step == last and d.kernel == name]
    assert roofline.selected == name
    rows = panel.kernel_table.selectionModel().selectedRows()
    assert [panel.kernel_model.key(r.row(), 0) for r in rows] == [name]
    picked = panel.dispatch_table.selectionModel().selectedRows()
    assert sorted(panel.dispatch_model.key(r.row(), 1) for r in picked) == positions
    assert all(panel.dispatch_model.key(r.row(), 2) == name and panel.dispatch_model.key(r.row(), 0) == last
               for r in picked)
    expected = sorted({n for i in positions for n in p.dispatch_nodes[i]})
    assert expected and sorted(window.graph_view.selected()) == expected
    # the kernel table's Bound column is the report's
    bound = next(k["bound"] for k in kernels if k["name"] == name)
    assert panel.kernel_model.key(rows[0].row(), 8) == bound in ("compute", "memory", "latency")

    # Memory: the live bytes of the step, the peak marked where the report puts it
    memory, m = panel.memory, p.report.memory
    assert memory.peak == (m["peak_dispatch"], m["peak_bytes"]) and m["peak_bytes"] == max(m["live_bytes"])
    xs, ys = memory.peak_marker.getData()
    scale = m["peak_bytes"] / ys[0]
    assert list(xs) == [m["peak_dispatch"]] and scale in (1, 2**10, 2**20, 2**30)
    curve_y = memory.curve.getData()[1]
    assert [round(v * scale) for v in curve_y] == m["live_bytes"]
    assert memory.model.rowCount() == len(m["peak_buffers"]) and "Buffer reuse saves" in memory.saving.text()

    # the summary says what the timestamps cost a dispatch where that was measured positive
    import copy
    import dataclasses
    for cost, said in ((4321.0, ", which add 4.3 µs a dispatch"), (-1500.0, ""), (None, "")):
        shown = copy.copy(p)
        shown.report = dataclasses.replace(p.report, overhead={**p.report.overhead, "per_dispatch_ns": cost})
        panel.show_profile(shown)
        text = panel.summary.text()
        assert (f"timing: {p.report.mode}{said} ·" in text) and ("µs a dispatch" in text) == bool(said), text
    assert "timer" in panel.summary.toolTip()
    panel.show_profile(p)

    # the profile saved as JSON, then loaded to compare with itself: every ratio 1
    saved = panel.save_profile_json(str(tmp_path / "mlp.json"))
    assert panel.load_comparison(saved) and panel.tables.currentWidget() is panel.compare
    model = panel.compare.model
    assert model.rowCount() == len(kernels)
    assert all(model.key(r, 4) == 1.0 and model.key(r, 3) == 0 for r in range(model.rowCount()))
    assert not window.errors


def write_profile(path, steps, kernels):
    path.write_text(json.dumps({"model": "mlp", "steps": steps, "adapter": {"name": "gpu"},
                                "per_kernel": [{"name": n, "gpu_ns": ns, "calls": c} for n, ns, c in kernels]}))
    return str(path)


def test_two_loaded_profiles_give_the_deltas(window, qtbot, tmp_path, errors):  # noqa: F811
    panel = window.profiler_panel
    a = write_profile(tmp_path / "a.json", 2, [("matmul", 4000, 2), ("softmax", 1000, 2), ("gone", 600, 2)])
    b = write_profile(tmp_path / "b.json", 1, [("matmul", 1000, 1), ("softmax", 2000, 1), ("new", 70, 1)])
    assert panel.load_comparison(a)
    assert panel.compare.model.rowCount() == 0 and "Run a profile" in panel.compare.summary.text()
    assert panel.compare.load_b(b)
    model = panel.compare.model
    by_name = {model.key(r, 0): r for r in range(model.rowCount())}
    assert set(by_name) == {"matmul", "softmax", "gone", "new"}
    mm, sm = by_name["matmul"], by_name["softmax"]
    assert [model.key(mm, c) for c in range(5)] == ["matmul", 2000.0, 1000.0, -1000.0, 0.5]
    assert [model.key(sm, c) for c in range(5)] == ["softmax", 500.0, 2000.0, 1500.0, 4.0]
    assert model.data(model.index(mm, 3)) == "-1.0" and model.data(model.index(sm, 4)) == "4.00"
    background = Qt.ItemDataRole.BackgroundRole
    assert model.data(model.index(mm, 0), background) == QColor(FASTER)
    assert model.data(model.index(sm, 0), background) == QColor(SLOWER)
    assert model.data(model.index(by_name["gone"], 2)) == "only in A"
    assert model.data(model.index(by_name["new"], 1)) == "only in B"
    assert "B is <b style='color:#c03030'>1.10× slower" in panel.compare.summary.text()
    c = panel.compare.comparison
    assert (c["a_total_ns"], c["b_total_ns"]) == (2800.0, 3070.0)
    # sortable by the change, missing values last
    panel.compare.table.sortByColumn(3, Qt.SortOrder.AscendingOrder)
    assert [model.key(r, 0) for r in range(model.rowCount())] == ["matmul", "gone", "new", "softmax"]
    panel.compare.table.sortByColumn(4, Qt.SortOrder.DescendingOrder)
    assert [model.key(r, 0) for r in range(model.rowCount())][:2] == ["softmax", "matmul"]
    # a file that is not a profile: a dialog, and the comparison stays
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert not panel.load_comparison(str(bad))
    assert errors and "bad.json" in errors[-1][1] and model.rowCount() == 4


@pytest.fixture(autouse=True)
def _no_real_dialogs(monkeypatch):
    from PySide6.QtWidgets import QFileDialog
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: ("", ""))
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, **k: ("", ""))


def test_a_long_name_in_a_profile_table_is_its_own_tooltip(qtbot):
    """Kernel names are elided in their column, so rows can look alike: the whole name is
    the cell's tooltip (short cells and numbers have none)."""
    from app.records import RecordsModel
    model = RecordsModel(["kernel", "ms"])
    name = "decode:fused_matmul:activation=none:transpose_a=False:transpose_b=True"
    model.set_rows([((name, "0.041"), (name, 0.041)), (("copy", "0.002"), ("copy", 0.002))])
    tip = Qt.ItemDataRole.ToolTipRole
    assert model.data(model.index(0, 0), tip) == name
    assert model.data(model.index(1, 0), tip) is None and model.data(model.index(0, 1), tip) is None
