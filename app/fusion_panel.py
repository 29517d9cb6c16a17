"""The fusion report: rules that fired, counts, bytes saved, where in the model (the
modules of the nodes each produced) and before/after totals, then the graph passes that
follow the rules (engine.optimize.passes), so that the report describes the graph an
inference session runs.

Runs ``engine.optimize.passes.optimize_inference`` in a worker thread (superqt
``thread_worker``); selecting a row asks the graph view to highlight the nodes that rule
or pass produced.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QPushButton,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)
from superqt.utils import thread_worker

from engine.graph.modules import describe

from .graph_view import fmt_bytes
from .state import optimizer_import


class _NumItem(QTableWidgetItem):
    def __init__(self, value: float, text: str):
        super().__init__(text)
        self.value = value
        self.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)

    def __lt__(self, other):
        return self.value < getattr(other, "value", 0)


class FusionPanel(QWidget):
    ruleSelected = Signal(str, list)     # rule name, optimized-graph node ids
    failed = Signal(object)              # an exception for the window's error dialog

    def __init__(self, state, parent=None):
        super().__init__(parent)
        self.state = state
        self.worker = None
        self.run_button = QPushButton("Optimize")
        self.run_button.setObjectName("optimizeButton")
        self.run_button.clicked.connect(self.run_optimizer)
        self.status = QLabel("")
        self.status.setObjectName("fusionStatus")
        self.status.setWordWrap(True)
        self.totals = QLabel("")
        self.totals.setObjectName("fusionTotals")
        self.totals.setTextFormat(Qt.TextFormat.RichText)
        self.table = QTableWidget(0, 4)
        self.table.setObjectName("fusionTable")
        self.table.setHorizontalHeaderLabels(["Rule", "Fired", "Bytes saved", "Where"])
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().setVisible(False)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.itemSelectionChanged.connect(self._row_selected)
        top = QHBoxLayout()
        top.addWidget(self.run_button)
        top.addWidget(self.status, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.totals)
        layout.addWidget(self.table, 1)
        state.modelChanged.connect(self.clear)
        state.optimizedChanged.connect(self.refresh)
        self.clear()

    def available(self) -> bool:
        return optimizer_import()[0] is not None

    def clear(self) -> None:
        self.table.setRowCount(0)
        fn, why = optimizer_import()
        if fn is None:
            self.run_button.setEnabled(False)
            self.status.setText(f"Optimizer not available ({why}).")
        else:
            self.run_button.setEnabled(self.state.model is not None)
            self.status.setText("Optimizing the original graph (press Optimize to run it again).")
        self.totals.setText("")

    def run_optimizer(self):
        fn, why = optimizer_import()
        if fn is None or self.state.model is None or self.worker is not None:
            return None
        graph = self.state.graph("original")
        self.run_button.setEnabled(False)
        self.status.setText(f"Optimizing {self.state.model_name} ({len(graph.nodes)} nodes)…")

        @thread_worker
        def work():
            return fn(graph)

        worker = work(_start_thread=False, _ignore_errors=True)
        self.worker = worker

        def done(result, graph=graph):
            if self.state.graphs.get("original") is graph:     # still the same model
                self.state.set_optimized(*result)

        def failed(exc):
            self.status.setText(f"Optimization failed: {exc}")
            self.failed.emit(exc)

        def finished(graph=graph):
            self.worker = None
            self.run_button.setEnabled(True)
            current = self.state.graphs.get("original")
            if current is not None and current is not graph and self.state.graphs.get("optimized") is None:
                self.run_optimizer()         # the model changed while this one ran

        worker.returned.connect(done)
        worker.errored.connect(failed)
        worker.finished.connect(finished)
        worker.start()
        return worker

    def refresh(self) -> None:
        d = self.state.report_dict()
        self.table.setSortingEnabled(False)
        self.table.setRowCount(0)
        if d is None:
            return
        from engine.optimize.passes import WHY      # importable: it made the report
        rules = {k: v for k, v in (d.get("rules") or {}).items() if v}   # the rules that fired
        passes = {k: v for k, v in (d.get("passes") or {}).items() if v}
        saved = d.get("rule_bytes_saved") or {}
        where = d.get("rule_modules") or {}
        self.table.setRowCount(len(rules) + len(passes))
        rows = sorted(rules.items(), key=lambda kv: -kv[1]) + list(passes.items())
        for row, (name, count) in enumerate(rows):
            item = QTableWidgetItem(name)
            if name in passes:                      # in italics, as the status line names them
                font = item.font()
                font.setItalic(True)
                item.setFont(font)
                item.setToolTip(f"A graph pass after the fusion rules: {WHY.get(name, name)}. It rewrote "
                                f"{count} nodes; dispatches saved: "
                                f"{(d.get('pass_dispatches_saved') or {}).get(name, 0)}.")
            self.table.setItem(row, 0, item)
            self.table.setItem(row, 1, _NumItem(count, str(count)))
            b = saved.get(name)
            self.table.setItem(row, 2, _NumItem(b or 0, fmt_bytes(b) if b is not None else "–"))
            place = describe(where[name], most=1) if where.get(name) else ""
            self.table.setItem(row, 3, QTableWidgetItem(place))
            self.table.item(row, 3).setToolTip(describe(where.get(name) or {}, most=20))
        self.table.setSortingEnabled(True)
        self.table.sortItems(1, Qt.SortOrder.DescendingOrder)

        def pair(key, fmt=str):
            a, b = d.get(f"{key}_before"), d.get(f"{key}_after")
            if a is None or b is None:
                return "–"
            return f"{fmt(a)} → <b>{fmt(b)}</b>"
        self.totals.setText(
            f"Nodes {pair('nodes')} &nbsp; Dispatches {pair('dispatches')} &nbsp; "
            f"Bytes {pair('bytes', fmt_bytes)}<br>"
            f"{'saturated' if d.get('saturated') else 'not saturated'} in {d.get('seconds', 0):.2f} s")
        then = (f", then {len(passes)} graph pass{'es' if len(passes) > 1 else ''} ({', '.join(passes)})"
                if passes else "")
        self.status.setText(f"{sum(rules.values())} rewrites from {len(rules)} rules{then}.")

    def _row_selected(self) -> None:
        rows = {i.row() for i in self.table.selectedItems()}
        if not rows:
            return
        name = self.table.item(rows.pop(), 0).text()
        self.ruleSelected.emit(name, self.state.rule_nodes(name))
