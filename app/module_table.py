"""The profiler's "Per module" table: GPU time per block of the model (its layers and the
modules beside them, ``ProfileReport.per_module``), in model order. Clicking a row
selects that module in the graph view."""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, Signal
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from .records import RecordsModel, fit_columns, records_table

MODULE_COLUMNS = ["Module", "Kernels", "Calls", "GPU µs total", "GPU µs / step", "% of GPU", "GB/s", "TFLOP/s"]


class ModuleTable(QWidget):
    moduleSelected = Signal(str)       # a module path (or "(top level)", "(optimizer step)")

    def __init__(self, parent=None):
        super().__init__(parent)
        self.model = RecordsModel(MODULE_COLUMNS, self)
        self.table = records_table(self.model)
        self.table.setObjectName("moduleTable")
        self.table.clicked.connect(self._clicked)
        self.note = QLabel("Per block of the model (its layers and the modules beside them), in model order; "
                           "every dispatch counts in one row. Click a row to select the module in the graph.")
        self.note.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.note)
        layout.addWidget(self.table, 1)

    def clear(self) -> None:
        self.model.set_rows([])

    def show_profile(self, report) -> None:
        rows = []
        for order, m in enumerate(report.per_module()):
            us = lambda ns: f"{ns / 1e3:,.1f}"
            rows.append(([m["name"], str(m["kernels"]), str(m["calls"]), us(m["gpu_ns"]), us(m["gpu_ns_per_step"]),
                          f"{m['percent']:.1f}", f"{m['gb_per_s']:.2f}", f"{m['tflop_per_s']:.4f}"],
                         [order, m["kernels"], m["calls"], m["gpu_ns"], m["gpu_ns_per_step"], m["percent"],
                          m["gb_per_s"], m["tflop_per_s"], m["name"]]))
        self.model.set_rows(rows, right={1, 2, 3, 4, 5, 6, 7})
        fit_columns(self.table)

    def names(self) -> list[str]:
        """The rows' modules, in the order shown."""
        return [self.model.key(r, 8) for r in range(self.model.rowCount())]

    def select(self, name: str) -> bool:
        rows = self.model.find(8, name)
        if rows:
            self.table.selectRow(rows[0])
        return bool(rows)

    def _clicked(self, index: QModelIndex) -> None:
        if index.isValid():
            self.moduleSelected.emit(self.model.key(index.row(), 8))
