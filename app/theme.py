"""The Studio's look: the application icon and a light or a dark scheme that follows the system.

``current_scheme()`` reads ``QGuiApplication.styleHints().colorScheme()`` (Dark gives
"dark"; Light and Unknown give "light"). ``apply(app, window, scheme)`` sets the
scheme's palette on the application (dialogs follow it), its style sheet
(``resources/<scheme>.qss``) on the window, and matching colours on the parts that
paint themselves: the pyqtgraph plots and the graph canvas. ``install(window)`` applies
the current scheme and re-applies it when the system's changes.
"""

from __future__ import annotations

from functools import lru_cache

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QIcon, QPalette

from engine.paths import resource_dir

LIGHT, DARK = "light", "dark"
SCHEMES = (LIGHT, DARK)
ICON_SIZES = (16, 32, 64, 128, 256)

# window, base, alternate base, text, button, highlight, disabled text, tooltip base
_PALETTES = {
    LIGHT: dict(window="#f4f5f7", base="#ffffff", alternate="#f6f8fa", text="#1f2328", button="#ffffff",
                highlight="#2f6fce", disabled="#9aa1a9", link="#1f5fbf"),
    DARK: dict(window="#1e2125", base="#24282d", alternate="#2a2e33", text="#e3e6ea", button="#2a2e34",
               highlight="#4a86d8", disabled="#6b727a", link="#7fb0f0"),
}
# plots: background, foreground (axes, labels, legend text); graph canvas background
PLOT_COLOURS = {LIGHT: ("#ffffff", "#3a4048"), DARK: ("#24282d", "#c9ced4")}
CANVAS_COLOURS = {LIGHT: "#fbfbfb", DARK: "#1b1e22"}


def current_scheme() -> str:
    """"dark" when the system says so, else "light" (Light and Unknown alike)."""
    app = QGuiApplication.instance()
    if app is None:
        return LIGHT
    return DARK if QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark else LIGHT


def _check(scheme) -> str:
    if isinstance(scheme, Qt.ColorScheme):     # colorSchemeChanged's argument
        return DARK if scheme == Qt.ColorScheme.Dark else LIGHT
    if scheme not in SCHEMES:
        raise ValueError(f"unknown colour scheme {scheme!r} (expected one of {', '.join(SCHEMES)})")
    return scheme


@lru_cache(maxsize=None)
def stylesheet(scheme: str) -> str:
    """The text of ``resources/<scheme>.qss``."""
    return (resource_dir() / f"{_check(scheme)}.qss").read_text(encoding="utf-8")


def palette(scheme: str) -> QPalette:
    c = _PALETTES[_check(scheme)]
    pal = QPalette()
    R, G = QPalette.ColorRole, QPalette.ColorGroup
    roles = {R.Window: c["window"], R.WindowText: c["text"], R.Base: c["base"], R.AlternateBase: c["alternate"],
             R.Text: c["text"], R.Button: c["button"], R.ButtonText: c["text"], R.ToolTipBase: c["base"],
             R.ToolTipText: c["text"], R.PlaceholderText: c["disabled"], R.Highlight: c["highlight"],
             R.HighlightedText: "#ffffff", R.Link: c["link"], R.BrightText: "#ff5555"}
    for role, colour in roles.items():
        pal.setColor(role, QColor(colour))
    for role in (R.WindowText, R.Text, R.ButtonText):
        pal.setColor(G.Disabled, role, QColor(c["disabled"]))
    dark = scheme == DARK
    for role, light_value, dark_value in ((R.Light, "#ffffff", "#3a3f46"), (R.Midlight, "#e3e7eb", "#30353b"),
                                          (R.Mid, "#c2c9d1", "#4a5058"), (R.Dark, "#9aa1a9", "#15171a"),
                                          (R.Shadow, "#6b727a", "#0c0d0f")):
        pal.setColor(role, QColor(dark_value if dark else light_value))
    return pal


def icon() -> QIcon:
    """The application icon: the SVG plus its PNG renderings (``scripts/render_icon.py``)."""
    folder = resource_dir()
    result = QIcon()
    for size in ICON_SIZES:
        png = folder / f"icon-{size}.png"
        if png.is_file():
            result.addFile(str(png))
    svg = folder / "icon.svg"
    if svg.is_file():
        result.addFile(str(svg))        # any other size (QtSvg's icon engine)
    return result


def style_plot(plot, scheme: str) -> None:
    """Background, axes, labels and legend of a ``pg.PlotWidget`` in the scheme's colours."""
    bg, fg = PLOT_COLOURS[_check(scheme)]
    plot.setBackground(bg)
    item = plot.getPlotItem()
    for name in ("left", "bottom", "top", "right"):
        axis = item.getAxis(name)
        axis.setPen(fg)
        axis.setTextPen(fg)
    legend = item.legend
    if legend is not None:
        legend.setLabelTextColor(fg)
        for _, label in legend.items:      # pyqtgraph 0.14 stores the colour but redraws no label
            label.setText(label.text)


def apply(app, window=None, scheme=None) -> str:
    """Apply ``scheme`` ("light", "dark" or a ``Qt.ColorScheme``; default: the system's)
    to ``app`` and ``window``; returns the scheme applied."""
    import pyqtgraph as pg

    scheme = _check(current_scheme() if scheme is None else scheme)
    bg, fg = PLOT_COLOURS[scheme]
    pg.setConfigOptions(background=bg, foreground=fg)   # plots made later
    if app is not None:
        app.setPalette(palette(scheme))     # the window and its dialogs take it from the app
    if window is not None:
        window.setStyleSheet(stylesheet(scheme))
        window.setProperty("colorScheme", scheme)
        for plot in window.findChildren(pg.PlotWidget):
            style_plot(plot, scheme)
        from .graph_view import GraphCanvas
        for canvas in window.findChildren(GraphCanvas):
            canvas.setBackgroundBrush(QColor(CANVAS_COLOURS[scheme]))
    return scheme


def install(window) -> str:
    """Apply the system's scheme to the application and ``window`` now and whenever it
    changes; ``window`` needs an ``apply_theme(scheme=None)`` slot (a bound method, so
    the connection ends with the window)."""
    QGuiApplication.styleHints().colorSchemeChanged.connect(window.apply_theme)
    return apply(QGuiApplication.instance(), window)
