"""Where the data files live: ``shaders/`` (WGSL templates) and ``resources/``.

In a checkout or an editable install they are the top-level folders of the
repository; a wheel installs them as ``engine/shaders`` and ``app/resources``.
"""

from __future__ import annotations

from pathlib import Path

_ENGINE = Path(__file__).resolve().parent


def _find(installed: Path, checkout: Path) -> Path:
    for candidate in (installed, checkout):
        if candidate.is_dir():
            return candidate
    return checkout


def shader_dir() -> Path:
    """Folder of the WGSL shader templates."""
    return _find(_ENGINE / "shaders", _ENGINE.parent / "shaders")


def resource_dir() -> Path:
    """Folder of the GUI resources (icons, style sheets)."""
    return _find(_ENGINE.parent / "app" / "resources", _ENGINE.parent / "resources")
