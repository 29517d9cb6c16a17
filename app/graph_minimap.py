"""The graph view's overview: the whole scene, small, beside the canvas, with the visible
part outlined; click or drag in it to move there.

The scene is rendered once into a pixmap whenever it changes (a layout, new colours), so
panning and zooming only repaint the outline.
"""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QWidget

HEIGHT = 190


class Minimap(QWidget):
    def __init__(self, canvas, parent=None):
        super().__init__(parent)
        self.canvas = canvas
        self.setObjectName("graphMinimap")
        self.setMinimumWidth(120)
        self.setFixedHeight(HEIGHT)
        self.setCursor(Qt.CursorShape.PointingHandCursor)
        self.setToolTip("Overview: click or drag to move the view")
        self.pixmap: QPixmap | None = None
        self.scene_rect = QRectF()
        self.target = QRectF()
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.render_scene)
        canvas.viewChanged.connect(self.update)

    def scene_changed(self) -> None:
        """Render the scene again soon (once, however many changes come first)."""
        self._timer.start(0)

    def render_scene(self) -> None:
        scene = self.canvas.scene()
        rect = scene.itemsBoundingRect()
        if rect.isEmpty():
            self.pixmap = None
            self.update()
            return
        rect = rect.adjusted(-20, -20, 20, 20)
        area = QRectF(4, 4, self.width() - 8, self.height() - 8)
        s = min(area.width() / rect.width(), area.height() / rect.height())
        w, h = rect.width() * s, rect.height() * s
        self.target = QRectF(area.left() + (area.width() - w) / 2, area.top() + (area.height() - h) / 2, w, h)
        self.scene_rect = rect
        pix = QPixmap(max(1, round(w)), max(1, round(h)))
        pix.fill(QColor(255, 255, 255, 0))
        painter = QPainter(pix)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        scene.render(painter, QRectF(0, 0, pix.width(), pix.height()), rect)
        painter.end()
        self.pixmap = pix
        self.update()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self.scene_changed()

    def _to_scene(self, p: QPointF) -> QPointF:
        s = self.scene_rect.width() / self.target.width() if self.target.width() else 1.0
        return QPointF(self.scene_rect.left() + (p.x() - self.target.left()) * s,
                       self.scene_rect.top() + (p.y() - self.target.top()) * s)

    def _to_map(self, p: QPointF) -> QPointF:
        s = self.target.width() / self.scene_rect.width() if self.scene_rect.width() else 1.0
        return QPointF(self.target.left() + (p.x() - self.scene_rect.left()) * s,
                       self.target.top() + (p.y() - self.scene_rect.top()) * s)

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setPen(QPen(QColor(120, 130, 145, 200), 1))
        painter.setBrush(QColor(250, 251, 252, 225))
        painter.drawRoundedRect(QRectF(0.5, 0.5, self.width() - 1, self.height() - 1), 6, 6)
        if self.pixmap is None:
            return
        painter.drawPixmap(self.target.topLeft(), self.pixmap)
        vp = self.canvas.viewport().rect()
        seen = self.canvas.mapToScene(vp).boundingRect()
        box = QRectF(self._to_map(seen.topLeft()), self._to_map(seen.bottomRight())).intersected(
            QRectF(self.rect()).adjusted(1, 1, -1, -1))
        painter.setPen(QPen(QColor("#1f5fbf"), 1.5))
        painter.setBrush(QColor(31, 95, 191, 40))
        painter.drawRect(box)

    def mousePressEvent(self, event) -> None:
        self._move_to(event.position())

    def mouseMoveEvent(self, event) -> None:
        if event.buttons() & Qt.MouseButton.LeftButton:
            self._move_to(event.position())

    def _move_to(self, p: QPointF) -> None:
        if self.pixmap is None:
            return
        self.canvas.auto_fit = False
        self.canvas.centerOn(self._to_scene(p))
        self.update()
