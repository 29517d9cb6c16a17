"""The Compare view: a saved profile (A, the baseline) beside the current one (B, or a
second file), kernel by kernel (``engine.runtime.compare``, what ``meganeura compare``
prints): GPU µs per step in each, the change, B/A; green where B is faster, red where
it is slower (by more than ``NOISE`` either way), grey for kernels in only one."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.errors import MeganeuraError
from engine.runtime.compare import compare_profiles, load_profile
from engine.runtime.report import short_kernel

from .records import RecordsModel, fit_columns, records_table

COLUMNS = ["Kernel", "A µs/step", "B µs/step", "Δ µs/step", "B/A", "A calls/step", "B calls/step"]
NOISE = 0.02                  # changes within 2% are not coloured
FASTER, SLOWER, ONLY_ONE = "#5a00b400", "#5ae03030", "#30808080"   # translucent: legible on light and dark


def _us(ns: float | None) -> str:
    return "" if ns is None else f"{ns / 1e3:,.1f}"


def _colour(ratio: float | None) -> str | None:
    if ratio is None:
        return None
    return FASTER if ratio < 1 - NOISE else SLOWER if ratio > 1 + NOISE else None


def comparison_rows(c: dict) -> list[tuple]:
    """Table rows (display, sort keys, colour) of a ``compare_profiles`` result: the
    matched kernels, then those in only one profile."""
    rows = []
    for r in c["rows"]:
        ratio = r["ratio"]
        rows.append(([short_kernel(r["name"]), _us(r["a_ns"]), _us(r["b_ns"]), f"{r['delta_ns'] / 1e3:+,.1f}",
                      f"{ratio:.2f}" if ratio is not None else "—", f"{r['a_calls']:g}", f"{r['b_calls']:g}"],
                     [r["name"], r["a_ns"], r["b_ns"], r["delta_ns"], ratio, r["a_calls"], r["b_calls"]],
                     _colour(ratio)))
    for k in c["only_a"]:
        rows.append(([short_kernel(k["name"]), _us(k["a_ns"]), "only in A", f"{-k['a_ns'] / 1e3:+,.1f}", "—", "", ""],
                     [k["name"], k["a_ns"], None, -k["a_ns"], None, None, None], ONLY_ONE))
    for k in c["only_b"]:
        rows.append(([short_kernel(k["name"]), "only in B", _us(k["b_ns"]), f"{k['b_ns'] / 1e3:+,.1f}", "—", "", ""],
                     [k["name"], None, k["b_ns"], k["b_ns"], None, None, None], ONLY_ONE))
    return rows


class CompareView(QWidget):
    failed = Signal(str, object)          # title, exception -> error dialog

    def __init__(self, parent=None):
        super().__init__(parent)
        self.a: tuple[dict, str] | None = None         # (profile, where it came from)
        self.b_file: tuple[dict, str] | None = None
        self.current: dict | None = None               # the profile the panel shows
        self.comparison: dict | None = None
        self.summary = QLabel("Load a profile saved with “Save JSON…” (or meganeura profile --json) "
                              "to compare it with the current one.")
        self.summary.setObjectName("compareSummary")
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.load_b_button = QPushButton("Load B from a file…")
        self.load_b_button.setObjectName("compareLoadB")
        self.load_b_button.clicked.connect(lambda: self.load_b())
        self.current_button = QPushButton("B: the current profile")
        self.current_button.setObjectName("compareCurrent")
        self.current_button.clicked.connect(self.use_current)
        self.model = RecordsModel(COLUMNS, self)
        self.table = records_table(self.model)
        self.table.setObjectName("compareTable")
        bar = QHBoxLayout()
        bar.addWidget(self.summary, 1)
        bar.addWidget(self.load_b_button)
        bar.addWidget(self.current_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(bar)
        layout.addWidget(self.table, 1)
        self._update_buttons()

    # ------------------------------------------------------------ inputs

    def _load(self, side: str, path: str | None, title: str) -> bool:
        """Read a profile from ``path`` (None: a file dialog titled ``title``) into
        ``side`` ("a" or "b_file") and compare again; a bad file is a dialog."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, title, "", "Profile JSON (*.json);;All files (*)")
            if not path:
                return False
        try:
            setattr(self, side, (load_profile(path), str(path)))
        except MeganeuraError as exc:
            self.failed.emit("Cannot load the profile", exc)
            return False
        self.refresh()
        return True

    def load_a(self, path: str | None = None) -> bool:
        """A (the baseline) from ``path`` (None: a file dialog)."""
        return self._load("a", path, "Load a profile to compare (A, the baseline)")

    def load_b(self, path: str | None = None) -> bool:
        """B from ``path`` instead of the current profile (None: a file dialog)."""
        return self._load("b_file", path, "Load the profile to compare with A (B)")

    def use_current(self) -> None:
        self.b_file = None
        self.refresh()

    def set_current(self, profile: dict | None) -> None:
        self.current = profile
        self.refresh()

    # ------------------------------------------------------------ the table

    def _b(self) -> tuple[dict, str] | None:
        if self.b_file is not None:
            return self.b_file
        return (self.current, "the current profile") if self.current is not None else None

    def refresh(self) -> None:
        b = self._b()
        self._update_buttons()
        if self.a is None or b is None:
            self.comparison = None
            self.model.set_rows([])
            if self.a is not None:
                self.summary.setText(f"A: {Path(self.a[1]).name}. Run a profile (or load B from a file) to "
                                     f"compare with it.")
            return
        try:
            c = compare_profiles(self.a[0], b[0], self.a[1], b[1])
        except MeganeuraError as exc:
            self.failed.emit("Cannot compare the profiles", exc)
            return
        self.comparison = c
        self.model.set_rows(comparison_rows(c), right={1, 2, 3, 4, 5, 6})
        self.table.horizontalHeader().setSortIndicator(-1, Qt.SortOrder.AscendingOrder)
        fit_columns(self.table, 520)
        self.summary.setText(self._summary(c))

    @staticmethod
    def _summary(c: dict) -> str:
        def side(s):
            where = s["source"] if s["source"] == "the current profile" else Path(s["source"]).name
            return f"<b>{where}</b> ({s['model']}, {s['adapter']}, {s['precision'] or 'f32'}, {s['steps']} steps)"
        ratio = c["ratio_total"]
        verdict = ("" if ratio is None else
                   f" — B is <b style='color:#2a8a2a'>{1 / ratio:.2f}× faster</b>" if ratio < 1 - NOISE else
                   f" — B is <b style='color:#c03030'>{ratio:.2f}× slower</b>" if ratio > 1 + NOISE else
                   " — about the same")
        text = (f"A: {side(c['a'])}<br>B: {side(c['b'])}<br>GPU per step: A {_us(c['a_total_ns'])} µs, "
                f"B {_us(c['b_total_ns'])} µs ({c['delta_total_ns'] / 1e3:+,.1f} µs){verdict}; "
                f"{len(c['rows'])} kernels in both, {len(c['only_a'])} only in A, {len(c['only_b'])} only in B")
        if c["notes"]:
            text += "<br><i>" + "; ".join(c["notes"]) + "</i>"
        return text

    def _update_buttons(self) -> None:
        self.current_button.setEnabled(self.b_file is not None and self.current is not None)
