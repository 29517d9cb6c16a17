import os

# No display on CI machines: Qt renders offscreen. Must happen before Qt loads.
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# Execution plans are cached on disk; keep the tests' cache out of the user's home.
if "MEGANEURA_CACHE" not in os.environ:
    import tempfile

    os.environ["MEGANEURA_CACHE"] = tempfile.mkdtemp(prefix="meganeura-test-cache-")

# `meganeura train` writes a run directory under runs/ by default: keep the tests' out of the
# checkout, in a folder removed when the session ends (checkpoints take tens of MB).
TEST_RUNS = None
if "MEGANEURA_RUNS" not in os.environ:
    import tempfile

    TEST_RUNS = os.environ["MEGANEURA_RUNS"] = tempfile.mkdtemp(prefix="meganeura-test-runs-")

# The Studio's QSettings go to a throwaway ini file, never the user's real settings.
if "MEGANEURA_STUDIO_SETTINGS" not in os.environ:
    import tempfile

    os.environ["MEGANEURA_STUDIO_SETTINGS"] = os.path.join(
        tempfile.mkdtemp(prefix="meganeura-test-settings-"), "studio.ini")


import dataclasses  # noqa: E402
import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def configure():
    """``configure(precision="f16", matmul="64")``: the process's engine configuration with
    these fields (Config's, or its kernel Knobs') changed, restored after the test."""
    from engine import config

    previous = config.use(None)
    config.use(previous)
    knob_names = {f.name for f in dataclasses.fields(config.Knobs)}

    def change(**fields):
        base = config.current()
        knobs = {k: v for k, v in fields.items() if k in knob_names}
        rest = {k: v for k, v in fields.items() if k not in knob_names}
        config.use(dataclasses.replace(base, knobs=dataclasses.replace(base.knobs, **knobs), **rest))
        return config.current()

    yield change
    config.use(previous)


@pytest.fixture
def f32_kernels(configure):
    """f32 precision for the test, also where the suite runs with MEGANEURA_PRECISION=f16:
    for tests of f32 paths held to f32's tolerances (the f16 ones have their own tests,
    test_coop_matmul.py and test_attention_coop*.py). A module takes it with
    ``pytestmark = pytest.mark.usefixtures("f32_kernels")``."""
    configure(precision="f32")


@pytest.fixture
def simt_attention(configure):
    """f32 precision and the f32 flash attention kernels on the CUDA cores
    (``MEGANEURA_ATTENTION=tiled``), also where the device would multiply f32 attention as
    split products on its cooperative units (Dawn; test_attention_coop*.py test those):
    for the tests of the f32 kernels."""
    configure(precision="f32", attention="tiled")


@pytest.fixture(scope="session", autouse=True)
def remove_test_runs():
    """The run directories tests wrote under $MEGANEURA_RUNS go when the session ends."""
    yield
    if TEST_RUNS is not None:
        import shutil
        shutil.rmtree(TEST_RUNS, ignore_errors=True)


@pytest.fixture
def errors(monkeypatch):
    """The Studio's error dialogs (QMessageBox.critical) recorded as (title, text) instead of blocking."""
    from PySide6.QtWidgets import QMessageBox
    seen = []
    monkeypatch.setattr(QMessageBox, "critical", lambda parent, title, text, *a, **k: seen.append((title, text)))
    return seen


# Files of 30-90 s each on lavapipe (2026-11-26, two workers on two cores), heaviest first.
# pytest-xdist (--dist loadfile) hands files out in collection order; in name order two of
# them came late and one worker ran on alone: the suite took 264 s, this order 249 s.
SLOW_FILES = ("test_bench_smoke.py", "test_profile_models.py", "test_training_session.py", "test_studio.py",
              "test_audio_align_training.py")


def pytest_collection_modifyitems(items):
    """The slow files first (``SLOW_FILES``), the others in their usual order after them."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, Qt: millions of objects that live as
    long as the process) leaves the collector's generations, so that a full collection
    walks only what tests make. The Studio's, as its last window closes
    (app/main_thread_gc.py), took 0.2 s each, 4.9 s of three test files' 80; with the
    freeze the suite's CPU time went from 492 to 455 s in one A/B (2026-11-27)."""
    gc.collect()
    gc.freeze()
