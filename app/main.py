"""``meganeura-studio [SOURCE] [--weights F] [--set NAME=VALUE ...]``: the Studio.

With no model it opens on the last one used (first time: audio-align).
``--screenshot PATH`` renders the window, saves it as an image and exits (for tests
and docs); it reads and writes a throwaway settings file, never the user's.
$MEGANEURA_STUDIO_SETTINGS names an ini file to use instead of the user's settings.
Without a display, Qt renders offscreen.
"""

from __future__ import annotations

import argparse
import os
import sys

from .window import DEFAULT_MODEL, MainWindow


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meganeura-studio", description="Meganeura Studio")
    parser.add_argument("model", nargs="?", metavar="SOURCE",
                        help=f"a built-in model name, an .onnx file or a Hugging Face checkpoint folder "
                             f"(default: the last one opened; first time {DEFAULT_MODEL})")
    parser.add_argument("--weights", metavar="F", help="safetensors weights for the model")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a model setting, e.g. --set batch=8 (repeatable)")
    parser.add_argument(
        "--screenshot", metavar="PATH", help="save an image of the window to PATH and exit"
    )
    return parser.parse_args(argv)


def _ensure_platform() -> None:
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def create_window(model: str | None = None, weights: str | None = None, settings=None,
                  model_settings: dict | None = None) -> MainWindow:
    return MainWindow(model, weights, settings=settings, model_settings=model_settings)


def main(argv=None) -> int:
    args = parse_args(argv)
    _ensure_platform()
    from PySide6.QtWidgets import QApplication

    from engine import config
    from engine.errors import MeganeuraError
    from engine.models import parse_overrides

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Meganeura Studio")
    app.setOrganizationName("Meganeura")
    app.setDesktopFileName("meganeura-studio")     # resources/meganeura-studio.desktop
    from .theme import icon
    app.setWindowIcon(icon())
    try:
        overrides = parse_overrides(args.set)
        config.current()   # a bad MEGANEURA_* value, said before any window opens
    except MeganeuraError as exc:
        print(f"meganeura-studio: error: {exc}", file=sys.stderr)
        if not args.screenshot:
            from PySide6.QtWidgets import QMessageBox
            QMessageBox.critical(None, "Meganeura Studio", f"The Studio cannot start: {exc}")
        return 2
    settings = None
    if args.screenshot:
        import tempfile
        from PySide6.QtCore import QSettings
        settings = QSettings(os.path.join(tempfile.mkdtemp(prefix="meganeura-studio-"), "studio.ini"),
                             QSettings.Format.IniFormat)
    window = create_window(args.model, args.weights, settings=settings, model_settings=overrides)
    window.show()
    if args.screenshot:
        window.wait_for_workers(120)          # the optimizer, so the optimized graph is drawn
        for _ in range(5):
            app.processEvents()
        if not window.grab().save(args.screenshot):
            print(f"meganeura-studio: error: cannot save a screenshot to {args.screenshot}", file=sys.stderr)
            return 2
        return 0
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
