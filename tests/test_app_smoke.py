import subprocess
import sys
from pathlib import Path

from app.main import create_window
from engine.runtime.device import adapter_info

ROOT = Path(__file__).resolve().parent.parent


def test_window_shows_adapter(qtbot):
    from PySide6.QtWidgets import QLabel, QPlainTextEdit

    window = create_window()
    qtbot.addWidget(window)
    window.show()
    assert window.windowTitle() == f"{window.state.model_name} — Meganeura Studio"
    name = adapter_info()["name"]
    label = window.statusBar().findChild(QLabel, "adapterLabel")
    assert name in label.text()
    assert "timestamp-query" in window.findChild(QPlainTextEdit, "doctorPanel").toPlainText()


def test_screenshot(tmp_path):
    shot = tmp_path / "studio.png"
    result = subprocess.run(
        [sys.executable, "-m", "app.main", "--screenshot", str(shot)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1024


def test_a_bad_environment_setting_stops_the_studio_with_one_line(tmp_path):
    import os
    shot = tmp_path / "studio.png"
    result = subprocess.run(
        [sys.executable, "-m", "app.main", "--screenshot", str(shot)], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env={**os.environ, "MEGANEURA_PRECISION": "f64"},
    )
    assert result.returncode == 2 and not shot.exists()
    assert result.stderr == "meganeura-studio: error: MEGANEURA_PRECISION='f64' is not one of f32, f16\n"
