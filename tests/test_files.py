"""engine.files: a file is written whole or not at all, through links, into devices and
pipes without replacing them, with the permissions ``open`` would give; JSON every reader
accepts; and the CLI's outputs and errors that rest on them."""

import errno
import json
import math
import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from engine.cli import main
from engine.errors import OutputError
from engine.files import json_text, write_atomically


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _read_fifo(path, into: list) -> threading.Thread:
    def read():
        with open(path, "rb") as f:
            into.append(f.read())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def test_writes_bytes_text_and_a_writer_and_leaves_no_temp(tmp_path):
    write_atomically(tmp_path / "a.bin", b"\x00\x01")
    write_atomically(tmp_path / "b.txt", "héllo")
    write_atomically(tmp_path / "c.npz", lambda f: np.savez(f, x=np.arange(3)))
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "héllo"
    assert np.load(tmp_path / "c.npz")["x"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.txt", "c.npz"]


def test_a_new_file_gets_open_s_permissions_and_an_old_one_keeps_its_own(tmp_path):
    new = write_atomically(tmp_path / "new.json", "{}")
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~_umask()
    old = tmp_path / "old.txt"
    old.write_text("before")
    old.chmod(0o640)
    write_atomically(old, "after")
    assert old.read_text() == "after" and stat.S_IMODE(old.stat().st_mode) == 0o640


def test_a_failed_write_keeps_the_old_file_and_names_the_path(tmp_path):
    path = tmp_path / "out.npz"
    path.write_bytes(b"old")

    def disk_full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match=f"cannot write {path}: No space left on device"):
        write_atomically(path, disk_full)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]


def test_an_interrupted_write_leaves_nothing_behind(tmp_path):
    def interrupted(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "out.bin", interrupted)
    assert not list(tmp_path.iterdir())


def test_a_link_is_written_through(tmp_path):
    target = tmp_path / "real.txt"
    target.write_text("before")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    write_atomically(link, "after")
    assert link.is_symlink() and target.read_text() == "after"


def test_a_pipe_is_written_into_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    write_atomically(fifo, b"through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    link = tmp_path / "stdout"   # as /dev/stdout leads to a pipe
    link.symlink_to(fifo)
    reader = _read_fifo(fifo, got)
    write_atomically(link, b"through the link")
    reader.join(10)
    assert got[-1] == b"through the link" and link.is_symlink() and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_folder_and_a_missing_folder_are_refused(tmp_path):
    with pytest.raises(OutputError, match="it is a folder"):
        write_atomically(tmp_path, b"x")
    with pytest.raises(OutputError, match="No such file or directory"):
        write_atomically(tmp_path / "missing" / "out.bin", b"x")
    write_atomically(tmp_path / "made" / "out.bin", b"x", make_parents=True)
    assert (tmp_path / "made" / "out.bin").read_bytes() == b"x"


def test_json_text_writes_null_for_what_json_cannot_hold():
    text = json_text({"loss": math.nan, "peak": -math.inf, "rows": np.array([1.5, np.nan]),
                      "step": np.int64(3), "done": np.bool_(True), "shape": (2, 3)})
    assert json.loads(text) == {"loss": None, "peak": None, "rows": [1.5, None], "step": 3,
                                "done": True, "shape": [2, 3]}
    assert "NaN" not in text and "Infinity" not in text


def test_run_writes_its_outputs_into_a_pipe(tmp_path, capsys):
    fifo = tmp_path / "outputs"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    assert main(["run", "mlp", "--backend", "reference", "--output", str(fifo)]) == 0
    reader.join(10)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    (tmp_path / "copy.npz").write_bytes(got[0])
    assert len(np.load(tmp_path / "copy.npz").files) >= 1


def test_run_on_a_full_disk_is_one_line_and_keeps_the_old_output(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.npz"
    out.write_bytes(b"old")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", no_space)
    assert main(["run", "mlp", "--backend", "reference", "--output", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"meganeura: error: cannot write {out}: No space left on device"
    assert not any("Traceback" in line for line in err)
    assert out.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.npz"]


def test_an_os_error_reaching_the_command_line_is_one_line(capsys, monkeypatch):
    from dataclasses import replace

    from engine.cli.registry import COMMANDS

    def gone(args):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/gone/data.npy")

    monkeypatch.setitem(COMMANDS, "models", replace(COMMANDS["models"], handler=gone))
    assert main(["models"]) == 2
    assert capsys.readouterr().err == "meganeura: error: /gone/data.npy: No such file or directory\n"


@pytest.mark.parametrize("setting", ["PRECISION=f64", "WGPU=vulkan", "DECODE_FOLDS=2", "ATTENTION_SPLITS=-1"])
def test_a_bad_environment_setting_is_one_line_before_anything_runs(setting):
    name, value = setting.split("=")
    env = {**os.environ, f"MEGANEURA_{name}": value}
    done = subprocess.run([sys.executable, "-m", "engine", "models"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()] and f"MEGANEURA_{name}={value!r}" in done.stderr
