"""Model panel: pick a model (built-in, or an .onnx file or checkpoint folder opened
before) and its settings, Load; what the open model takes and gives; weights and recent files."""

from __future__ import annotations

import html
import os

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel,
                               QLineEdit, QListWidget, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from engine import models

MAX_RECENT = 8


class ModelPanel(QWidget):
    loadRequested = Signal(str, dict)       # model source, settings
    openModelRequested = Signal(str)        # "file" (.onnx) or "folder" (checkpoint): the window's dialogs
    openWeightsRequested = Signal()         # the file dialog (the window owns it)
    recentRequested = Signal(str)           # a recent weights file

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.model_box = QComboBox()
        self.model_box.setObjectName("modelBox")
        self.model_box.addItems(models.names())
        self.model_box.currentIndexChanged.connect(lambda _: self._rebuild_settings(self.source()))
        self.description = QLabel("")
        self.description.setWordWrap(True)
        self.form = QFormLayout()
        self.editors: dict[str, QWidget] = {}
        settings_box = QGroupBox("Settings")
        settings_box.setLayout(self.form)
        self.load_button = QPushButton("Load model")
        self.load_button.setObjectName("loadModelButton")
        self.load_button.clicked.connect(lambda: self.loadRequested.emit(self.source(), self.values()))
        self.open_onnx_button = QPushButton("Open .onnx…")
        self.open_onnx_button.setObjectName("openOnnxButton")
        self.open_onnx_button.setToolTip("an ONNX model file (or drop one on the window)")
        self.open_onnx_button.clicked.connect(lambda: self.openModelRequested.emit("file"))
        self.open_folder_button = QPushButton("Open folder…")
        self.open_folder_button.setObjectName("openCheckpointButton")
        self.open_folder_button.setToolTip("a Hugging Face checkpoint folder: config.json + model.safetensors "
                                           "(or drop one on the window)")
        self.open_folder_button.clicked.connect(lambda: self.openModelRequested.emit("folder"))
        self.weights_button = QPushButton("Open weights… (Ctrl+O)")
        self.weights_button.clicked.connect(self.openWeightsRequested)
        self.info = QLabel("")
        self.info.setObjectName("modelInfo")
        self.info.setWordWrap(True)
        self.recent = QListWidget()
        self.recent.setObjectName("recentFiles")
        self.recent.itemActivated.connect(lambda item: self.recentRequested.emit(item.text()))

        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("<b>Model</b>"))
        layout.addWidget(self.model_box)
        opens = QHBoxLayout()
        opens.addWidget(self.open_onnx_button)
        opens.addWidget(self.open_folder_button)
        layout.addLayout(opens)
        layout.addWidget(self.description)
        layout.addWidget(settings_box)
        layout.addWidget(self.load_button)
        layout.addWidget(self.weights_button)
        layout.addWidget(self.info)
        layout.addWidget(QLabel("<b>Recent weights</b> (double-click; or drop a .safetensors file, an .onnx "
                                "file or a checkpoint folder on the window)", wordWrap=True))
        layout.addWidget(self.recent, 1)
        self._rebuild_settings(self.source())
        state.modelChanged.connect(self.refresh)
        state.paramsChanged.connect(self.refresh)

    def source(self) -> str:
        """The selected model: a built-in name, or the path of a model file or folder."""
        return self.model_box.currentData() or self.model_box.currentText()

    def set_recent_models(self, paths: list[str]) -> None:
        """Built-in models first, then the model files and folders opened before."""
        current = self.source()
        self.model_box.blockSignals(True)
        self.model_box.clear()
        self.model_box.addItems(models.names())
        for path in paths:
            self.model_box.addItem(os.path.basename(path.rstrip("/")) or path, path)
            self.model_box.setItemData(self.model_box.count() - 1, path, Qt.ItemDataRole.ToolTipRole)
        self._select(current)
        self.model_box.blockSignals(False)

    def _select(self, source: str) -> None:
        index = self.model_box.findData(source)
        if index < 0:
            index = self.model_box.findText(source)
        if index < 0 and source:
            self.model_box.addItem(os.path.basename(source.rstrip("/")) or source, source)
            index = self.model_box.count() - 1
        self.model_box.setCurrentIndex(max(index, 0))

    def _settings_of(self, source: str):
        """(description, settings table) of ``source``: a built-in's class, else the open
        model when it is that file (an imported model's settings come from the file)."""
        if source in models.names():
            cls = models.get(source)
            return cls.description, cls.describe_settings()
        model = self.state.model
        if model is not None and self.state.source == source:
            return model.description, {k: s.describe() for k, s in model.SETTINGS.items()}
        return f"{source}: press Load model to open it.", {}

    def _rebuild_settings(self, source: str, values: dict | None = None) -> None:
        while self.form.rowCount():
            self.form.removeRow(0)
        self.editors = {}
        description, table = self._settings_of(source)
        self.description.setText(description)
        for key, meta in table.items():
            value = (values or {}).get(key, meta["default"])
            if meta["type"] == "int":
                w = QSpinBox()
                w.setRange(1, meta.get("maximum", 10_000_000))
                w.setValue(int(value))
            elif meta["type"] == "float":
                w = QDoubleSpinBox()
                w.setDecimals(4)
                w.setRange(-1e9, 1e9)
                w.setValue(float(value))
            else:
                w = QLineEdit(str(value))
            w.setObjectName(f"setting_{key}")
            w.setToolTip(meta["help"])
            self.form.addRow(key, w)
            self.editors[key] = w

    def values(self) -> dict:
        out = {}
        for key, w in self.editors.items():
            out[key] = w.value() if hasattr(w, "value") else w.text()
        return out

    def set_model(self, source: str, settings: dict) -> None:
        self.model_box.blockSignals(True)
        self._select(source)
        self.model_box.blockSignals(False)
        self._rebuild_settings(source, settings)

    def refresh(self) -> None:
        s = self.state
        if s.model is None:
            self.info.setText("No model loaded.")
            return
        n = sum(int(v.size) for v in s.params.values())
        settings = ", ".join(f"{k}={v}" for k, v in s.settings.items())
        g = s.graphs.get("original")
        tensors = lambda names: "<br>".join(  # noqa: E731
            f"&nbsp;&nbsp;{k} {list(g.shape(i))} {g[i].dtype}" for k, i in names.items()) if g else ""
        origin = ("initialised (seed 0) or trained in this session" if s.source in models.names()
                  else f"from {s.source}")
        self.info.setText(f"<b>{s.model_name}</b> ({settings})<br>{len(g.nodes) if g else 0} nodes · "
                          f"{len(s.params)} tensors · {n:,} parameters<br>"
                          f"<i>inputs</i><br>{tensors(g.inputs) if g else ''}<br><i>outputs</i><br>"
                          f"{tensors(g.outputs) if g else ''}"
                          f"<br>weights: {s.weights_path or origin}"
                          + "".join(f"<br><i>{html.escape(note)}</i>" for note in s.model.notes))

    def set_recent(self, paths: list[str]) -> None:
        self.recent.clear()
        self.recent.addItems(paths)
