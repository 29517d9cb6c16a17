"""The Studio's main window: panels as tabs and docks around one ``StudioState``.

Panels: Model (left dock), Graph / Profiler / Training / Generate / Runs / Device (central tabs),
Fusion report (right dock). A loaded model is optimized at once (in a worker) and the
graph view opens on the optimized graph. The status bar shows the adapter and the GPU
memory of the last session built. Errors from the engine (``MeganeuraError``) are
shown in a dialog and the window keeps running.
"""

from __future__ import annotations

import os

from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QAction, QFontDatabase, QKeySequence
from PySide6.QtWidgets import (QApplication, QDockWidget, QFileDialog, QLabel, QMainWindow, QMessageBox,
                               QPlainTextEdit, QProgressDialog, QTabWidget)

from engine import config, models
from engine.errors import MeganeuraError

from . import main_thread_gc, theme
from .fusion_panel import FusionPanel
from .generate_panel import GeneratePanel
from .graph_view import GraphView, fmt_bytes
from .model_panel import MAX_RECENT, ModelPanel
from .profiler_panel import ProfilerPanel
from .runs_panel import RunsPanel
from .state import StudioState, optimizer_import
from .training_panel import TrainingPanel

DEFAULT_MODEL = "audio-align"


def adapter_line(info: dict) -> str:
    kind = "software" if info["software"] else "hardware"
    return f"{info['name']} · {info['backend']} · {kind}"


def doctor_text() -> tuple[str, str]:
    """(status bar line, doctor panel text); errors become readable text."""
    from engine.cli.doctor import doctor_report, format_doctor

    try:
        report = doctor_report()
    except MeganeuraError as exc:
        return f"No GPU adapter: {exc}", f"No GPU adapter.\n\n{exc}"
    return adapter_line(report["adapter"]), format_doctor(report)


def default_settings() -> QSettings:
    """The user's settings, or the ini file named by $MEGANEURA_STUDIO_SETTINGS (tests,
    screenshots: never touch the real ones)."""
    path = config.current().studio_settings
    if path:
        return QSettings(path, QSettings.Format.IniFormat)
    return QSettings("Meganeura", "Studio")


class OpenCancelled(Exception):
    """The user cancelled reading a checkpoint's weights."""


class WeightsProgress:
    """A checkpoint's weights being read: a dialog with the share read and a Cancel button
    (a 1B-parameter checkpoint takes seconds), called by the reader after each tensor; a
    cancel ends the read (OpenCancelled) and the model open before stays open."""

    def __init__(self, parent, name: str):
        self.name = name
        self.dialog = QProgressDialog(f"Reading the weights of {name}…", "Cancel", 0, 1000, parent)
        self.dialog.setWindowTitle("Opening a checkpoint")
        self.dialog.setWindowModality(Qt.WindowModality.WindowModal)
        self.dialog.setMinimumDuration(400)
        self.dialog.setMinimumWidth(480)
        self.dialog.setAutoClose(False)
        self.dialog.setValue(0)

    def __call__(self, done: int, total: int) -> None:
        self.dialog.setLabelText(f"Reading the weights of {self.name}: {fmt_bytes(done)} of {fmt_bytes(total)}")
        self.dialog.setValue(min(999, int(1000 * done / max(total, 1))))
        QApplication.processEvents()
        if self.dialog.wasCanceled():
            raise OpenCancelled()

    def close(self) -> None:
        self.dialog.reset()
        self.dialog.close()


def dialog_summary(text: str, limit: int = 700) -> str:
    """``text`` if it is at most ``limit`` characters, else its start, cut after a list
    separator, and how much more there is."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(", ", 0, limit), text.rfind("; ", 0, limit))
    head = text[:cut if cut > limit // 2 else limit]
    return f"{head} … ({len(text) - len(head):,} more characters under Show Details)"


class MainWindow(QMainWindow):
    def __init__(self, model: str | None = None, weights: str | None = None,
                 settings: QSettings | None = None, model_settings: dict | None = None):
        super().__init__()
        main_thread_gc.hold(self)
        self.setWindowTitle("Meganeura Studio")
        self.setWindowIcon(theme.icon())
        self.setAcceptDrops(True)
        self.qsettings = settings if settings is not None else default_settings()
        self.state = StudioState(self)
        self.errors: list[str] = []

        self.model_panel = ModelPanel(self.state)
        self.graph_view = GraphView(self.state)
        self.graph_view.setObjectName("graphView")
        self.fusion_panel = FusionPanel(self.state)
        self.training_panel = TrainingPanel(self.state, self.qsettings)
        self.generate_panel = GeneratePanel(self.state)
        self.generate_panel.setObjectName("generatePanel")
        self.runs_panel = RunsPanel(self.qsettings)
        self.runs_panel.setObjectName("runsPanel")
        self.profiler_panel = ProfilerPanel(self.state)
        self.profiler_panel.setObjectName("profilerPanel")
        status, text = doctor_text()
        self.doctor = QPlainTextEdit(text)
        self.doctor.setObjectName("doctorPanel")
        self.doctor.setReadOnly(True)
        self.doctor.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))

        self.tabs = QTabWidget()
        self.tabs.setObjectName("panels")
        self.setCentralWidget(self.tabs)
        self.add_panel("Graph", self.graph_view)
        self.add_panel("Profiler", self.profiler_panel)
        self.add_panel("Training", self.training_panel)
        self.add_panel("Generate", self.generate_panel)
        self.add_panel("Runs", self.runs_panel)
        self.add_panel("Device", self.doctor)
        self.model_dock = self._dock("Model", self.model_panel, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.fusion_dock = self._dock("Fusion report", self.fusion_panel, Qt.DockWidgetArea.RightDockWidgetArea)

        self.adapter_label = QLabel(status)
        self.adapter_label.setObjectName("adapterLabel")
        self.memory_label = QLabel("GPU memory: no session")
        self.memory_label.setObjectName("memoryLabel")
        self.model_label = QLabel("")
        self.statusBar().addWidget(self.model_label, 1)
        self.statusBar().addPermanentWidget(self.adapter_label)
        self.statusBar().addPermanentWidget(self.memory_label)

        self._actions()
        self.model_panel.loadRequested.connect(self.load_model)
        self.model_panel.openWeightsRequested.connect(self.open_weights)
        self.model_panel.openModelRequested.connect(self.open_model)
        self.model_panel.recentRequested.connect(self.load_weights)
        self.graph_view.kindRequested.connect(self.show_graph)
        self.fusion_panel.ruleSelected.connect(self.highlight_rule)
        self.fusion_panel.failed.connect(lambda exc: self.show_error("Optimization failed", exc))
        self.training_panel.failed.connect(self.show_error)
        self.runs_panel.resumeRequested.connect(self.resume_run)
        self.runs_panel.training_path = self.training_panel.training_path    # its Resume stays off for that run
        self.training_panel.can_run = lambda: not (self.profiler_panel.running() or self.generate_panel.running())
        self.profiler_panel.can_run = lambda: not (self.training_panel.running() or self.generate_panel.running())
        self.generate_panel.can_run = lambda: not (self.training_panel.running() or self.profiler_panel.running())
        self.generate_panel.failed.connect(self.show_error)
        self.profiler_panel.failed.connect(self.show_error)
        self.profiler_panel.message.connect(lambda text: self.statusBar().showMessage(text, 15000))
        self.profiler_panel.dispatchSelected.connect(self.select_dispatch)
        self.profiler_panel.kernelSelected.connect(self.select_dispatches)
        self.state.sessionChanged.connect(self._session_changed)
        self.state.profileChanged.connect(self.graph_view.refresh_properties)
        self.state.profileChanged.connect(self.graph_view.refresh_heat)
        self.profiler_panel.moduleSelected.connect(self.select_module)
        self.graph_view.nodesSelected.connect(self._graph_selection)
        self.training_panel.save_button.clicked.connect(self.save_weights)
        self.training_panel.export_button.clicked.connect(self.export_csv)
        self.state.modelChanged.connect(self._model_changed)
        self.state.optimizedChanged.connect(self._optimized_ready)
        self.model_panel.set_recent(self.recent_files())
        self.model_panel.set_recent_models(self.recent_models())
        self.training_panel.restore_settings(self.qsettings)
        self.resize(1400, 860)
        theme.install(self)          # the system's light or dark scheme, and again when it changes

        name = model or str(self.qsettings.value("model/name", DEFAULT_MODEL))
        self.load_model(name, model_settings or {})
        if self.state.model is None and name != DEFAULT_MODEL:
            self.load_model(DEFAULT_MODEL, {})
        if weights:
            self.load_weights(weights)

    # ------------------------------------------------------------ structure

    def apply_theme(self, scheme=None) -> str:
        """Apply a colour scheme ("light", "dark"; default: the system's) to the window
        and the application; connected to the system's colorSchemeChanged."""
        return theme.apply(QApplication.instance(), self, scheme)

    def add_panel(self, title: str, widget) -> None:
        """A central tab (the Profiler goes here when it exists)."""
        self.tabs.addTab(widget, title)

    def _dock(self, title, widget, area) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(title.replace(" ", "") + "Dock")
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    def _actions(self) -> None:
        def action(menu, text, slot, *keys):
            a = QAction(text, self)
            if keys:
                a.setShortcuts([QKeySequence(k) for k in keys])
            a.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
            a.triggered.connect(slot)
            menu.addAction(a)
            return a

        file_menu = self.menuBar().addMenu("&File")
        self.open_model_action = action(file_menu, "Open ONNX model…", lambda: self.open_model("file"), "Ctrl+M")
        self.open_folder_action = action(file_menu, "Open checkpoint folder…", lambda: self.open_model("folder"),
                                         "Ctrl+Shift+M")
        self.open_action = action(file_menu, "Open weights…", self.open_weights, "Ctrl+O")
        self.save_action = action(file_menu, "Save weights…", self.save_weights, "Ctrl+S")
        self.export_action = action(file_menu, "Export loss history (CSV)…", self.export_csv, "Ctrl+E")
        file_menu.addSeparator()
        action(file_menu, "Quit", self.close, "Ctrl+Q")
        train_menu = self.menuBar().addMenu("&Training")
        self.start_action = action(train_menu, "Start", self.start_training, "Ctrl+R")
        self.pause_action = action(train_menu, "Pause / resume", self.training_panel.toggle_pause, "Ctrl+P")
        self.stop_action = action(train_menu, "Stop", self.training_panel.stop, "Esc", "Ctrl+.")
        view_menu = self.menuBar().addMenu("&View")
        action(view_menu, "Find in graph", self._focus_search, "Ctrl+F")
        action(view_menu, "Fit graph", self.graph_view.canvas.fit, "Ctrl+0")
        action(view_menu, "Run optimizer", self.fusion_panel.run_optimizer, "Ctrl+Shift+O")
        profile_menu = self.menuBar().addMenu("&Profile")
        self.profile_action = action(profile_menu, "Run profile", self.start_profile, "Ctrl+Shift+R")
        self.cancel_profile_action = action(profile_menu, "Cancel profile", self.profiler_panel.cancel)
        self.trace_action = action(profile_menu, "Export Perfetto trace…", self.profiler_panel.export_trace,
                                   "Ctrl+Shift+E")
        view_menu.addAction(self.model_dock.toggleViewAction())
        view_menu.addAction(self.fusion_dock.toggleViewAction())

    def _focus_search(self) -> None:
        self.tabs.setCurrentWidget(self.graph_view)
        self.graph_view.search.setFocus()
        self.graph_view.search.selectAll()

    # ------------------------------------------------------------ errors

    def show_error(self, title: str, exc) -> None:
        """Engine errors in a dialog; the app keeps running. A long one (a weights file
        that fits another model names every tensor) shows its start, the rest under Show
        Details, so the dialog stays on the screen."""
        text = str(exc) if isinstance(exc, MeganeuraError) else f"{type(exc).__name__}: {exc}"
        self.errors.append(text)
        summary = dialog_summary(text)
        self.statusBar().showMessage(f"{title}: {dialog_summary(summary.splitlines()[0] if summary else '', 160)}",
                                     10000)
        if summary == text:
            QMessageBox.critical(self, title, text)
            return
        box = QMessageBox(QMessageBox.Icon.Critical, title, summary, QMessageBox.StandardButton.Ok, self)
        box.setObjectName("errorWithDetails")
        box.setDetailedText(text)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()

    # ------------------------------------------------------------ model and weights

    def busy(self) -> bool:
        """A training run, a profile or a generation is using the model and its weights."""
        return self.training_panel.running() or self.profiler_panel.running() or self.generate_panel.running()

    def load_model(self, source: str, settings: dict) -> bool:
        """Open ``source`` (a built-in name, an .onnx file or a checkpoint folder); on an
        error, a dialog, and the model open before stays open."""
        if self.busy():
            self.show_error("Cannot load a model", MeganeuraError("stop the training run, the profile or the "
                                                                  "generation first"))
            return False
        name = os.path.basename(str(source).rstrip("/")) or str(source)
        QApplication.setOverrideCursor(Qt.CursorShape.WaitCursor)
        reading = WeightsProgress(self, name) if os.path.isdir(str(source)) else None
        failed = None
        try:
            self.state.load_model(source, settings, progress=reading)
        except (OpenCancelled, MeganeuraError) as exc:
            failed = exc
        finally:
            QApplication.restoreOverrideCursor()
            if reading is not None:
                reading.close()
        if isinstance(failed, OpenCancelled):
            self.statusBar().showMessage(f"Opening {name} cancelled; {self.state.model_name} stays open", 8000)
            return False
        if failed is not None:
            self.show_error(f"Cannot open {name}", failed)
            return False
        self.qsettings.setValue("model/name", str(source))
        self.statusBar().clearMessage()   # an earlier error's line would stand beside the new model's
        if str(source) not in models.names():
            self.add_recent_model(str(source))
        return True

    def open_model(self, kind: str = "file") -> None:
        """The dialog for an .onnx file (``kind`` "file") or a checkpoint folder ("folder")."""
        recent = self.recent_models()
        start = os.path.dirname(recent[0].rstrip("/")) if recent else ""
        if kind == "folder":
            path = QFileDialog.getExistingDirectory(self, "Open a Hugging Face checkpoint folder", start)
        else:
            path, _ = QFileDialog.getOpenFileName(self, "Open an ONNX model", start, "ONNX (*.onnx);;All files (*)")
        if path:
            self.load_model(path, {})

    def recent_models(self) -> list[str]:
        return self._recent("recent_models")

    def add_recent_model(self, path: str) -> None:
        self.model_panel.set_recent_models(self._remember("recent_models", path))

    def open_weights(self) -> None:
        start = os.path.dirname(self.recent_files()[0]) if self.recent_files() else ""
        path, _ = QFileDialog.getOpenFileName(self, "Open weights", start,
                                              "safetensors (*.safetensors);;All files (*)")
        if path:
            self.load_weights(path)

    def load_weights(self, path: str) -> bool:
        """Load a weights file into the open model; refused while a run, a profile or a
        generation uses the weights (a run would put its own back when it ends)."""
        if self.busy():
            self.show_error(f"Cannot load {os.path.basename(path)}",
                            MeganeuraError("stop the training run, the profile or the generation first"))
            return False
        try:
            self.state.load_weights(path)
        except MeganeuraError as exc:
            self.show_error(f"Cannot load {os.path.basename(path)}", exc)
            return False
        self.add_recent(path)
        self.statusBar().showMessage(f"Loaded weights {path}", 5000)
        return True

    def save_weights(self) -> None:
        if self.state.model is None:
            return
        stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.state.model_name)
        path, _ = QFileDialog.getSaveFileName(self, "Save weights", f"{stem}.safetensors",
                                              "safetensors (*.safetensors)")
        if not path:
            return
        try:
            self.state.save_weights(path)
        except MeganeuraError as exc:
            self.show_error("Cannot save weights", exc)
            return
        self.add_recent(path)
        self.statusBar().showMessage(f"Saved weights to {path}", 5000)

    def export_csv(self) -> None:
        trainer = self.training_panel.last_trainer
        if trainer is None:
            self.statusBar().showMessage("Nothing to export: train first.", 5000)
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export loss history", "loss.csv", "CSV (*.csv)")
        if path:
            try:
                trainer.history.to_csv(path)
            except (OSError, MeganeuraError) as exc:
                self.show_error("Cannot export", exc)
                return
            self.statusBar().showMessage(f"Wrote {len(trainer.history)} steps to {path}", 5000)

    def recent_files(self) -> list[str]:
        return self._recent("recent")

    def add_recent(self, path: str) -> None:
        self.model_panel.set_recent(self._remember("recent", path))

    def _recent(self, key: str) -> list[str]:
        """A list of paths kept in the settings under ``key``, most recent first."""
        value = self.qsettings.value(key, []) or []
        return [value] if isinstance(value, str) else list(value)

    def _remember(self, key: str, path: str) -> list[str]:
        """Put ``path`` first in the list under ``key`` (at most MAX_RECENT); returns the list."""
        path = os.path.abspath(path)
        paths = ([path] + [p for p in self._recent(key) if p != path])[:MAX_RECENT]
        self.qsettings.setValue(key, paths)
        return paths

    # ------------------------------------------------------------ drag and drop

    @staticmethod
    def _dropped(path: str) -> str | None:
        """What a dropped path is: "weights", "model" (an .onnx file or a folder), or None."""
        if path.endswith(".safetensors"):
            return "weights"
        if path.lower().endswith(".onnx") or os.path.isdir(path):
            return "model"
        return None

    def dragEnterEvent(self, event) -> None:
        if any(self._dropped(u.toLocalFile()) for u in event.mimeData().urls()):
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        for url in event.mimeData().urls():
            path = url.toLocalFile()
            kind = self._dropped(path)
            if kind:
                event.acceptProposedAction()
                if kind == "weights":
                    self.load_weights(path)
                else:
                    self.load_model(path, {})
                return

    # ------------------------------------------------------------ graphs

    def _model_changed(self) -> None:
        s = self.state
        self.model_panel.set_model(s.source, s.settings)
        self.model_label.setText(f"{s.model_name} · {len(s.graphs['original'].nodes)} nodes")
        self.setWindowTitle(f"{s.model_name} — Meganeura Studio")
        self.graph_view.graph = None
        self.show_graph(self.graph_view.kind)     # "optimized" (the default): optimizes in a worker

    def show_graph(self, kind: str) -> None:
        if kind == "optimized" and self.state.graphs.get("optimized") is None:
            fn, why = optimizer_import()
            if fn is None:
                self.graph_view.show_graph(None, kind, f"Optimizer not available ({why}).")
                return
            self.graph_view.show_graph(None, kind, "Optimizing… (see the Fusion report)")
            self.fusion_panel.run_optimizer()
            return
        p = self.state.profile
        if kind == "training" and p is not None and p.train:      # the one profiled: it has GPU times
            self.graph_view.show_graph(p.graph, kind, note="as profiled")
            return
        try:
            graph = self.state.graph(kind)
        except MeganeuraError as exc:
            self.show_error(f"Cannot build the {kind} graph", exc)
            return
        self.graph_view.show_graph(graph, kind)

    def _optimized_ready(self) -> None:
        if self.graph_view.kind == "optimized":
            self.graph_view.graph = None
            self.show_graph("optimized")

    def select_dispatch(self, index: int) -> list[int]:
        """Select (and centre on) the graph nodes that profiled dispatch ``index`` runs."""
        return self.select_dispatches([index])

    def select_dispatches(self, indices: list[int]) -> list[int]:
        """Select the graph nodes that the profiled dispatches at ``indices`` (positions
        in a step: a kernel's, from the roofline or the kernel table) run."""
        p = self.state.profile
        indices = [i for i in indices if 0 <= i < len(p.dispatch_nodes)] if p is not None else []
        if not indices:
            return []
        nodes = list(dict.fromkeys(n for i in indices for n in p.dispatch_nodes[i]))
        self._show_profiled_graph()
        self.graph_view.select(nodes)
        return nodes

    def _show_profiled_graph(self) -> None:
        p = self.state.profile
        if self.graph_view.graph is not p.graph:
            self.graph_view.show_graph(p.graph, "training" if p.train else "optimized",
                                       note="as profiled" if p.train else "")

    def select_module(self, path: str) -> bool:
        """Select a module (a row of the profiler's Per module table) in the profiled graph."""
        if self.state.profile is None:
            return False
        self._show_profiled_graph()
        return self.graph_view.select_module(path)

    def _graph_selection(self, nodes: list) -> None:
        """Nodes the user selected in the graph: their kernel's row in the kernel table and
        their block's row in the module table (without selecting anything back)."""
        p = self.state.profile
        if p is None or self.graph_view.graph is not p.graph:
            return
        kernels = [d["kernel"] for n in nodes for d in p.node_dispatches.get(n, [])]
        panel = self.profiler_panel
        if kernels:
            rows = panel.kernel_model.find(0, kernels[0])
            if rows:
                panel.kernel_table.selectRow(rows[0])
        blocks = {r for r in panel.module_table.names()
                  if any(self.graph_view.graph[n].module == r or self.graph_view.graph[n].module.startswith(r + ".")
                         for n in nodes)}
        if len(blocks) == 1:
            panel.module_table.select(blocks.pop())

    def _session_changed(self) -> None:
        s = self.state
        if s.session is None:
            self.memory_label.setText("GPU memory: no session")
            return
        plan = s.session.plan
        self.memory_label.setText(f"GPU memory: {fmt_bytes(plan.peak_bytes)} peak ({s.session_label})")
        self.memory_label.setToolTip(f"{plan.peak_bytes:,} bytes at peak with buffer reuse, "
                                     f"{plan.peak_bytes_without_reuse:,} without")

    def highlight_rule(self, rule: str, ids: list) -> list[int]:
        self.tabs.setCurrentWidget(self.graph_view)
        if self.graph_view.kind != "optimized" or self.graph_view.graph is not self.state.graphs.get("optimized"):
            self.show_graph("optimized")
        return self.graph_view.highlight(ids)

    # ------------------------------------------------------------ training

    def start_training(self) -> None:
        self.tabs.setCurrentWidget(self.training_panel)
        self.training_panel.start()

    def resume_run(self, path: str) -> None:
        """The Runs panel's Resume: the Training tab continues the run directory ``path``."""
        self.tabs.setCurrentWidget(self.training_panel)
        self.training_panel.resume_run(path)

    def start_profile(self) -> None:
        self.tabs.setCurrentWidget(self.profiler_panel)
        self.profiler_panel.run()

    def wait_for_workers(self, seconds: float = 10.0) -> None:
        """Stop the training run, cancel the profile, wait for every worker thread."""
        import time
        from PySide6.QtWidgets import QApplication
        self.training_panel.stop()
        self.profiler_panel.cancel()
        self.generate_panel.stop()
        end = time.monotonic() + seconds
        panels = (self.training_panel, self.profiler_panel, self.fusion_panel, self.generate_panel)
        while any(p.worker is not None for p in panels) and time.monotonic() < end:
            QApplication.processEvents()
            time.sleep(0.005)

    def showEvent(self, event) -> None:
        main_thread_gc.hold(self)       # again, if the window was closed and is shown anew
        super().showEvent(event)

    def closeEvent(self, event) -> None:
        try:
            self.training_panel.save_settings(self.qsettings)
            self.qsettings.sync()
            self.wait_for_workers()
            super().closeEvent(event)
        finally:
            panels = (self.training_panel, self.profiler_panel, self.fusion_panel, self.generate_panel)
            if all(p.worker is None for p in panels):   # else the window's destruction releases it
                main_thread_gc.release(self)
