"""Sortable tables of records for the profiler's views: a model of rows (display
values, sort keys, an optional background colour) that sorts itself, and the table
view settings they share."""

from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableView


TIP_AFTER = 24   # characters a cell shows before its whole text is also its tooltip


class RecordsModel(QAbstractTableModel):
    """Rows of (display values, sort keys[, background colour]); sorting happens here,
    not per item. A sort key of None sorts after every value."""

    def __init__(self, headers: list[str], parent=None):
        super().__init__(parent)
        self.headers = headers
        self.rows: list[tuple] = []
        self.right = set()

    def set_rows(self, rows, right=()) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.right = set(right)
        self.endResetModel()

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.headers)

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return row[0][index.column()]
        if role == Qt.ItemDataRole.UserRole:
            return row[1][index.column()]
        if role == Qt.ItemDataRole.ToolTipRole:   # a long kernel name is elided in its column
            value = row[0][index.column()]
            return value if isinstance(value, str) and len(value) > TIP_AFTER else None
        if role == Qt.ItemDataRole.BackgroundRole and len(row) > 2 and row[2]:
            return QColor(row[2])
        if role == Qt.ItemDataRole.TextAlignmentRole and index.column() in self.right:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return self.headers[section]
        return None

    def sort(self, column: int, order=Qt.SortOrder.AscendingOrder) -> None:
        self.layoutAboutToBeChanged.emit()
        descending = order == Qt.SortOrder.DescendingOrder
        present = [r for r in self.rows if r[1][column] is not None]
        missing = [r for r in self.rows if r[1][column] is None]
        present.sort(key=lambda r: r[1][column], reverse=descending)
        self.rows = present + missing
        self.layoutChanged.emit()

    def key(self, row: int, column: int):
        return self.rows[row][1][column]

    def find(self, column: int, key) -> list[int]:
        """The rows whose sort key in ``column`` is ``key``."""
        return [i for i, r in enumerate(self.rows) if r[1][column] == key]


def records_table(model, multi: bool = False) -> QTableView:
    """A read-only, sortable table of ``model``, selecting whole rows (one, or several with ``multi``)."""
    view = QTableView()
    view.setModel(model)
    view.setSortingEnabled(True)
    view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    view.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection if multi
                          else QAbstractItemView.SelectionMode.SingleSelection)
    view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    view.verticalHeader().setVisible(False)
    view.verticalHeader().setDefaultSectionSize(20)
    view.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
    view.horizontalHeader().setStretchLastSection(True)
    return view


def fit_columns(view: QTableView, widest: int = 320) -> None:
    """Columns as wide as their contents, none wider than ``widest`` pixels."""
    view.resizeColumnsToContents()
    for c in range(view.model().columnCount()):
        view.setColumnWidth(c, min(view.columnWidth(c), widest))
