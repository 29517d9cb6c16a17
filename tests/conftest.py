import os

# No display on CI machines: Qt renders offscreen. Must happen before Qt loads.
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# Execution plans are cached on disk; keep the tests' cache out of the user's home.
if "MEGANEURA_CACHE" not in os.environ:
    import tempfile

    os.environ["MEGANEURA_CACHE"] = tempfile.mkdtemp(prefix="meganeura-test-cache-")

# The Studio's QSettings go to a throwaway ini file, never the user's real settings.
if "MEGANEURA_STUDIO_SETTINGS" not in os.environ:
    import tempfile

    os.environ["MEGANEURA_STUDIO_SETTINGS"] = os.path.join(
        tempfile.mkdtemp(prefix="meganeura-test-settings-"), "studio.ini")
