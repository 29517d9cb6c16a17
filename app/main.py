"""``meganeura-studio``: the Studio window (a first, minimal version).

Shows the adapter the engine uses and the doctor report. ``--screenshot PATH``
renders the window, saves it as an image and exits (for tests and docs).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meganeura-studio", description="Meganeura Studio")
    parser.add_argument("model", nargs="?", metavar="MODEL", help="built-in model to open")
    parser.add_argument("--weights", metavar="F", help="safetensors weights for the model")
    parser.add_argument(
        "--screenshot", metavar="PATH", help="save an image of the window to PATH and exit"
    )
    return parser.parse_args(argv)


def _ensure_platform() -> None:
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def adapter_line(info: dict) -> str:
    kind = "software" if info["software"] else "hardware"
    return f"{info['name']} · {info['backend']} · {kind}"


def doctor_text() -> tuple[str, str]:
    """(status bar line, doctor panel text); errors become readable text."""
    from engine.cli import doctor_report, format_doctor
    from engine.errors import MeganeuraError

    try:
        report = doctor_report()
    except MeganeuraError as exc:
        return f"No GPU adapter: {exc}", f"No GPU adapter.\n\n{exc}"
    return adapter_line(report["adapter"]), format_doctor(report)


def create_window(model: str | None = None, weights: str | None = None):
    from PySide6.QtGui import QFontDatabase
    from PySide6.QtWidgets import QLabel, QMainWindow, QPlainTextEdit

    status, text = doctor_text()
    window = QMainWindow()
    window.setWindowTitle("Meganeura Studio")
    panel = QPlainTextEdit()
    panel.setReadOnly(True)
    panel.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
    header = []
    if model:
        header.append(f"Model: {model}" + (f"   weights: {weights}" if weights else ""))
        header.append("")
    panel.setPlainText("\n".join(header) + text)
    panel.setObjectName("doctorPanel")
    window.setCentralWidget(panel)
    label = QLabel(status)
    label.setObjectName("adapterLabel")
    window.statusBar().addPermanentWidget(label)
    window.resize(900, 640)
    return window


def main(argv=None) -> int:
    args = parse_args(argv)
    _ensure_platform()
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Meganeura Studio")
    window = create_window(args.model, args.weights)
    window.show()
    if args.screenshot:
        for _ in range(5):
            app.processEvents()
        if not window.grab().save(args.screenshot):
            print(f"meganeura-studio: error: cannot save a screenshot to {args.screenshot}", file=sys.stderr)
            return 2
        return 0
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
