"""Model panel: pick a built-in model and its settings, Load; weights and recent files."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFormLayout, QGroupBox, QLabel,
                               QLineEdit, QListWidget, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from engine import models

MAX_RECENT = 8


class ModelPanel(QWidget):
    loadRequested = Signal(str, dict)       # model name, settings
    openWeightsRequested = Signal()         # the file dialog (the window owns it)
    recentRequested = Signal(str)           # a recent weights file

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.model_box = QComboBox()
        self.model_box.setObjectName("modelBox")
        self.model_box.addItems(models.names())
        self.model_box.currentTextChanged.connect(self._rebuild_settings)
        self.description = QLabel("")
        self.description.setWordWrap(True)
        self.form = QFormLayout()
        self.editors: dict[str, QWidget] = {}
        settings_box = QGroupBox("Settings")
        settings_box.setLayout(self.form)
        self.load_button = QPushButton("Load model")
        self.load_button.setObjectName("loadModelButton")
        self.load_button.clicked.connect(lambda: self.loadRequested.emit(self.model_box.currentText(),
                                                                         self.values()))
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
        layout.addWidget(self.description)
        layout.addWidget(settings_box)
        layout.addWidget(self.load_button)
        layout.addWidget(self.weights_button)
        layout.addWidget(self.info)
        layout.addWidget(QLabel("<b>Recent weights</b> (double-click; or drop a .safetensors file)"))
        layout.addWidget(self.recent, 1)
        self._rebuild_settings(self.model_box.currentText())
        state.modelChanged.connect(self.refresh)
        state.paramsChanged.connect(self.refresh)

    def _rebuild_settings(self, name: str, values: dict | None = None) -> None:
        while self.form.rowCount():
            self.form.removeRow(0)
        self.editors = {}
        cls = models.get(name)
        self.description.setText(cls.description)
        for key, meta in cls.describe_settings().items():
            value = (values or {}).get(key, meta["default"])
            if meta["type"] == "int":
                w = QSpinBox()
                w.setRange(1, 10_000_000)
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

    def set_model(self, name: str, settings: dict) -> None:
        self.model_box.blockSignals(True)
        self.model_box.setCurrentText(name)
        self.model_box.blockSignals(False)
        self._rebuild_settings(name, settings)

    def refresh(self) -> None:
        s = self.state
        if s.model is None:
            self.info.setText("No model loaded.")
            return
        n = sum(int(v.size) for v in s.params.values())
        settings = ", ".join(f"{k}={v}" for k, v in s.settings.items())
        g = s.graphs.get("original")
        self.info.setText(f"<b>{s.model_name}</b> ({settings})<br>{len(g.nodes) if g else 0} nodes · "
                          f"{len(s.params)} tensors · {n:,} parameters<br>weights: "
                          f"{s.weights_path or 'initialised (seed 0) or trained in this session'}")

    def set_recent(self, paths: list[str]) -> None:
        self.recent.clear()
        self.recent.addItems(paths)
