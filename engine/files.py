"""Files written whole or not at all.

Every file the engine writes for a user (outputs, traces, checkpoints, run records, caches)
goes through ``write_atomically``: the bytes go to a temp file beside the target and a
rename puts them in place, so a full disk, a crash or Ctrl-C leaves the old file (or none),
never half of one. What is already at the path decides the rest: a regular file keeps its
permissions; a symbolic link is written through (its target is replaced, the link stays); a
device or a pipe (``--output /dev/null``, a FIFO a reader waits on) is written into
directly, since renaming over it would replace it with a file; a folder is refused. A new
file gets 0666 less the umask, as ``open`` would give it.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import OutputError

Content = bytes | str | Callable[[BinaryIO], None]


def write_atomically(path, content: Content, durable: bool = False, make_parents: bool = False) -> Path:
    """Write ``content`` (bytes, text as UTF-8, or a function writing into a binary file)
    to ``path``; ``durable``: fsync before the rename (checkpoints); ``make_parents``:
    create missing folders first. Returns the path. Any failure is an ``OutputError``
    naming the path, with the target untouched."""
    path = Path(path)
    if make_parents:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        mode = os.stat(path).st_mode   # of what a link leads to
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputError(f"cannot write {path}: it is a folder")
    if mode is not None and not stat.S_ISREG(mode):
        _write_into(path, content)
    else:
        target = Path(os.path.realpath(path)) if path.is_symlink() else path
        _write_and_rename(path, target, content, mode, durable)
    return path


def json_text(obj, indent: int | None = 2) -> str:
    """``obj`` as JSON every reader accepts: NaN and infinities (a diverged loss, a
    dispatch never timed) become null, numpy scalars plain numbers."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False)


def _finite(obj):
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "tolist"):   # numpy arrays and scalars
        return _finite(obj.tolist()) if getattr(obj, "ndim", 0) else _finite(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _write(f: BinaryIO, content: Content) -> None:
    if callable(content):
        content(f)
    else:
        f.write(content.encode() if isinstance(content, str) else content)


def _write_into(path: Path, content: Content) -> None:
    """A device or a pipe (or a link to one, /dev/stdout): its own bytes, no rename."""
    try:
        with open(path, "wb") as f:
            _write(f, content)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


def _write_and_rename(path: Path, target: Path, content: Content, mode: int | None, durable: bool) -> None:
    parent = target.parent if str(target.parent) else Path(".")
    tmp = parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask applies
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            _write(f, content)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, target)
    except OSError as e:
        _remove(tmp)
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: Path) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass
