"""Render resources/icon.svg to resources/icon-<N>.png (N = 16, 32, 64, 128, 256).

    .venv/bin/python scripts/render_icon.py

Run it after editing the SVG and commit the PNGs: the window loads all of them into
one QIcon (and desktops that cannot read SVG use them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (16, 32, 64, 128, 256)
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def render(svg: Path, out_dir: Path, sizes=SIZES) -> list[Path]:
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"render_icon: cannot read {svg}")
    written = []
    for size in sizes:
        image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHints(QPainter.RenderHint.Antialiasing | QPainter.RenderHint.SmoothPixmapTransform)
        renderer.render(painter)
        painter.end()
        path = out_dir / f"icon-{size}.png"
        if not image.save(str(path)):
            raise SystemExit(f"render_icon: cannot write {path}")
        written.append(path)
    return written


def main() -> int:
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 (fonts, image I/O)
    for path in render(ROOT / "resources" / "icon.svg", ROOT / "resources"):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
