"""The Studio's Runs panel with pytest-qt: run directories written here, curves read
back from the plot's data items."""

import json

import numpy as np
import pytest
from PySide6.QtCore import QPointF, QSettings, Qt
from PySide6.QtWidgets import QFileDialog, QMessageBox

from app.runs_panel import RunsPanel
from engine.train.runs import debiased_ema
from test_runs import write_run

LOSSES_A = [3.0, 2.6, 2.7, 2.1, 1.9, 2.0, 1.6, 1.5]
LOSSES_B = [3.2, 3.0, 2.4, 2.5, 2.2, 1.8]


@pytest.fixture
def runs(tmp_path):
    folder = tmp_path / "runs"
    write_run(folder, "alpha", LOSSES_A, val_every=4, checkpoints=(4, 8), created="2026-11-26T10:00:00")
    write_run(folder, "beta", LOSSES_B, status="running", checkpoints=(4,), created="2026-11-26T11:00:00", seconds=2.0)
    return folder


@pytest.fixture
def settings(tmp_path):
    return QSettings(str(tmp_path / "studio.ini"), QSettings.Format.IniFormat)


@pytest.fixture
def panel(qtbot, runs, settings):
    settings.setValue("runs/folder", str(runs))
    p = RunsPanel(settings)
    qtbot.addWidget(p)
    p.resize(1200, 800)
    p.show()
    return p


def plotted(panel):
    """{run name: (x, y)} of each smoothed loss curve on the plot, and {run name + " (validation)":
    (x, y)} of each validation curve, from the plot's own data items."""
    items = panel.plot.getPlotItem().listDataItems()
    curves = {}
    for entry in panel.entries.values():
        for suffix, curve in (("", entry.smoothed), (" (validation)", entry.val)):
            if curve in items and curve.isVisible():
                curves[entry.run.name + suffix] = tuple(np.asarray(a) for a in curve.getData())
    return curves


def legend(panel):
    return [label.text for _, label in panel.legend.items]


def test_two_runs_are_listed_and_both_curves_plotted(panel, runs):
    table = panel.table
    assert [table.topLevelItem(i).text(0) for i in range(table.topLevelItemCount())] == ["alpha", "beta"]
    alpha = table.topLevelItem(0)
    assert [alpha.text(c) for c in range(1, 6)] == ["mlp", "8 / 8", "1.5", "1.6", "finished"]
    curves = plotted(panel)
    assert set(curves) == {"alpha", "alpha (validation)", "beta"}          # beta has no validation
    w = panel.smoothing_weight()
    assert w == pytest.approx(0.6)
    np.testing.assert_array_equal(curves["alpha"][0], np.arange(1, 9))
    np.testing.assert_allclose(curves["alpha"][1], debiased_ema(LOSSES_A, w))
    np.testing.assert_allclose(curves["beta"][1], debiased_ema(LOSSES_B, w))
    np.testing.assert_array_equal(curves["alpha (validation)"][0], [4, 8])
    np.testing.assert_allclose(curves["alpha (validation)"][1], [2.2, 1.6])
    raw = [item.getData()[1] for item in panel.plot.getPlotItem().listDataItems() if not item.name()]
    assert any(y is not None and len(y) == len(LOSSES_A) and np.allclose(y, LOSSES_A) for y in raw)
    assert legend(panel) == ["alpha", "beta", "validation loss (dashed)"]
    # unchecking a run takes its curves off the plot, and its name off the legend
    panel.set_checked(runs / "beta", False)
    assert set(plotted(panel)) == {"alpha", "alpha (validation)"}
    assert legend(panel) == ["alpha", "validation loss (dashed)"]
    panel.set_checked(runs / "alpha", False)
    panel.set_checked(runs / "beta", True)
    assert set(plotted(panel)) == {"beta"} and legend(panel) == ["beta"]
    panel.set_checked(runs / "alpha", True)
    panel.set_folder(runs / "alpha")                  # one run with validation points, alone
    assert set(plotted(panel)) == {"alpha", "alpha (validation)"}
    assert legend(panel) == ["alpha", "validation loss (dashed)"]


def test_smoothing_axis_and_hover(panel, qtbot):
    panel.smoothing.setValue(0)
    np.testing.assert_allclose(plotted(panel)["alpha"][1], LOSSES_A)
    panel.smoothing.setValue(900)
    smoothed = plotted(panel)["alpha"][1]
    np.testing.assert_allclose(smoothed, debiased_ema(LOSSES_A, 0.9))
    assert not np.allclose(smoothed, LOSSES_A) and smoothed[0] == LOSSES_A[0]
    panel.x_axis.setCurrentIndex(panel.x_axis.findData("time"))
    np.testing.assert_allclose(plotted(panel)["beta"][0], 2.0 * np.arange(1, 7))      # 2 s a step
    rows = {r["run"]: r for r in panel.readout_at(7.5)}
    assert rows["beta"]["step"] == 4 and rows["beta"]["loss"] == LOSSES_B[3]
    assert rows["alpha"]["step"] == 8 and rows["alpha"]["val_loss"] == pytest.approx(1.6)
    assert rows["alpha"]["smoothed"] == pytest.approx(debiased_ema(LOSSES_A, 0.9)[7])
    # the mouse over the plot at 7.5 s: the read-out names each run with its values there
    view = panel.plot.getPlotItem().vb
    view.setRange(xRange=(0, 12), yRange=(1, 3.5), padding=0)
    qtbot.mouseMove(panel.plot.viewport(), panel.plot.mapFromScene(view.mapViewToScene(QPointF(7.5, 2.0))))
    qtbot.waitUntil(lambda: "beta" in panel.readout.text())
    assert f"loss {LOSSES_B[3]:.4g}" in panel.readout.text() and "step 8" in panel.readout.text()
    assert panel.cursor.isVisible()
    panel.log_y.setChecked(True)
    assert panel.plot.getPlotItem().ctrl.logYCheck.isChecked()
    assert not panel.cursor.isVisible()               # a new scale: the old read-out is gone


def test_the_watcher_shows_new_metrics_and_new_runs(panel, runs, qtbot):
    panel.poll.stop()            # the file system watcher alone
    with open(runs / "beta" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 7, "loss": 1.25, "seconds": 2.0}) + "\n")
    qtbot.waitUntil(lambda: len(plotted(panel)["beta"][0]) == 7, timeout=5000)
    assert panel.table.topLevelItem(1).text(3) == "1.25"
    write_run(runs, "gamma", [2.0, 1.0], created="2026-11-26T12:00:00")
    qtbot.waitUntil(lambda: "gamma" in plotted(panel), timeout=5000)
    assert panel.table.topLevelItem(2).text(0) == "gamma"


def test_clicking_a_run_in_the_legend_unchecks_it(panel, runs, qtbot):
    sample = next(sample for sample, label in panel.legend.items if label.text == "beta")
    centre = sample.mapToScene(sample.boundingRect().center())
    qtbot.mouseClick(panel.plot.viewport(), Qt.MouseButton.LeftButton, pos=panel.plot.mapFromScene(centre))
    assert panel.checked_runs() == [str(runs / "alpha")]
    assert set(plotted(panel)) == {"alpha", "alpha (validation)"} and "beta" not in legend(panel)


def test_resume_asks_for_the_current_run(panel, runs, qtbot):
    assert not panel.resume_button.isEnabled()
    panel.table.setCurrentItem(panel.table.topLevelItem(1))               # beta: says running
    assert panel.resume_button.isEnabled() and "running" in panel.resume_button.toolTip()
    panel.table.setCurrentItem(panel.table.topLevelItem(0))
    assert panel.resume_button.isEnabled()
    with qtbot.waitSignal(panel.resumeRequested) as signal:
        panel.resume_button.click()
    assert signal.args == [str(runs / "alpha")]


def test_resume_stays_off_only_for_the_run_this_studio_trains(panel, runs):
    """beta's status.json says running: its process may have died (``meganeura train
    --resume`` goes on with it), so Resume is on, unless this Studio is training beta."""
    panel.table.setCurrentItem(panel.table.topLevelItem(1))
    assert panel.current_run().state == "running" and panel.resume_button.isEnabled()
    panel.training_path = lambda: runs / "beta"
    panel.refresh()
    assert not panel.resume_button.isEnabled() and "training in this Studio" in panel.resume_button.toolTip()
    panel.training_path = lambda: runs / "alpha"
    panel.refresh()
    assert panel.resume_button.isEnabled()


def test_an_empty_folder_says_so_and_folder_button_switches(panel, tmp_path, monkeypatch, runs):
    empty = tmp_path / "elsewhere"
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(empty))
    panel.folder_button.click()
    assert panel.table.topLevelItemCount() == 0 and plotted(panel) == {}
    assert "does not exist yet" in panel.readout.text()
    assert panel.qsettings.value("runs/folder") == str(empty)
    panel.set_folder(runs)
    assert panel.table.topLevelItemCount() == 2


def test_the_default_folder_is_runs_here_and_is_not_pinned(qtbot, tmp_path, monkeypatch, runs, configure):
    monkeypatch.chdir(runs.parent)
    configure(runs_dir=None)
    settings = QSettings(str(tmp_path / "fresh.ini"), QSettings.Format.IniFormat)
    panel = RunsPanel(settings)
    qtbot.addWidget(panel)
    assert panel.folder == runs and panel.table.topLevelItemCount() == 2
    panel.smoothing.setValue(100)
    assert settings.value("runs/smoothing") == 100 and settings.value("runs/folder") is None


def test_settings_survive_a_new_window(qtbot, runs, settings, monkeypatch):
    from app.window import MainWindow
    monkeypatch.setattr(QMessageBox, "critical", lambda *a, **k: None)
    settings.setValue("runs/folder", str(runs))

    def window():
        w = MainWindow("mlp", settings=settings, model_settings={"batch": 8})
        qtbot.addWidget(w)
        return w
    w = window()
    p = w.runs_panel
    assert w.tabs.tabText(w.tabs.indexOf(p)) == "Runs"
    p.smoothing.setValue(850)
    p.x_axis.setCurrentIndex(p.x_axis.findData("time"))
    p.log_y.setChecked(True)
    p.set_checked(runs / "alpha", False)
    p.table.setCurrentItem(p.table.topLevelItem(0))
    resumed = []
    monkeypatch.setattr(w.training_panel, "resume_run", resumed.append)
    p.resume_button.click()                            # alpha: finished, with checkpoints
    assert resumed == [str(runs / "alpha")] and w.tabs.currentWidget() is w.training_panel
    p.table.setCurrentItem(p.table.topLevelItem(1))
    w.close()
    w.wait_for_workers(20)

    p = window().runs_panel
    assert p.folder == runs and p.smoothing.value() == 850 and p.x_axis_name() == "time" and p.log_y.isChecked()
    assert p.checked_runs() == [str(runs / "beta")] and set(plotted(p)) == {"beta"}
    assert p.current_run().name == "beta"
    assert p.table.topLevelItem(0).checkState(0) == Qt.CheckState.Unchecked
