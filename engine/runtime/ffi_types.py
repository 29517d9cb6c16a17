"""wgpu-native's C types, parsed in one pass when a process starts.

wgpu-py talks to wgpu-native through cffi in ABI mode: the first time it allocates a
struct of a type (``ffi.new("WGPUBufferDescriptor *")``) cffi parses the type's name with
pycparser, and every such parse reads again a preamble declaring each typedef of
webgpu.h: ~17 ms a type on the 2-core CI machine, some 40 types to create a device, build
a session and run a step, most of a warm build. The names a process parsed are kept in
the cache folder (one file per wgpu-py version); the next process parses them all at
once (one preamble, tens of ms) before wgpu-py asks for any. Dawn's bindings are
compiled (cffi's API mode) and parse nothing at run time.

This reaches into cffi's internals (its parser and its table of parsed types); where
they differ, nothing is parsed ahead and wgpu-py parses each type itself, as before.
"""

from __future__ import annotations

import atexit
import json
import threading
from importlib import metadata
from pathlib import Path

from ..compile.cache import cache_root, read_entry, write_entry

_lock = threading.Lock()
_started = False


def names_file() -> Path:
    """The file of the type names, per wgpu-py version, in the cache folder."""
    try:
        version = metadata.version("wgpu")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return cache_root() / "ffi-types" / f"wgpu-{version}.json"


def parsed_names(ffi) -> list[str]:
    """The C type names ``ffi`` has parsed so far (its table also holds a module's dunders)."""
    return sorted(k for k in list(ffi._parsed_types) if isinstance(k, str) and not k.startswith("__"))


def parse_at_once(ffi, names: list[str]) -> bool:
    """Parse every type in ``names`` that ``ffi`` has not parsed yet, in one pass of its
    parser, and enter each in its table as ``ffi.typeof`` would. False (and nothing
    entered) when a name does not parse or cffi's internals are not the ones expected."""
    try:
        with ffi._lock:
            todo = [n for n in dict.fromkeys(names) if n not in ffi._parsed_types]
            if not todo:
                return True
            parser = ffi._parser
            source = "\n".join(f"void __meganeura_{i}(\n{n}\n);" for i, n in enumerate(todo))
            declarations = parser._parse(source)[0].ext[-len(todo):]
            entries = {}
            for name, declaration in zip(todo, declarations):
                ctype, _ = parser._get_type_and_quals(declaration.type.args.params[0].type)
                function = ctype.is_raw_function
                entries[name] = (ffi._get_cached_btype(ctype.as_function_pointer() if function else ctype), function)
            ffi._parsed_types.update(entries)
        return True
    except Exception:   # a name this wgpu-native lacks, or another cffi: wgpu-py parses each as before
        return False


def remember(ffi, path: Path, known: set[str]) -> None:
    """Write the names ``ffi`` has parsed to ``path`` when they are more than ``known``."""
    names = parsed_names(ffi)
    if not set(names) <= known:
        write_entry(path, json.dumps(sorted(known | set(names))), "wgpu type names")


def load_names(path: Path) -> list[str]:
    """The type names remembered at ``path`` ([] when none, or with a warning when unreadable)."""
    def decode(data) -> list[str]:
        if not isinstance(data, list) or not all(isinstance(n, str) for n in data):
            raise ValueError("not a list of type names")
        return data
    return read_entry(path, "wgpu type names", decode) or []


def prewarm(ffi, path: Path | None = None) -> None:
    """Once a process: parse the type names cached at ``path`` (default ``names_file()``)
    at once, and at exit remember those the process added."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    path = path or names_file()
    names = load_names(path)
    if names and not parse_at_once(ffi, names):
        names = []   # rewrite the file with what this process parses
    atexit.register(remember, ffi, path, set(names))
