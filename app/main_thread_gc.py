"""Cyclic garbage is collected on the GUI thread only, while a Studio window is open.

Python runs its cyclic collector on whichever thread allocates past the threshold. On
a Studio worker (optimizing, training or profiling) that collection may finalize Qt
objects the GUI thread let go of: their destructors take Qt's locks and then wait for
the GIL, while the GUI thread, holding the GIL, waits on the same locks inside another
destructor, and both hang (seen in the test suite: a worker fusing a graph, the GUI
thread deleting a menu). So while a window is open, automatic collection is off and a
timer on the GUI thread collects each generation when the automatic collector would
have. The last window to close switches automatic collection back on.

While a window is open the interpreter also hands the GIL over every millisecond
(``GUI_SWITCH_INTERVAL``; Python's default is 5 ms): a worker building a session holds
it in long Python stretches, and each of the GUI thread's steps (the Runs panel adding
the new run's curves as a training starts) waited up to an interval for it. The event
loop's longest stall at a run's start went from 0.06-0.16 s to 0.03-0.05 s (pytest-qt,
lavapipe; 0.28 s under a loaded machine had failed its 0.25 s bound), the run's time
unchanged.
"""

from __future__ import annotations

import gc
import sys

from PySide6.QtCore import QCoreApplication, QTimer

GUI_SWITCH_INTERVAL = 0.001   # seconds between GIL hand-offs while a window is open

_holders: set[int] = set()
_timer: QTimer | None = None
_was_enabled = True
_was_interval = 0.005


def collect_due() -> int:
    """Collect the oldest generation whose threshold is passed, as the automatic
    collector does (``gc.get_threshold``); the number of objects found unreachable."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (2, 1, 0):
        if thresholds[generation] and counts[generation] > thresholds[generation]:
            return gc.collect(generation)
    return 0


def hold(owner) -> None:
    """Collect on the GUI thread only while ``owner`` (a window) holds it; released by
    ``release(owner)`` or, failing that, when the Qt object is destroyed. Holding twice
    is holding once."""
    global _timer, _was_enabled, _was_interval
    key = id(owner)
    if key in _holders:
        return
    if not _holders:
        _was_enabled, _was_interval = gc.isenabled(), sys.getswitchinterval()
        gc.disable()
        sys.setswitchinterval(GUI_SWITCH_INTERVAL)
        _timer = QTimer(QCoreApplication.instance())
        _timer.setInterval(100)
        _timer.timeout.connect(collect_due)
        _timer.start()
    _holders.add(key)
    owner.destroyed.connect(lambda *_: _release_key(key))


def release(owner) -> None:
    """``owner`` no longer needs it; the last one restores automatic collection."""
    _release_key(id(owner))


def _release_key(key: int) -> None:
    global _timer
    if key not in _holders:
        return
    _holders.discard(key)
    if not _holders:
        if _timer is not None:
            _timer.stop()
            _timer.deleteLater()
            _timer = None
        gc.collect()
        if _was_enabled:
            gc.enable()
        sys.setswitchinterval(_was_interval)
