"""The GUI resources: application icon (SVG + PNGs), the .desktop entry, the light and
dark style sheets and their application to the window (app/theme.py)."""

import configparser

import pytest

from engine.paths import resource_dir

SIZES = (16, 32, 64, 128, 256)


@pytest.fixture
def window(qtbot, tmp_path):
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from app import theme
    from app.main import create_window

    w = create_window("mlp", settings=QSettings(str(tmp_path / "studio.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(w)
    w.show()
    yield w
    w.wait_for_workers(60)
    theme.apply(QApplication.instance(), w, theme.LIGHT)    # the app palette is process-wide


def test_icon_files_exist_and_load(qapp):
    from PySide6.QtGui import QIcon, QImage

    folder = resource_dir()
    for size in SIZES:
        path = folder / f"icon-{size}.png"
        assert path.is_file(), path
        image = QImage(str(path))
        assert not image.isNull(), path
        assert (image.width(), image.height()) == (size, size), path
        assert not QIcon(str(path)).isNull()
    from app.theme import icon
    sizes = {(s.width(), s.height()) for s in icon().availableSizes()}
    assert {(s, s) for s in SIZES} <= sizes


def test_svg_renders(qapp):
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(resource_dir() / "icon.svg"))
    assert renderer.isValid()
    image = QImage(64, 64, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    renderer.render(painter)
    painter.end()
    opaque = sum(image.pixelColor(x, y).alpha() > 0 for x in range(64) for y in range(64))
    assert opaque > 64 * 64 // 2           # the tile covers most of it
    colours = {image.pixelColor(x, 32).rgb() for x in range(64)}
    assert len(colours) > 4                # and something is drawn on the tile


def test_desktop_entry():
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str               # keys are case-sensitive
    parser.read_string((resource_dir() / "meganeura-studio.desktop").read_text(encoding="utf-8"))
    entry = parser["Desktop Entry"]
    assert entry["Type"] == "Application"
    assert entry["Name"] == "Meganeura Studio"
    assert entry["Comment"]
    assert entry["Exec"] == "meganeura-studio %F"
    assert entry["Icon"] == "meganeura-studio"
    assert entry["Terminal"] == "false"
    assert entry["Categories"].endswith(";") and {"Development", "Science"} <= set(entry["Categories"].split(";"))
    assert entry["MimeType"].endswith(";")
    known = {"Type", "Version", "Name", "GenericName", "Comment", "Exec", "Icon", "Terminal", "Categories",
             "MimeType", "Keywords", "StartupWMClass", "TryExec", "StartupNotify", "NoDisplay"}
    assert set(entry) <= known, set(entry) - known


def test_stylesheets_load():
    from app import theme

    light, dark = theme.stylesheet("light"), theme.stylesheet("dark")
    assert "QTabBar::tab" in light and "QHeaderView::section" in light
    assert "QTabBar::tab" in dark and "QHeaderView::section" in dark
    assert light != dark
    with pytest.raises(ValueError):
        theme.stylesheet("sepia")


def test_scheme_from_system_value():
    from PySide6.QtCore import Qt

    from app import theme

    assert theme._check(Qt.ColorScheme.Dark) == "dark"
    assert theme._check(Qt.ColorScheme.Light) == "light"
    assert theme._check(Qt.ColorScheme.Unknown) == "light"
    assert theme.current_scheme() in theme.SCHEMES


def test_window_icon_and_title(window):
    assert not window.windowIcon().isNull()
    assert window.windowTitle() == "mlp — Meganeura Studio"


def test_theme_applies_and_switches(window, qapp):
    import pyqtgraph as pg
    from PySide6.QtGui import QPalette

    from app import theme
    from app.graph_view import GraphCanvas

    # the window starts on the system's scheme (offscreen: Unknown, so light)
    assert window.styleSheet() == theme.stylesheet(theme.current_scheme())
    plots = window.findChildren(pg.PlotWidget)
    assert len(plots) >= 2
    canvas = window.findChild(GraphCanvas)

    assert theme.apply(qapp, window, "dark") == "dark"
    assert window.styleSheet() == theme.stylesheet("dark")
    assert qapp.palette().color(QPalette.ColorRole.Window).lightness() < 80
    assert window.palette().color(QPalette.ColorRole.Text).lightness() > 180
    for plot in plots:
        assert plot.backgroundBrush().color().lightness() < 80
        assert plot.getPlotItem().getAxis("left").textPen().color().lightness() > 150
    assert canvas.backgroundBrush().color().lightness() < 80

    assert theme.apply(qapp, window, "light") == "light"
    assert window.styleSheet() == theme.stylesheet("light")
    assert qapp.palette().color(QPalette.ColorRole.Window).lightness() > 200
    for plot in plots:
        assert plot.backgroundBrush().color().lightness() > 200
    assert canvas.backgroundBrush().color().lightness() > 200


def test_theme_follows_system_change(window, qapp):
    """The window re-applies the scheme when the system's colour scheme changes."""
    from PySide6.QtCore import Qt

    from app import theme

    hints = qapp.styleHints()
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)
    assert window.styleSheet() == theme.stylesheet("dark")
    hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
    assert window.styleSheet() == theme.stylesheet("light")
