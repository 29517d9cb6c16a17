import os

# No display on CI machines: Qt renders offscreen. Must happen before Qt loads.
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
