"""The Studio's workers (superqt thread_worker) send a value to the UI thread at every
training or profiling step. PySide6 6.12.0 drops a reference of each object sent by a
cross-thread signal and aborts the process within a few thousand steps ("deallocating
None"); pyproject.toml excludes it. This runs the pattern in a child process, since the
failure is an abort, not an exception."""

import subprocess
import sys
import textwrap


def test_many_yields_from_a_worker_thread_keep_reference_counts():
    script = textwrap.dedent("""
        import os, sys
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        from PySide6.QtCore import QCoreApplication
        from superqt.utils import thread_worker

        app = QCoreApplication([])

        @thread_worker
        def steps(n):
            for i in range(n):
                yield None

        before = sys.getrefcount(None)
        got = [0]
        worker = steps(20000, _start_thread=False)
        worker.yielded.connect(lambda v: got.__setitem__(0, got[0] + 1))
        worker.finished.connect(app.quit)
        worker.start()
        app.exec()
        print(got[0], sys.getrefcount(None) - before)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    received, drift = map(int, run.stdout.split())
    assert received == 20000
    assert abs(drift) < 1000


def test_cyclic_garbage_is_collected_on_the_gui_thread_while_a_window_is_open(qtbot, tmp_path):
    """While a Studio window is open a worker's allocations never run the cyclic
    collector (which could finalize Qt objects there and deadlock against the GUI
    thread); a timer on the GUI thread collects instead, and the GIL changes hands every
    millisecond; closing the last window switches both back."""
    import gc
    import threading

    from PySide6.QtCore import QSettings

    from app import main_thread_gc
    from app.window import MainWindow

    assert gc.isenabled()
    interval = sys.getswitchinterval()
    w = MainWindow("mlp", settings=QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat),
                   model_settings={"batch": 4})
    qtbot.addWidget(w)
    assert not gc.isenabled()
    assert sys.getswitchinterval() == main_thread_gc.GUI_SWITCH_INTERVAL   # the GIL back to the GUI sooner
    w.wait_for_workers(60)

    class Cycle:
        pass

    collected_on = []

    class Marker:
        def __init__(self):
            self.me = self

        def __del__(self):
            collected_on.append(threading.current_thread() is threading.main_thread())

    def allocate():
        Marker()
        for _ in range(50_000):
            c = Cycle()
            c.me = c
    worker = threading.Thread(target=allocate)
    worker.start()
    worker.join()
    assert collected_on == []                      # nothing collected on the worker
    qtbot.waitUntil(lambda: collected_on == [True], timeout=5000)
    w.close()
    assert gc.isenabled() and sys.getswitchinterval() == interval
    assert main_thread_gc.collect_due() >= 0
